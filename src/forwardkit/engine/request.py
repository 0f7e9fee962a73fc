"""``Request``: one prompt's state while the engine works on it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from forwardkit.engine.sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    """Where a request is in its life: waiting for admission, running, or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """A request: prompt tokens, generated tokens, KV blocks and progress.

    ``num_computed_tokens`` counts tokens whose KV entries are in the cache. The request
    still needs ``num_tokens - num_computed_tokens`` tokens run through the model; when that
    reaches the end, the logits of the last token give the next token. A preempted request
    drops its blocks and sets ``num_computed_tokens`` back to 0 (recompute).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        eos_token_id: int | Iterable[int] | None = None,
        max_model_len: int | None = None,
        generator: torch.Generator | None = None,
        index: int = 0,
        decode: Callable[[list[int]], str] | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; give at least one token")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # A model may have several EOS ids (Llama 3 lists two); any of them ends generation.
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset((eos_token_id,))
        else:
            self.eos_token_ids = frozenset(int(t) for t in eos_token_id)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generator = generator
        self.index = index  # completion index within its prompt (n > 1)
        # Logprobs, only kept when asked for (see SamplingParams.logprobs / prompt_logprobs).
        wants = sampling_params.logprobs is not None
        self.output_logprobs: list[Any] | None = [] if wants else None
        self.cumulative_logprob: float | None = 0.0 if wants else None
        # position p (>= 1) -> {token: Logprob} for prompt token p; filled chunk by chunk.
        self.prompt_logprobs: dict[int, Any] | None = (
            {} if sampling_params.prompt_logprobs is not None else None
        )
        # Stop strings: ``decode`` turns output ids into text; ``output_text`` is the (cut) text
        # once a stop string matched.
        self.decode = decode if sampling_params.stop else None
        self.output_text: str | None = None
        self._checked_text_len = 0
        self.num_preemptions = 0
        # Milestones (time.time()): queued, first scheduled, first token, finished.
        self.arrival_time = time.time()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # Prefix caching (``engine/block_manager.py``): the hashes of the full blocks of prompt +
        # output (token-derived, so they survive preemption), how many of this request's blocks
        # were registered / marked computed, and the prompt tokens its first admission found
        # cached (None until admitted).
        self.cache_salt = cache_salt
        # LoRA: the adapter's id (0: none) and what it adds to every block's hash
        self.lora_int_id = 0
        self.lora_cache_key: tuple[int, ...] = ()
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_marked_blocks = 0
        self.num_cached_tokens: int | None = None
        # Speculative decoding: the draft tokens proposed for the next step (their KV slots
        # are scheduled after the request's tokens; only accepted ones become tokens).
        self.spec_token_ids: list[int] = []
        # Cached prompt positions produce no prompt logprobs: a request that wants them computes
        # its whole prompt (SamplingParams.skip_reading_prefix_cache, True by default then).
        skip = sampling_params.skip_reading_prefix_cache
        self.skip_reading_prefix_cache = (self.prompt_logprobs is not None) if skip is None else skip
        # Generation may not go past max_tokens nor past the model's context length.
        limit = sampling_params.max_tokens
        if max_model_len is not None:
            room = max_model_len - len(self.prompt_token_ids)
            limit = room if limit is None else min(limit, room)
        self.max_output_tokens = limit

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold (prompt + max output)."""
        extra = self.max_output_tokens if self.max_output_tokens is not None else 0
        return self.num_prompt_tokens + max(extra, 0)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet run through the model."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """Whether the request stopped generating."""
        return self.status == RequestStatus.FINISHED

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Token ids of positions ``start .. stop-1`` of prompt + output."""
        n = self.num_prompt_tokens
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    def block_extra_keys(self, block_index: int) -> tuple[str | int, ...]:
        """What besides its tokens tells block ``block_index``'s KV apart from another request's
        (the ``cache_salt``, first block only: the chain carries it to every later block; the
        LoRA adapter's key, every block, as vLLM)."""
        if block_index == 0 and self.cache_salt is not None:
            return (*self.lora_cache_key, self.cache_salt)
        return self.lora_cache_key

    def drop_prompt_logprobs(self) -> None:
        """Stop computing prompt logprobs (an ``n > 1`` sibling: completion 0 computes them);
        the prefix cache becomes readable again unless the user turned it off explicitly."""
        self.prompt_logprobs = None
        if self.sampling_params.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = False

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt positions still lack their logprobs."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def append_token(self, token_id: int, logprobs: dict[int, Any] | None = None) -> bool:
        """Record a generated token (and its logprobs); returns True (and sets
        ``finish_reason``) if it ends the request."""
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.time()
        if self.output_logprobs is not None and logprobs is not None:
            self.output_logprobs.append(logprobs)
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprobs[token_id].logprob
        params = self.sampling_params
        generated = len(self.output_token_ids)
        if generated >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.finish_reason = "stop"
                return True
            if token_id in params.all_stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", token_id
                return True
        finished = False
        if self.max_output_tokens is not None and generated >= self.max_output_tokens:
            self.finish_reason, finished = "length", True
        if self.decode is not None and self._match_stop_string(generated >= params.min_tokens):
            return True  # a stop string wins over "length" on the same token, as in vLLM
        return finished

    def _match_stop_string(self, allowed: bool) -> bool:
        """Search the newly decoded text for a stop string; on a match cut the text and stop.

        Text decoded before ``min_tokens`` is reached (``allowed`` False) is never searched later.
        """
        assert self.decode is not None
        text = self.decode(self.output_token_ids)
        params = self.sampling_params
        stops = params.stop or []
        longest = max(len(s) for s in stops)
        start = max(0, self._checked_text_len - longest + 1)
        self._checked_text_len = len(text)
        if not allowed:
            return False
        best: tuple[int, str] | None = None
        for stop in stops:
            at = text.find(stop, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.output_text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, prompt_len={self.num_prompt_tokens}, "
            f"generated={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )
