"""Turning finished requests into ``RequestOutput`` / ``CompletionOutput`` (vLLM's shapes)."""

from __future__ import annotations

from typing import Any

from forwardkit.engine.logprobs import Logprob
from forwardkit.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from forwardkit.engine.request import Request

__all__ = ["build_output", "completion_text"]


def completion_text(req: Request, tokenizer: Any) -> str:
    """The completion's text: cut at a matched stop string, and without the text of a final
    EOS / stop token unless ``include_stop_str_in_output`` (as vLLM's detokenizer)."""
    if tokenizer is None:
        return ""
    if req.output_text is not None:
        return req.output_text
    params = req.sampling_params
    ids = req.output_token_ids
    if (req.finish_reason == "stop" and not isinstance(req.stop_reason, str) and ids
            and not params.include_stop_str_in_output):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)


def _decode_tokens(dicts: list[dict[int, Logprob]], tokenizer: Any) -> None:
    if tokenizer is None:
        return
    for d in dicts:
        for tid, lp in d.items():
            lp.decoded_token = tokenizer.decode([tid])


def build_output(request_id: str, children: list[Request], tokenizer: Any) -> RequestOutput:
    """One prompt's output from its completion requests (``children``, by index)."""
    completions = []
    for req in sorted(children, key=lambda r: r.index):
        if req.output_logprobs is not None:
            _decode_tokens(req.output_logprobs, tokenizer)
        completions.append(CompletionOutput(
            index=req.index, text=completion_text(req, tokenizer),
            token_ids=list(req.output_token_ids), cumulative_logprob=req.cumulative_logprob,
            logprobs=req.output_logprobs, finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
        ))
    first = children[0]
    prompt_logprobs = None
    if first.prompt_logprobs is not None:
        # positions served from the prefix cache (skip_reading_prefix_cache=False) have None
        scored = [first.prompt_logprobs.get(p) for p in range(1, first.num_prompt_tokens)]
        _decode_tokens([d for d in scored if d is not None], tokenizer)
        prompt_logprobs = [None, *scored]
    return RequestOutput(
        request_id=request_id, prompt=first.prompt, prompt_token_ids=list(first.prompt_token_ids),
        prompt_logprobs=prompt_logprobs, outputs=completions,
        finished=all(r.is_finished for r in children),
        num_cached_tokens=sum(r.num_cached_tokens or 0 for r in children),
        metrics=_metrics(children),
    )


def _metrics(children: list[Request]) -> RequestMetrics:
    def first(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return min(known) if known else None

    ends = [r.finished_time for r in children]
    return RequestMetrics(
        arrival_time=min(r.arrival_time for r in children),
        first_scheduled_time=first([r.first_scheduled_time for r in children]),
        first_token_time=first([r.first_token_time for r in children]),
        finished_time=None if None in ends else max(e for e in ends if e is not None),
    )
