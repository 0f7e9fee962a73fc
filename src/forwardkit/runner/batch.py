"""``StepBatch``: what the scheduler hands the model runner for one forward step.

It lives in the execution layer (not the engine) so the runner never imports the engine;
any scheduler that fills these lists can drive a ``ModelRunner``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepBatch"]


@dataclass
class StepBatch:
    """One step's requests, in batch order.

    Attributes:
        req_ids: request ids (for logging and output mapping).
        token_ids: per request, the token ids scheduled this step (prompt chunk or one decode token).
        num_computed_tokens: per request, tokens already in the KV cache = position of the
            first scheduled token.
        block_tables: per request, its KV block ids in position order (covering every token
            up to ``num_computed_tokens + len(token_ids)``).
        sample: per request, whether the logits of its last scheduled token are wanted (the
            prompt is fully computed after this step, or it is decoding). Default: all True.
        lora_slots: per request, the LoRA slot its tokens use (-1: no adapter); None = none.
    """

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample: list[bool] | None = None
    lora_slots: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.req_ids)
        if self.sample is None:
            self.sample = [True] * n
        lengths = {
            "token_ids": len(self.token_ids),
            "num_computed_tokens": len(self.num_computed_tokens),
            "block_tables": len(self.block_tables),
            "sample": len(self.sample),
        }
        if self.lora_slots is not None:
            lengths["lora_slots"] = len(self.lora_slots)
        for name, length in lengths.items():
            if length != n:
                raise ValueError(
                    f"StepBatch.{name} has {length} entries but there are {n} requests; "
                    "every per-request list needs one entry per request"
                )
        for rid, tokens in zip(self.req_ids, self.token_ids):
            if not tokens:
                raise ValueError(f"StepBatch: request {rid!r} has no scheduled tokens")

    @property
    def has_lora(self) -> bool:
        """Whether any request of the step uses an adapter."""
        return any(s >= 0 for s in self.lora_slots or ())

    @property
    def num_reqs(self) -> int:
        """Requests in the step."""
        return len(self.req_ids)

    @property
    def query_lens(self) -> list[int]:
        """Scheduled tokens per request."""
        return [len(t) for t in self.token_ids]

    @property
    def seq_lens(self) -> list[int]:
        """Context length per request after this step."""
        return [c + len(t) for c, t in zip(self.num_computed_tokens, self.token_ids)]

    @property
    def num_tokens(self) -> int:
        """Total scheduled tokens (the unpadded token count)."""
        return sum(len(t) for t in self.token_ids)

    @property
    def max_query_len(self) -> int:
        """Largest per-request scheduled token count (0 when empty)."""
        return max((len(t) for t in self.token_ids), default=0)

    def flat_token_ids(self) -> list[int]:
        """All scheduled token ids, request after request."""
        return [t for tokens in self.token_ids for t in tokens]

    def flat_positions(self) -> list[int]:
        """Positions of all scheduled tokens, request after request."""
        return [
            p
            for start, tokens in zip(self.num_computed_tokens, self.token_ids)
            for p in range(start, start + len(tokens))
        ]

    def logits_indices(self) -> list[int]:
        """Row (in the flat token order) of the last token of every request with ``sample``."""
        rows, end = [], 0
        for tokens, wanted in zip(self.token_ids, self.sample or ()):
            end += len(tokens)
            if wanted:
                rows.append(end - 1)
        return rows
