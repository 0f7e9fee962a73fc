"""``SamplingParams``: how one request picks its next tokens and when it stops.

Names, defaults and meanings follow vLLM 0.14.0's ``SamplingParams`` for the subset the
reference engine implements: ``n`` completions, temperature / top-k / top-p / min-p, seeds,
presence / frequency / repetition penalties, ``min_tokens``, stop token ids and stop strings,
sample and prompt logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_N", "SamplingParams", "SAMPLING_EPS"]

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Largest top_k (torch.long) and the seed range of torch.Generator.manual_seed.
_INT64_MAX = 2**63 - 1
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# Most completions one prompt may ask for: each is a request with its own KV blocks.
MAX_N = 4096


def _short(value: object, limit: int = 60) -> str:
    # imported here: only an error needs it, and this module must not import torch
    from forwardkit.config.utils import short_repr

    return short_repr(value, limit)  # depth-limited: a deeply nested value cannot recurse


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request.

    Attributes:
        n: completions per prompt. With a ``seed``, completion ``i`` samples with ``seed + i``.
        presence_penalty: subtracted from the logit of every token already generated (-2..2).
        frequency_penalty: subtracted once per earlier occurrence in the output (-2..2).
        repetition_penalty: tokens of the prompt or the output get positive logits divided by it
            and negative ones multiplied by it (1 = off; > 0).
        temperature: 0 (or below 1e-5) means greedy; otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability mass reaches ``top_p`` (1 = off).
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 = off.
        min_p: drop tokens whose probability is below ``min_p`` times the top one (0 = off).
        seed: per-request random seed (a private ``torch.Generator``); None = derived from the
            engine seed, so a whole ``LLM.generate`` call is still reproducible.
        stop: strings that end generation when they appear in the output text (needs the
            model's tokenizer); the text is cut before the string (see ``include_stop_str_in_output``).
        stop_token_ids: generation stops (finish reason ``"stop"``) after any of these tokens.
        ignore_eos: keep generating after the model's EOS token.
        max_tokens: maximum number of generated tokens; None = up to the model's max length.
        min_tokens: EOS, stop tokens and stop strings are ignored until this many tokens were generated.
        logprobs: per generated token, the log-probabilities of the ``logprobs`` most likely
            tokens plus the sampled one (None = off, -1 = the whole vocabulary). They are the
            model's raw log-softmax, before temperature, penalties and masks.
        prompt_logprobs: the same for every prompt token after the first.
        skip_special_tokens: drop special tokens when detokenizing.
        include_stop_str_in_output: keep the stop string (or stop token text) in the output text.
        skip_reading_prefix_cache: compute the whole prompt even where its blocks are cached
            (its blocks are still cached for others). None = True exactly when
            ``prompt_logprobs`` is set, since cached positions produce no prompt logprobs.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = field(default=None)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    skip_reading_prefix_cache: bool | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check every field again (``LLM.generate`` calls this on each ``SamplingParams`` it
        receives, so a field changed after construction is checked too) and normalise
        ``stop`` / ``stop_token_ids`` to lists; raises ``ValueError`` naming the field."""
        self._normalise_lists()
        self._verify()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the other knobs cannot change argmax, so switch them off (as vLLM does).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @staticmethod
    def _bad(name: str, value: object, accepted: str) -> ValueError:
        return ValueError(f"SamplingParams.{name}={_short(value)} is invalid; {accepted}")

    def _normalise_lists(self) -> None:
        ids = self.stop_token_ids
        if ids is None:
            self.stop_token_ids = []
        elif isinstance(ids, (list, tuple)):
            self.stop_token_ids = list(ids)
        else:
            raise self._bad("stop_token_ids", ids, "expected a list of non-negative token ids or None")
        stop = self.stop
        if stop is None:
            self.stop = []
        elif isinstance(stop, str):
            self.stop = [stop]
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            self.stop = list(stop)
        else:
            raise self._bad("stop", stop, "expected a string, a list of strings or None")
        if any(s == "" for s in self.stop):
            raise self._bad("stop", stop, "stop strings must not be empty")

    def _verify(self) -> None:
        bad = self._bad
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"expected an integer in [1, {MAX_N}] (completions per prompt)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, value, "expected a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "expected a finite number > 0 (1 = off)")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "expected a finite number >= 0 (0 = greedy)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "expected a number in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= _INT64_MAX:
            raise bad("top_k", self.top_k, "expected 0 or -1 (disabled) or an integer in "
                      "[1, 2**63 - 1] (a value >= the vocabulary size keeps every token)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "expected a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not _SEED_MIN <= self.seed <= _SEED_MAX - (self.n - 1)):
            # completion i seeds a torch.Generator with seed + i, which takes [-2**63, 2**64)
            raise bad("seed", self.seed, "expected None or an integer in [-2**63, 2**64 - n] "
                      f"(completion i uses seed + i; n={self.n})")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "expected an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "expected an integer >= 0")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "expected True or False")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must not exceed max_tokens={self.max_tokens}")
        for token in self.stop_token_ids or ():
            if not _is_int(token) or token < 0:
                raise bad("stop_token_ids", self.stop_token_ids, "expected non-negative integer token ids")
        skip = self.skip_reading_prefix_cache
        if not (skip is None or isinstance(skip, bool)):
            raise bad("skip_reading_prefix_cache", self.skip_reading_prefix_cache,
                      "expected True, False or None (= True when prompt_logprobs is set)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise bad(name, value, "expected None, an integer >= 0, or -1 (whole vocabulary)")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature below 1e-5)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether any of the presence / frequency / repetition penalties is active."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def all_stop_token_ids(self) -> set[int]:
        """The stop token ids as a set (EOS is handled separately, see ``ignore_eos``)."""
        return set(self.stop_token_ids or ())

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy (with ``changes`` applied) that can be modified without touching this one."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        fields.update(changes)
        return SamplingParams(**fields)


def as_params_list(
    sampling_params: SamplingParams | Iterable[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """Broadcast ``None`` / one ``SamplingParams`` / a list to one per request, checking the length."""
    if sampling_params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(sampling_params, SamplingParams):
        sampling_params.verify()  # fields may have been changed since it was built
        return [sampling_params for _ in range(count)]
    if not isinstance(sampling_params, (list, tuple)):
        raise ValueError(
            f"sampling_params={_short(sampling_params)} is invalid; expected a SamplingParams, "
            "a list of them (one per prompt) or None"
        )
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(
            f"got {len(params)} SamplingParams for {count} prompts; pass one SamplingParams "
            "or exactly one per prompt"
        )
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(
                f"sampling_params[{i}] is {type(p).__name__} {_short(p)}; expected SamplingParams"
            )
        try:
            p.verify()  # fields may have been changed since it was built
        except ValueError as exc:
            raise ValueError(f"sampling_params[{i}]: {exc}") from None
    return params
