"""Presence, frequency and repetition penalties on next-token logits (vLLM 0.14.0 semantics).

For one request with prompt tokens ``P`` and generated tokens ``O`` (``count[t]`` = occurrences
of ``t`` in ``O``), in this order:

* repetition (``r``): for ``t`` in ``P`` or ``O``, ``logit / r`` if the logit is positive,
  ``logit * r`` otherwise;
* frequency (``f``): ``logit - f * count[t]``;
* presence (``p``): ``logit - p`` when ``count[t] > 0``.

Only rows of requests with a penalty set are touched, so unpenalised batches pay nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forwardkit.engine.request import Request

__all__ = ["apply_penalties"]


def _prompt_mask(req: Request, vocab: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[vocab]`` of the prompt's tokens, built once per request."""
    mask = getattr(req, "_prompt_token_mask", None)
    if mask is None or mask.device != device or mask.shape[0] != vocab:
        ids = torch.tensor(req.prompt_token_ids, dtype=torch.long, device=device)
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        mask[ids[ids < vocab]] = True
        req._prompt_token_mask = mask  # type: ignore[attr-defined]
    return mask


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Apply each request's penalties to its row of ``logits`` ``[len(requests), vocab]`` in place."""
    vocab = logits.shape[-1]
    for i, req in enumerate(requests):
        params = req.sampling_params
        if not params.has_penalties:
            continue
        row = logits[i]
        out_ids = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out_ids[out_ids < vocab], minlength=vocab).to(row.dtype)
        seen_out = counts > 0
        if params.repetition_penalty != 1.0:
            seen = seen_out | _prompt_mask(req, vocab, logits.device)
            r = params.repetition_penalty
            row.copy_(torch.where(seen, torch.where(row > 0, row / r, row * r), row))
        if params.frequency_penalty != 0.0:
            row.sub_(params.frequency_penalty * counts)
        if params.presence_penalty != 0.0:
            row.sub_(params.presence_penalty * seen_out.to(row.dtype))
    return logits
