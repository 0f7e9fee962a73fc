"""Result types of ``LLM.generate`` (vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from forwardkit.engine.logprobs import PromptLogprobs, SampleLogprobs

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput"]


@dataclass
class RequestMetrics:
    """When a prompt's requests reached the engine's milestones (``time.time()`` seconds, the
    field names of vLLM's ``RequestMetrics``); with ``n > 1`` the earliest completion's first
    token and the last completion's end.

    Attributes:
        arrival_time: queued by ``generate``.
        first_scheduled_time: first scheduled for a step.
        first_token_time: first token sampled (``first_token_time - arrival_time`` is the time
            to first token).
        finished_time: the last completion finished.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first token (None before it)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated completion.

    Attributes:
        index: completion index within the request (0 .. n-1).
        text: decoded text ("" when the model ships no tokenizer); cut before a matched stop
            string unless ``include_stop_str_in_output``.
        token_ids: generated token ids.
        cumulative_logprob: sum of the sampled tokens' logprobs (None unless ``logprobs`` was set).
        logprobs: per generated token, ``{token_id: Logprob}`` (None unless ``logprobs`` was set).
        finish_reason: "stop" (EOS, a stop token or a stop string), "length" (max_tokens /
            max_model_len) or None.
        stop_reason: the stop token id or stop string that ended generation, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Whether generation ended."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The outcome of one prompt.

    Attributes:
        request_id: the engine's id for the request.
        prompt: the prompt text, or None when token ids were given.
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: None for the first prompt token, then ``{token_id: Logprob}`` per
            prompt token (None unless ``prompt_logprobs`` was set).
        outputs: the completions (``n`` of them, by index).
        finished: whether every completion ended.
        num_cached_tokens: prompt tokens served from the prefix cache instead of computed,
            summed over the ``n`` completions (each completion's first admission counts).
        metrics: arrival, first scheduling, first token and finish times.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
