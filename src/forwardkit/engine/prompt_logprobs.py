"""Prompt logprobs: the logprob of every prompt token after the first, chunk by chunk.

Position ``p``'s hidden state predicts token ``p + 1``. When a scheduled prefill chunk covers
prompt positions whose logprobs a request still lacks, the runner keeps that step's hidden
states and the LM head runs on just those rows. Steps without such requests pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forwardkit.engine.logprobs import logprob_dicts
from forwardkit.engine.request import Request

__all__ = ["PromptLogprobPlan", "plan_prompt_logprobs", "record_prompt_logprobs"]


@dataclass
class PromptLogprobPlan:
    """Flat hidden-state rows and, per row, its request and the prompt position it scores."""

    rows: list[int]
    targets: list[tuple[Request, int]]


def plan_prompt_logprobs(requests: list[Request], num_scheduled: list[int]) -> PromptLogprobPlan | None:
    """Which rows of this step score prompt tokens still lacking logprobs (None: no rows)."""
    rows: list[int] = []
    targets: list[tuple[Request, int]] = []
    offset = 0
    for req, n in zip(requests, num_scheduled):
        if req.needs_prompt_logprobs:
            assert req.prompt_logprobs is not None
            start = req.num_computed_tokens
            for pos in range(start, min(start + n, req.num_prompt_tokens - 1)):
                if pos + 1 not in req.prompt_logprobs:  # not scored before a preemption
                    rows.append(offset + pos - start)
                    targets.append((req, pos + 1))
        offset += n
    return PromptLogprobPlan(rows, targets) if rows else None


@torch.inference_mode()
def record_prompt_logprobs(logits: torch.Tensor, plan: PromptLogprobPlan) -> None:
    """Store the prompt logprobs of the planned rows, given their logits (``[len(plan.rows),
    vocab]``, the LM head on those rows' hidden states) on their requests."""
    logprobs = logits.float().log_softmax(dim=-1)
    tokens = [req.prompt_token_ids[pos] for req, pos in plan.targets]
    ks = [req.sampling_params.prompt_logprobs or 0 for req, _ in plan.targets]
    for (req, pos), d in zip(plan.targets, logprob_dicts(logprobs, tokens, ks)):
        assert req.prompt_logprobs is not None
        req.prompt_logprobs[pos] = d
