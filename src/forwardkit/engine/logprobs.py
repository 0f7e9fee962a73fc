"""Log-probabilities of sampled and prompt tokens (vLLM's ``Logprob`` and its dict layout).

Each position yields ``{token_id: Logprob}``: the chosen token (sampled, or the actual prompt
token) first, with its rank in the vocabulary, then the ``k`` most likely tokens with ranks
``1..k``. Values are the model's raw ``log_softmax`` in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch import at run time: ``from forwardkit import Logprob`` stays light
    import torch

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs", "logprob_dicts"]


@dataclass
class Logprob:
    """One token's log-probability.

    Attributes:
        logprob: ``log_softmax`` of the raw logits at this position.
        rank: 1 for the most likely token; a token's rank counts the tokens at least as likely.
        decoded_token: the token's text (None when the model ships no tokenizer).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


def logprob_dicts(
    logprobs: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[dict[int, Logprob]]:
    """One ``{token: Logprob}`` per row of ``logprobs`` ``[N, V]`` (already log-softmaxed).

    Row ``i`` holds ``token_ids[i]`` (with its rank) and the ``num_top[i]`` most likely tokens
    (``-1`` = the whole vocabulary).
    """
    if logprobs.shape[0] == 0:
        return []
    vocab = logprobs.shape[-1]
    ks = [vocab if k == -1 else min(k, vocab) for k in num_top]
    chosen = logprobs.new_tensor(list(token_ids)).long()
    chosen_lp = logprobs.gather(-1, chosen.unsqueeze(-1))
    ranks = (logprobs >= chosen_lp).sum(dim=-1).tolist()
    chosen_values = chosen_lp.squeeze(-1).tolist()
    k_max = max(ks)
    top_values: list[list[float]] = [[] for _ in ks]
    top_ids: list[list[int]] = [[] for _ in ks]
    if k_max > 0:
        values, ids = logprobs.topk(k_max, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    out = []
    for i, k in enumerate(ks):
        row = {int(token_ids[i]): Logprob(chosen_values[i], int(ranks[i]))}
        for r in range(k):
            tid = top_ids[i][r]
            if tid not in row:
                row[tid] = Logprob(top_values[i][r], r + 1)
        out.append(row)
    return out
