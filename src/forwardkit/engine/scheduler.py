"""``Scheduler``: continuous batching with chunked prefill under a per-step token budget.

Each step: running requests first (decode tokens or the next prefill chunk), in admission
order, then waiting requests while the token budget, ``max_num_seqs`` and free KV blocks allow.
When a running request cannot get a KV block, the most recently admitted running request is
preempted (its blocks freed, recomputed later), so a full cache never deadlocks: a request
alone always fits because ``add`` refuses requests larger than the whole cache.

With prefix caching a waiting request is admitted from the longest run of its leading full
blocks that the block manager has cached (its own, after a preemption; a sibling's or an
earlier request's otherwise) and runs only the tokens after them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forwardkit.engine.block_manager import BlockManager
from forwardkit.engine.request import Request, RequestStatus
from forwardkit.logger import init_logger
from forwardkit.runner.batch import StepBatch

if TYPE_CHECKING:
    from forwardkit.engine.logprobs import Logprob

__all__ = ["Scheduler", "SchedulerOutput"]

logger = init_logger(__name__)


@dataclass
class SchedulerOutput:
    """One step's plan: the scheduled requests and how many tokens each runs."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens scheduled over all requests."""
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        """Nothing to run this step."""
        return not self.requests

    def to_batch(self) -> StepBatch:
        """The runner's view of this plan."""
        token_ids, computed, tables, sample = [], [], [], []
        for req, n in zip(self.requests, self.num_scheduled_tokens):
            start = req.num_computed_tokens
            real = min(n, req.num_tokens - start)  # then the drafts, if any
            token_ids.append(req.token_slice(start, start + real) + req.spec_token_ids[:n - real])
            computed.append(start)
            tables.append(list(req.block_ids))
            sample.append(start + n >= req.num_tokens)
        return StepBatch(
            req_ids=[r.request_id for r in self.requests],
            token_ids=token_ids,
            num_computed_tokens=computed,
            block_tables=tables,
            sample=sample,
        )


class Scheduler:
    """Continuous-batching scheduler over one ``BlockManager``.

    Args:
        block_manager: the KV block allocator.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step.
        enable_chunked_prefill: split prompts over steps to fit the budget; when False a
            prompt is scheduled whole, so it must fit the budget.
        max_model_len: longest prompt + output a request may reach.
        allow_pending_hits: a request may start from cached blocks that a request scheduled
            earlier in the same step is computing (False when steps may be split into
            micro-batches, which do not see each other's writes).
        max_loras: most distinct LoRA adapters in one step (None: no LoRA); a request whose
            adapter would exceed it waits for a later step.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        max_model_len: int | None = None,
        allow_pending_hits: bool = True,
        max_loras: int | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} is invalid; expected an integer >= 1")
        if max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} is invalid; expected an integer >= 1"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_model_len = max_model_len
        self.allow_pending_hits = allow_pending_hits
        self.max_loras = max_loras
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # --- admission -------------------------------------------------------------------
    def check_fits(self, request: Request) -> None:
        """Raise ``ValueError`` naming the request if it could never be served."""
        rid, n = request.request_id, request.num_prompt_tokens
        if self.max_model_len is not None and n >= self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt has {n} tokens but max_model_len is "
                f"{self.max_model_len}; it needs at least one free position to generate into"
            )
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            raise ValueError(
                f"request {rid!r}: prompt has {n} tokens, more than max_num_batched_tokens="
                f"{self.max_num_batched_tokens}, and chunked prefill is disabled; enable it or "
                "raise max_num_batched_tokens"
            )
        capacity = self.block_manager.capacity_tokens
        if request.max_total_tokens > capacity:
            raise ValueError(
                f"request {rid!r}: prompt ({n} tokens) plus max output "
                f"({request.max_output_tokens}) needs {request.max_total_tokens} KV slots but the "
                f"whole cache holds {capacity} ({self.block_manager.num_blocks} blocks of "
                f"{self.block_manager.block_size}); lower max_tokens or enlarge the cache"
            )

    def add(self, request: Request) -> None:
        """Queue a request (after ``check_fits``)."""
        self.add_all([request])

    def add_all(self, requests: list[Request]) -> None:
        """Check every request with ``check_fits``, then queue them all (or none)."""
        for request in requests:
            self.check_fits(request)
        self.queue_all(requests)

    def queue_all(self, requests: list[Request]) -> None:
        """Queue requests already checked with ``check_fits``."""
        now = time.time()
        for request in requests:
            request.arrival_time = now
            request.status = RequestStatus.WAITING
            self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    # --- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next step (and allocate KV blocks for it)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        loras: set[int] = set()

        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            if not self._lora_fits(req, loras):
                index += 1  # its adapter waits for a step with a free slot
                continue
            n = min(req.num_pending_tokens + len(req.spec_token_ids), budget)
            if req.spec_token_ids:  # the budget may cut the drafts short
                del req.spec_token_ids[max(0, n - req.num_pending_tokens):]
            while not self.block_manager.can_allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                self.block_manager.allocate(req, n)
                out.requests.append(req)
                out.num_scheduled_tokens.append(n)
                scheduled.add(req.request_id)
                budget -= n
                index += 1
                continue
            break  # the current request itself was preempted

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                hits = self.block_manager.find_cached_prefix(req, self.allow_pending_hits)
                n = req.num_tokens - len(hits) * self.block_manager.block_size
                if n > budget:
                    # Without chunked prefill a prompt runs whole; only a preempted request
                    # whose prompt + output outgrew the budget is chunked (else it never runs).
                    if not self.enable_chunked_prefill and n <= self.max_num_batched_tokens:
                        break
                    n = budget
                if not self.block_manager.can_admit(req, hits, n) or not self._lora_fits(req, loras):
                    break  # wait for running requests to free blocks (or adapter slots)
                self.waiting.popleft()
                self.block_manager.admit(req, hits, n)
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.time()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.requests.append(req)
                out.num_scheduled_tokens.append(n)
                budget -= n
        return out

    def _lora_fits(self, req: Request, loras: set[int]) -> bool:
        """Whether ``req``'s adapter fits this step's ``max_loras``; adds it to ``loras``."""
        lid = req.lora_int_id
        if not lid or lid in loras:
            return True
        if self.max_loras is not None and len(loras) >= self.max_loras:
            return False
        loras.add(lid)
        return True

    def _preempt(self, request: Request) -> None:
        """Free ``request``'s blocks and put it back at the head of the queue (recompute)."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s (KV cache full)", request.request_id)

    def update(self, out: SchedulerOutput, sampled: Mapping[str, int | list[int]],
               logprobs: Mapping[str, dict[int, Logprob] | list[dict[int, Logprob]]] | None = None,
               ) -> list[Request]:
        """Advance scheduled requests after a step; ``sampled`` maps request id -> new token, or
        the tokens a request with drafts emits (its accepted drafts, then one more), and
        ``logprobs`` request id -> that token's logprob dict (a list of them for a list of
        tokens), for requests that asked. A request with drafts advances over its last token
        and the accepted drafts only; the rejected drafts' KV slots are written again later.

        Returns the requests that finished this step (their blocks are already freed).
        """
        finished = []
        for req, n in zip(out.requests, out.num_scheduled_tokens):
            if req.status != RequestStatus.RUNNING:
                continue
            got = sampled.get(req.request_id)
            tokens = [got] if isinstance(got, int) else (got or [])
            drafts = len(req.spec_token_ids)
            req.spec_token_ids = []
            # the drafts count as computed only as far as they were accepted
            req.num_computed_tokens += n - drafts + max(0, min(len(tokens) - 1, drafts))
            self.block_manager.mark_computed(req)
            if not tokens:
                continue  # partial prefill: nothing sampled yet
            lps = logprobs.get(req.request_id) if logprobs else None
            lp_list = lps if isinstance(lps, list) else [lps] * len(tokens)
            for token, lp in zip(tokens, lp_list):
                if req.append_token(token, lp):
                    req.status = RequestStatus.FINISHED
                    req.finished_time = time.time()
                    self.running.remove(req)
                    self.block_manager.free(req)
                    finished.append(req)
                    break
        return finished

    def abort(self, request_id: str) -> Request | None:
        """Stop one waiting or running request (finish reason ``"abort"``) and drop its hold on
        its blocks; returns it, or None when no unfinished request has that id."""
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                self.block_manager.free(req)
                break
        else:
            for req in self.waiting:
                if req.request_id == request_id:
                    self.waiting.remove(req)
                    break
            else:
                return None
        req.status = RequestStatus.FINISHED
        req.finish_reason = "abort"
        return req

    def abort_all(self) -> None:
        """Drop every request and return all blocks (used after an error in a step)."""
        for req in self.running:
            self.block_manager.free(req)
            req.status = RequestStatus.FINISHED
            req.finish_reason = req.finish_reason or "abort"
        for req in self.waiting:
            req.status = RequestStatus.FINISHED
            req.finish_reason = req.finish_reason or "abort"
        self.running.clear()
        self.waiting.clear()
