"""Speculative decoding: n-gram drafts and exact rejection sampling.

Each step, a decoding request may carry up to ``k`` draft tokens (``Request.spec_token_ids``);
the target model runs its last token and the drafts in one step (``1 + k`` query tokens) and
:func:`verify` turns the ``1 + k`` logits rows into the tokens to emit:

- greedy: drafts are accepted while each equals the target's argmax at its position; the first
  mismatch emits the target's token; all accepted adds the bonus token of the last row;
- random: draft ``x`` drawn from ``q`` is accepted with probability ``min(1, p(x) / q(x))``;
  a rejection draws from the normalised residual ``max(0, p - q)``; all accepted draws the
  bonus token from the last row. An n-gram draft (or a greedy draft model's) is a point mass,
  ``q(x) = 1``: accepted with probability ``p(x)``, the residual is ``p`` without ``x``. Every
  emitted token is then distributed exactly as without speculation.

``p`` at each position is the sampler's distribution there (temperature, top-k/p, min-p,
penalties, ``min_tokens`` masks) as if the drafts before it had been generated, so penalties
and stop masks see the same history as without speculation. Logprobs are the target's raw
log-softmax at each emitted token's position.

:class:`NgramProposer` is prompt lookup: the longest suffix of the request's tokens (between
``prompt_lookup_min`` and ``prompt_lookup_max`` long) that occurs earlier, and the tokens that
followed its rightmost earlier occurrence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from forwardkit.config.scheduler import SPEC_METHODS_RUN, SpeculativeConfig
from forwardkit.engine.logprobs import Logprob, logprob_dicts
from forwardkit.engine.request import Request
from forwardkit.engine.sampler import Sampler

__all__ = ["NgramProposer", "SpecDecodeStats", "check_runnable", "verify"]


def check_runnable(spec: SpeculativeConfig | None, tensor_parallel_size: int = 1) -> None:
    """``ValueError`` naming the field when the engine cannot run ``spec``'s method."""
    if spec is None:
        return
    if spec.method not in SPEC_METHODS_RUN:
        raise ValueError(f"speculative_config.method={spec.method!r} is not supported by the "
                         f"forwardkit engine; accepted: {', '.join(map(repr, SPEC_METHODS_RUN))}")
    dtp = spec.draft_tensor_parallel_size
    if spec.method == "draft_model" and dtp is not None and dtp not in (1, tensor_parallel_size):
        raise ValueError(f"speculative_config.draft_tensor_parallel_size={dtp} is not supported; "
                         f"accepted: 1 or the target's tensor_parallel_size "
                         f"({tensor_parallel_size})")


class NgramProposer:
    """Prompt-lookup drafts (see the module docstring)."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        self.k = spec.num_speculative_tokens
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max
        self.max_model_len = max_model_len
        self.disable_by_batch_size = spec.disable_by_batch_size

    def propose_all(self, running: list[Request], decoding: list[Request]) -> None:
        """Set ``spec_token_ids`` of every request in ``decoding``."""
        for req in decoding:
            req.spec_token_ids = self.propose(req)

    @staticmethod
    def draft_probs(request: Request) -> torch.Tensor | None:
        """n-gram drafts are point masses: no distributions."""
        return None

    def propose(self, request: Request) -> list[int]:
        """Up to ``k`` draft tokens for ``request`` (empty: no match, or no room)."""
        room = self.max_model_len - request.num_tokens  # positions the drafts would take
        if request.max_output_tokens is not None:  # no drafts past the last token it may emit
            room = min(room, request.max_output_tokens - len(request.output_token_ids) - 1)
        k = min(self.k, room)
        if k <= 0:
            return []
        tokens = request.prompt_token_ids + request.output_token_ids
        return ngram_lookup(tokens, self.min_n, self.max_n, k)


def ngram_lookup(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The ``k`` tokens after the rightmost earlier occurrence of the longest suffix of
    ``tokens`` with a length in ``[min_n, max_n]`` ([] without a match).

    Where that continuation reaches the end of ``tokens`` it goes on with the drafts
    themselves: a match ``p`` tokens back predicts that the last ``p`` tokens repeat, so a
    loop yields ``k`` drafts, not only the few tokens between the match and the end."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = list(tokens[total - n:])
        first = suffix[0]
        # rightmost start j < total - n whose n tokens equal the suffix
        for j in range(total - n - 1, -1, -1):
            if tokens[j] == first and list(tokens[j:j + n]) == suffix:
                drafts: list[int] = []
                for i in range(j + n, j + n + k):
                    drafts.append(tokens[i] if i < total else drafts[i - total])
                return drafts
    return []


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: proposals (requests that carried drafts in a step), draft
    tokens, accepted tokens, and accepted tokens per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One request's verification."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.append(0)
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification on average (1 + accepted drafts)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def _target_row(sampler: Sampler, row: torch.Tensor, request: Request,
                history: list[int]) -> tuple[torch.Tensor | None, int]:
    """The sampler's distribution for ``request`` at one position as if ``history`` had been
    generated on top of its outputs: ``(probs, argmax)``; probs is None for greedy requests."""
    saved = request.output_token_ids
    request.output_token_ids = saved + history
    try:
        return sampler.target_distribution(row.unsqueeze(0), request)
    finally:
        request.output_token_ids = saved


def verify(sampler: Sampler, logits: torch.Tensor, request: Request, drafts: list[int],
           draft_probs: torch.Tensor | None = None,
           ) -> tuple[list[int], list[dict[int, Logprob]] | None]:
    """The tokens ``request`` emits from its ``1 + len(drafts)`` logits rows (the last real
    token's, then each draft's), and their logprob dicts when it asks for logprobs. At most
    ``len(drafts) + 1`` tokens: the accepted drafts, then the recovered or bonus token.
    ``draft_probs``: ``[>= len(drafts), vocab]``, the distribution each draft was drawn from
    (random sampling); None = point masses."""
    params = request.sampling_params
    emitted: list[int] = []
    final: int | None = None
    for i, draft in enumerate(drafts):
        probs, best = _target_row(sampler, logits[i], request, emitted)
        if probs is None:
            if best != draft:
                final = best
                break
        else:
            u = float(torch.rand((), generator=request.generator, device=probs.device))
            if draft_probs is None:  # q is a point mass on the draft
                rejected = u >= float(probs[draft])
            else:
                q = draft_probs[i].to(probs.device, probs.dtype)
                rejected = u * float(q[draft]) >= float(probs[draft])
            if rejected:
                if draft_probs is None:
                    residual = probs.clone()
                    residual[draft] = 0.0
                else:
                    residual = (probs - q).clamp_(min=0.0)
                total = float(residual.sum())
                # p == q up to rounding leaves no residual: p itself is then the right law
                final = sampler.draw(residual / total if total > 0 else probs, request)
                break
        emitted.append(draft)
    if final is None:  # every draft accepted: the bonus token from the last row
        probs, best = _target_row(sampler, logits[len(drafts)], request, emitted)
        final = best if probs is None else sampler.draw(probs, request)
    emitted.append(final)
    if params.logprobs is None:
        return emitted, None
    raw = logits[: len(emitted)].float().log_softmax(dim=-1)
    return emitted, logprob_dicts(raw, emitted, [params.logprobs] * len(emitted))
