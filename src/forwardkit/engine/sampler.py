"""``Sampler``: next tokens from last-token logits, per request (greedy, temperature, top-k/p,
min-p, penalties), with the sampled tokens' logprobs when a request asks for them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forwardkit.engine.logprobs import Logprob, logprob_dicts
from forwardkit.engine.penalties import apply_penalties
from forwardkit.engine.request import Request

__all__ = ["Sampler", "apply_top_k_top_p", "apply_min_p", "greedy_tokens"]

_CHUNK = 2048


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """``logits.argmax(dim=-1).tolist()`` for ``[rows, vocab]`` logits, the same indices
    (first maximal value, NaN counted as maximal) at a fraction of the cost for large
    vocabularies: PyTorch's CPU argmax compares element by element with index bookkeeping
    (14 ms for 16 x 128k float32 logits on one core), while a max is vectorised (under 1 ms).
    So: the max of every 2048-wide chunk, the first chunk holding the row's max, and the argmax
    inside that chunk (or the tail past the last whole chunk)."""
    rows, vocab = logits.shape
    if vocab < 2 * _CHUNK or logits.device.type != "cpu" or logits.stride(-1) != 1:
        return logits.argmax(dim=-1).tolist()
    n = vocab // _CHUNK
    full = n * _CHUNK
    chunks = logits[:, :full].view(rows, n, _CHUNK)
    chunk_max = chunks.amax(dim=-1)
    if full < vocab:
        chunk_max = torch.cat([chunk_max, logits[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    best = chunk_max.argmax(dim=-1)  # the first chunk holding the row's max (NaN: the first NaN)
    picked = chunks[torch.arange(rows), best.clamp(max=n - 1)]
    tokens = best * _CHUNK + picked.argmax(dim=-1)
    if full < vocab:
        tokens = torch.where(best == n, full + logits[:, full:].argmax(dim=-1), tokens)
    return tokens.tolist()


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (set to -inf) logits outside each row's top-k and top-p sets, in place.

    ``top_k[i] <= 0`` or ``>= vocab`` and ``top_p[i] >= 1`` switch the filter off for row i.
    Ties at the k-th value are kept; top-p always keeps the most likely token.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = top_k.to(torch.long).clone()
        k[(k <= 0) | (k > vocab)] = vocab
        # Ascending order: the k-th largest sits at index vocab - k.
        kth = sorted_logits.gather(-1, (vocab - k).unsqueeze(-1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p.to(probs.dtype)).unsqueeze(-1)
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(-1, order, sorted_logits)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p[i]`` times row i's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype).unsqueeze(-1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def _exponential_sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one index from ``probs`` (1-D) with the Gumbel/exponential trick."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


class Sampler:
    """Turns one logits row per request into a token id.

    Requests asking for ``logprobs`` get the raw log-softmax of their row (before any of the
    steps below). Until a request has ``min_tokens`` outputs its EOS and stop tokens are
    masked; then penalties (only for requests that set one). Greedy requests take the argmax.
    Others: logits / temperature, then top-k, top-p and min-p masks, softmax, and one draw from
    the request's own ``torch.Generator`` (so a request's tokens do not depend on which other
    requests share its batches).
    """

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """Sample one token per row of ``logits`` (float, ``[len(requests), vocab]``)."""
        return self.sample(logits, requests)[0]

    def sample(
        self, logits: torch.Tensor, requests: Sequence[Request]
    ) -> tuple[list[int], list[dict[int, Logprob] | None] | None]:
        """Tokens, and per row the logprob dict (None for rows that did not ask; the whole list
        is None when no row asked)."""
        if logits.shape[0] != len(requests):
            raise ValueError(
                f"sampler got {logits.shape[0]} logits rows for {len(requests)} requests"
            )
        if not requests:
            return [], None
        params = [r.sampling_params for r in requests]
        if self._plain_greedy(requests, params):
            # Every row is an argmax of the logits as they are: no copy, no float32 cast (exact
            # and order-preserving, so the same index), no masks, a chunked argmax (see
            # greedy_tokens). At a 128k vocabulary the copy alone is 0.5 MB a row.
            return greedy_tokens(logits), None
        logits = logits.float().clone()
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = logits[want].log_softmax(dim=-1) if want else None
        self._mask_min_tokens(logits, requests)
        if any(p.has_penalties for p in params):
            apply_penalties(logits, requests)
        tokens = self._draw(logits, requests, params)
        if raw is None:
            return tokens, None
        dicts = logprob_dicts(raw, [tokens[i] for i in want], [params[i].logprobs or 0 for i in want])
        per_row: list[dict[int, Logprob] | None] = [None] * len(requests)
        for i, d in zip(want, dicts):
            per_row[i] = d
        return tokens, per_row

    def target_distribution(self, logits: torch.Tensor, request: Request
                            ) -> tuple[torch.Tensor | None, int]:
        """What sampling one ``[1, vocab]`` row for ``request`` would draw from: ``(probs,
        argmax)`` after the ``min_tokens`` masks, penalties, temperature and top-k/p / min-p
        masks; probs is None for a greedy request (its token is the argmax)."""
        params = request.sampling_params
        logits = logits.float().clone()
        self._mask_min_tokens(logits, [request])
        if params.has_penalties:
            apply_penalties(logits, [request])
        if params.greedy:
            return None, greedy_tokens(logits)[0]
        logits.div_(params.temperature)
        apply_top_k_top_p(
            logits,
            torch.tensor([params.top_k], device=logits.device) if params.top_k > 0 else None,
            torch.tensor([params.top_p], device=logits.device) if params.top_p < 1.0 else None,
        )
        if params.min_p > 0:
            apply_min_p(logits, torch.tensor([params.min_p], device=logits.device))
        probs = logits.softmax(dim=-1)[0]
        return probs, int(probs.argmax())

    @staticmethod
    def draw(probs: torch.Tensor, request: Request) -> int:
        """One token from ``probs`` (1-D) with ``request``'s generator, as ``sample`` draws."""
        return _exponential_sample(probs, request.generator)

    @staticmethod
    def _plain_greedy(requests: Sequence[Request], params: list) -> bool:
        """All rows greedy, none asking for logprobs or penalties, none still masking EOS or
        stop tokens for ``min_tokens``: the tokens are the logits' row argmaxes."""
        for req, p in zip(requests, params):
            if (not p.greedy or p.logprobs is not None or p.has_penalties
                    or len(req.output_token_ids) < p.min_tokens):
                return False
        return True

    @staticmethod
    def _draw(logits: torch.Tensor, requests: Sequence[Request], params: list) -> list[int]:
        tokens = greedy_tokens(logits)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        device = logits.device
        sub = logits[rows]
        temps = torch.tensor([params[i].temperature for i in rows], device=device)
        sub.div_(temps.unsqueeze(-1))
        top_k = [params[i].top_k for i in rows]
        top_p = [params[i].top_p for i in rows]
        min_p = [params[i].min_p for i in rows]
        apply_top_k_top_p(
            sub,
            torch.tensor(top_k, device=device) if any(k > 0 for k in top_k) else None,
            torch.tensor(top_p, device=device) if any(p < 1.0 for p in top_p) else None,
        )
        if any(m > 0 for m in min_p):
            apply_min_p(sub, torch.tensor(min_p, device=device))
        probs = sub.softmax(dim=-1)
        for j, i in enumerate(rows):
            tokens[i] = _exponential_sample(probs[j], requests[i].generator)
        return tokens

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
        for i, req in enumerate(requests):
            params = req.sampling_params
            if len(req.output_token_ids) >= params.min_tokens:
                continue
            banned = set(params.all_stop_token_ids)
            if not params.ignore_eos:
                banned |= req.eos_token_ids
            in_vocab = [t for t in banned if t < logits.shape[-1]]
            if in_vocab:
                logits[i, in_vocab] = float("-inf")
