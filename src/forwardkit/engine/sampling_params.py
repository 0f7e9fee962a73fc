"""``SamplingParams``: how one request picks its next tokens and when it stops.

Names, defaults and meanings follow vLLM 0.14.0's ``SamplingParams`` for the subset the
reference engine implements (one completion per request, no penalties, no logprobs).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["SamplingParams", "SAMPLING_EPS"]

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request.

    Attributes:
        n: completions per prompt; only 1 is supported by the reference engine.
        temperature: 0 (or below 1e-5) means greedy; otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability mass reaches ``top_p`` (1 = off).
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 = off.
        min_p: drop tokens whose probability is below ``min_p`` times the top one (0 = off).
        seed: per-request random seed (a private ``torch.Generator``); None = derived from the
            engine seed, so a whole ``LLM.generate`` call is still reproducible.
        max_tokens: maximum number of generated tokens; None = up to the model's max length.
        min_tokens: EOS and stop tokens are masked until this many tokens were generated.
        stop_token_ids: generation stops (finish reason ``"stop"``) after any of these tokens.
        ignore_eos: keep generating after the model's EOS token.
        skip_special_tokens: drop special tokens when detokenizing.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] | None = field(default=None)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self._verify()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the other knobs cannot change argmax, so switch them off (as vLLM does).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        def bad(name: str, value: object, accepted: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={value!r} is invalid; {accepted}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n != 1:
            raise bad("n", self.n, "the reference engine supports n=1 only")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", self.temperature, "expected a number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "expected a number in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", self.top_k, "expected 0 or -1 (disabled) or an integer >= 1")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "expected a number in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", self.seed, "expected an integer or None")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            raise bad("max_tokens", self.max_tokens, "expected an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "expected an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens", self.min_tokens, f"must not exceed max_tokens={self.max_tokens}"
            )
        for token in self.stop_token_ids:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise bad("stop_token_ids", self.stop_token_ids, "expected non-negative integers")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature below 1e-5)."""
        return self.temperature < SAMPLING_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        """The stop token ids as a set (EOS is handled separately, see ``ignore_eos``)."""
        return set(self.stop_token_ids or ())

    def clone(self) -> SamplingParams:
        """A copy that can be modified without touching this one."""
        return SamplingParams(**{k: getattr(self, k) for k in self.__dataclass_fields__})


def as_params_list(
    sampling_params: SamplingParams | Iterable[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """Broadcast ``None`` / one ``SamplingParams`` / a list to one per request, checking the length."""
    if sampling_params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params for _ in range(count)]
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(
            f"got {len(params)} SamplingParams for {count} prompts; pass one SamplingParams "
            "or exactly one per prompt"
        )
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(p).__name__}: {p!r}")
    return params
