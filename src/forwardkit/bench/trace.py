"""Serving-like step traces for ``forwardkit bench``.

A trace is a list of :class:`Step`: per request, how many tokens are scheduled this step
(``query_lens``) and how many of its tokens are already in the KV cache (``context_lens``).
Every contender runs exactly the same steps.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

__all__ = ["BUILTIN_TRACES", "Step", "load_trace", "make_trace"]

BUILTIN_TRACES = ("decode-heavy", "prefill-heavy", "mixed")
_DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
_PREFILL_CHUNKS = (32, 64, 128, 256, 512)


@dataclass(frozen=True)
class Step:
    """One forward step: per-request scheduled tokens and tokens already cached."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens in the step."""
        return sum(self.query_lens)

    @property
    def num_reqs(self) -> int:
        """Requests in the step."""
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """Every request schedules exactly one token."""
        return all(q == 1 for q in self.query_lens)

    def to_json(self) -> dict[str, list[int]]:
        """JSON form (also accepted by :func:`load_trace`)."""
        return {"query_lens": list(self.query_lens), "context_lens": list(self.context_lens)}


def _decode(rng: random.Random, batch: int, max_len: int = 1 << 30) -> Step:
    # contexts up to max_len - 1, so that context + the new token fit the model
    top = min(384, max_len - 1)
    return Step((1,) * batch, tuple(rng.randint(min(16, top), top) for _ in range(batch)))


def _prefill(rng: random.Random, chunk: int, context: int = 0) -> Step:
    return Step((chunk,), (context,))


def _mixed(rng: random.Random, decodes: int, chunk: int, max_len: int = 1 << 30) -> Step:
    step = _decode(rng, decodes, max_len)
    contexts = [c for c in (0, 64, 128) if c + chunk <= max_len] or [0]
    return Step(step.query_lens + (chunk,), step.context_lens + (rng.choice(contexts),))


def make_trace(name: str, num_steps: int, seed: int = 0, max_tokens: int = 512,
               max_len: int | None = None) -> list[Step]:
    """A built-in trace: ``decode-heavy`` (7 of 8 steps decode), ``prefill-heavy`` (3 of 4
    steps prefill chunks) or ``mixed`` (decodes plus a prefill chunk in one step).

    Token counts never exceed ``max_tokens`` (the engine's ``max_num_batched_tokens``), and no
    request's context + scheduled tokens exceed ``max_len`` (the model's ``max_model_len``).
    """
    if name not in BUILTIN_TRACES:
        raise ValueError(f"unknown trace {name!r}; expected one of {list(BUILTIN_TRACES)} or a JSON file")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    limit = 1 << 30 if max_len is None else max_len
    if limit < 2:
        raise ValueError(f"max_len must be >= 2 (a context and a new token), got {max_len}")
    rng = random.Random(seed)
    decodes = [b for b in _DECODE_BATCHES if b <= max_tokens]
    cap = min(max_tokens, limit)
    chunks = [c for c in _PREFILL_CHUNKS if c <= cap] or [cap]
    steps: list[Step] = []
    for i in range(num_steps):
        if name == "decode-heavy":
            step = (_prefill(rng, rng.choice(chunks)) if i % 8 == 7
                    else _decode(rng, rng.choice(decodes), limit))
        elif name == "prefill-heavy":
            step = (_decode(rng, rng.choice(decodes), limit) if i % 4 == 3
                    else _prefill(rng, rng.choice(chunks)))
        else:
            batch = rng.choice(decodes[:5])
            chunk = rng.choice([c for c in chunks if c + batch <= max_tokens]
                               or [min(max_tokens - batch, limit)])
            step = _mixed(rng, batch, chunk, limit) if chunk > 0 else _decode(rng, batch, limit)
        steps.append(step)
    return steps


def _step_from_json(entry: object, index: int, path: str) -> Step:
    if isinstance(entry, bool) or not isinstance(entry, (int, dict)):
        raise ValueError(
            f"{path}: step {index} is {entry!r}; expected a token count (int) or "
            '{"query_lens": [...], "context_lens": [...]}'
        )
    if isinstance(entry, int):
        if entry < 1:
            raise ValueError(f"{path}: step {index} has {entry} tokens; expected >= 1")
        # A bare count up to 64 is a decode batch of that many requests, above that a prefill chunk.
        return Step((1,) * entry, (128,) * entry) if entry <= 64 else Step((entry,), (0,))
    query = entry.get("query_lens")
    context = entry.get("context_lens", [0] * len(query or []))
    if (
        not isinstance(query, list)
        or not query
        or not all(isinstance(q, int) and q >= 1 for q in query)
        or not isinstance(context, list)
        or len(context) != len(query)
        or not all(isinstance(c, int) and c >= 0 for c in context)
    ):
        raise ValueError(
            f"{path}: step {index} must have 'query_lens' (non-empty list of ints >= 1) and "
            f"optional 'context_lens' (same length, ints >= 0); got {entry!r}"
        )
    return Step(tuple(query), tuple(context))


def load_trace(name_or_path: str, num_steps: int, seed: int = 0, max_tokens: int = 512,
               max_len: int | None = None) -> list[Step]:
    """A built-in trace by name, or a JSON file holding a list of steps (``max_len``: the
    model's ``max_model_len``; a file step beyond it is refused).

    In a file, each step is either an int (a decode batch of that many requests when <= 64,
    else one prefill chunk of that many tokens) or ``{"query_lens": [...], "context_lens": [...]}``.
    """
    if name_or_path in BUILTIN_TRACES:
        return make_trace(name_or_path, num_steps, seed, max_tokens, max_len)
    if not os.path.isfile(name_or_path):
        raise ValueError(
            f"trace {name_or_path!r} is neither a built-in trace {list(BUILTIN_TRACES)} nor a file"
        )
    try:
        with open(name_or_path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name_or_path}: not valid JSON ({exc})") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{name_or_path}: expected a non-empty JSON list of steps")
    steps = [_step_from_json(entry, i, name_or_path) for i, entry in enumerate(data)]
    too_big = [i for i, s in enumerate(steps) if s.num_tokens > max_tokens]
    if too_big:
        raise ValueError(
            f"{name_or_path}: step {too_big[0]} has {steps[too_big[0]].num_tokens} tokens, above "
            f"--max-num-batched-tokens {max_tokens}"
        )
    if max_len is not None:
        for i, step in enumerate(steps):
            longest = max(q + c for q, c in zip(step.query_lens, step.context_lens))
            if longest > max_len:
                raise ValueError(f"{name_or_path}: step {i} reaches position {longest}, beyond the "
                                 f"model's max_model_len {max_len} (raise --max-model-len up to "
                                 "the model's max_position_embeddings, or shorten the step)")
    return steps
