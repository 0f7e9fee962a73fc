"""Result types of ``LLM.generate`` (vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from forwardkit.engine.logprobs import PromptLogprobs, SampleLogprobs

__all__ = ["CompletionOutput", "RequestOutput"]


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
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0
