"""Result types of ``LLM.generate`` (vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "RequestOutput"]


@dataclass
class CompletionOutput:
    """One generated completion.

    Attributes:
        index: completion index within the request (always 0: n=1).
        text: decoded text ("" when the model ships no tokenizer).
        token_ids: generated token ids.
        finish_reason: "stop" (EOS or a stop token), "length" (max_tokens / max_model_len) or None.
        stop_reason: the stop token id that ended generation, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None

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
        outputs: the completions (one).
        finished: whether every completion ended.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
