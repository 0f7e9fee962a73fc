"""Draft-model speculation: a second, smaller model with the target's vocabulary proposes the
``k`` draft tokens that the target verifies (``speculative_config.method="draft_model"``).

The draft is a full :class:`~forwardkit.runner.model_runner.ModelRunner` of its own: its own
weights, KV cache (as many blocks as the target's, of the same size), compilation and graphs
(the target's compilation mode and optimisation level; its own capture sizes, since its steps
are one token per request). It keeps its own block table per request, so the target's prefix
cache, preemption and block sharing never touch it.

Each engine step, for the requests that decode (their prompt done, one pending token):

1. **catch-up**: the draft runs every token of the request it has no KV for yet (the whole
   prompt the first time, in chunks under the token budget; afterwards the one or two tokens
   the target emitted last step beyond the accepted drafts the draft already computed), and
   its logits at the last token give draft 1;
2. ``k - 1`` single-token steps, each feeding back the previous draft, give drafts 2..k.

A greedy request's drafts are the draft's argmax (``q`` is then a point mass); a request that
samples draws each draft from the draft's distribution ``q`` under its own sampling settings
(temperature, top-k/p, min-p, penalties), and :func:`~forwardkit.engine.speculative.verify`
accepts it with ``min(1, p/q)``. The draft's KV of the drafts it fed back stays valid as far
as the target accepted them (found at the next step by comparing the drafts with the tokens
the request really has), so rejected positions are simply recomputed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from forwardkit.config.builder import build_engine_config
from forwardkit.config.scheduler import SpeculativeConfig
from forwardkit.engine.request import Request
from forwardkit.engine.sampler import Sampler
from forwardkit.engine.weight_update import KVCacheSleeper
from forwardkit.runner.batch import StepBatch

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig
    from forwardkit.engine.tp import TPWorkerPool
    from forwardkit.runner.model_runner import ModelRunner

__all__ = ["DraftModelProposer", "build_draft_config"]


def build_draft_config(target: EngineConfig, num_blocks: int) -> EngineConfig:
    """The draft model's engine config: ``speculative_config.model`` at the target's dtype,
    context length, batch limits, KV block size (``num_blocks`` blocks), platform, compilation
    mode and optimisation level; ``draft_tensor_parallel_size`` TP ranks (None: 1; else 1 or
    the target's, checked with the config), no DP, no prefix caching, no speculation."""
    spec = target.speculative_config
    assert spec is not None and spec.model is not None
    model = target.model_config
    assert model is not None
    sched = target.scheduler_config
    mode = target.compilation_config.mode
    try:
        return build_engine_config(
            spec.model, dtype=model.dtype, max_model_len=model.get_max_model_len(),
            max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
            enforce_eager=model.enforce_eager,
            compilation_config=None if mode is None else {"mode": int(mode)},
            optimization_level=int(target.optimization_level), data_parallel_size=1,
            tensor_parallel_size=spec.draft_tensor_parallel_size or 1,
            block_size=target.cache_config.block_size, num_gpu_blocks=num_blocks,
            enable_prefix_caching=False, platform=target.platform,
        )
    except ValueError as exc:
        raise ValueError(f"speculative_config.model={spec.model!r:.200}: {exc}") from None


@dataclass
class _DraftState:
    """One request's standing in the draft's KV cache."""

    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # leading positions whose draft KV is valid
    preemptions: int = 0  # the request's count when this state was made
    proposed_at: int = 0  # the request's token count when ``drafts`` were proposed
    drafts: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [len(drafts), vocab] draft distributions (sampling)


class DraftModelProposer:
    """Proposes drafts with a second model (see the module docstring)."""

    def __init__(self, spec: SpeculativeConfig, target: EngineConfig, num_blocks: int,
                 max_model_len: int, tp_pool: TPWorkerPool | None = None) -> None:
        from forwardkit.engine.tp import build_runner

        self.k = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        self.disable_by_batch_size = spec.disable_by_batch_size
        tp = spec.draft_tensor_parallel_size or 1
        if tp > 1 and tp_pool is None:
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={tp} needs the TP "
                             "worker processes LLM(tensor_parallel_size=...) starts itself; under "
                             "torchrun the accepted value is 1 (the draft on the driver)")
        self.config = build_draft_config(target, num_blocks)
        # a draft split over the TP ranks: every worker builds its shard beside the driver's
        # (the warm-up steps' collectives line up), then runs each draft step with it
        self._tp_pool = tp_pool if tp > 1 else None
        if self._tp_pool is not None:
            self._tp_pool.start("draft_runner", self.config)
        self.runner: ModelRunner = build_runner(self.config)
        if self._tp_pool is not None:
            self._tp_pool.finish("draft_runner")
        self.block_size = self.runner.block_size
        self.budget = self.config.scheduler_config.max_num_batched_tokens
        self._free = list(range(self.runner.num_blocks - 1, -1, -1))
        self._states: dict[str, _DraftState] = {}
        self.sampler = Sampler()
        self._sleeper: KVCacheSleeper | None = None  # made by the first sleep
        self.draft_seconds = 0.0  # wall time spent proposing (the profile's "draft" part)
        self.num_steps = 0  # draft forward steps run

    # ------------------------------------------------------------------ bookkeeping
    def _release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))

    def _state(self, req: Request) -> _DraftState:
        state = self._states.get(req.request_id)
        if state is not None and state.preemptions != req.num_preemptions:
            self._release(req.request_id)  # recomputed from scratch by the target: also here
            state = None
        if state is None:
            state = _DraftState(preemptions=req.num_preemptions)
            self._states[req.request_id] = state
        elif state.drafts:  # the drafts it fed back are valid as far as they were accepted
            fed = state.drafts[:-1]
            got = req.token_slice(state.proposed_at, min(req.num_tokens,
                                                         state.proposed_at + len(fed)))
            ok = 0
            while ok < len(got) and got[ok] == fed[ok]:
                ok += 1
            state.computed = min(state.computed, state.proposed_at + ok)
            state.drafts, state.probs = [], None
        # the last token always runs: its logits give draft 1
        state.computed = min(state.computed, req.num_tokens - 1)
        return state

    def _grow(self, state: _DraftState, num_positions: int) -> bool:
        """Blocks for ``num_positions`` positions; False (nothing taken) when too few are free."""
        need = math.ceil(num_positions / self.block_size) - len(state.blocks)
        if need > len(self._free):
            return False
        for _ in range(max(0, need)):
            state.blocks.append(self._free.pop())
        return True

    def _room(self, req: Request) -> int:
        room = self.max_model_len - req.num_tokens
        if req.max_output_tokens is not None:
            room = min(room, req.max_output_tokens - len(req.output_token_ids) - 1)
        return min(self.k, room)

    def draft_probs(self, req: Request) -> torch.Tensor | None:
        """The draft distributions behind ``req``'s current drafts (None: point masses)."""
        state = self._states.get(req.request_id)
        return None if state is None else state.probs

    # ------------------------------------------------------------------ one engine step
    @torch.inference_mode()
    def propose_all(self, running: list[Request], decoding: list[Request]) -> None:
        """Set ``spec_token_ids`` of every request in ``decoding`` (a subset of ``running``);
        the draft KV of requests no longer running is released."""
        start = time.perf_counter()
        alive = {r.request_id for r in running}
        for rid in [rid for rid in self._states if rid not in alive]:
            self._release(rid)
        work: list[tuple[Request, _DraftState, int]] = []
        for req in decoding:
            req.spec_token_ids = []  # none unless proposed now (a request left unscheduled
            state = self._state(req)  # last step would keep drafts its state no longer has)
            k = self._room(req)
            # positions the draft writes: every token but the last drafted one
            if k > 0 and self._grow(state, req.num_tokens + k - 1):
                work.append((req, state, k))
        if work:
            self._run(work)
        self.draft_seconds += time.perf_counter() - start

    def _run(self, work: list[tuple[Request, _DraftState, int]]) -> None:
        # catch-up: every token the draft has not computed, the last one's logits give draft 1
        last_rows: dict[str, torch.Tensor] = {}
        while len(last_rows) < len(work):
            ids, tokens, computed, tables, sample, owners = [], [], [], [], [], []
            budget = self.budget
            for req, state, _ in work:
                if req.request_id in last_rows or budget <= 0:
                    continue
                n = min(req.num_tokens - state.computed, budget)
                ids.append(req.request_id)
                tokens.append(req.token_slice(state.computed, state.computed + n))
                computed.append(state.computed)
                tables.append(state.blocks)
                done = state.computed + n == req.num_tokens
                sample.append(done)
                if done:
                    owners.append(req.request_id)
                state.computed += n
                budget -= n
            logits = self._execute(StepBatch(ids, tokens, computed, tables, sample))
            for rid, row in zip(owners, logits):
                last_rows[rid] = row
        for req, state, _ in work:
            state.proposed_at = req.num_tokens
        rows = [last_rows[req.request_id] for req, _, _ in work]
        probs: list[list[torch.Tensor]] = [[] for _ in work]
        for step in range(max(k for _, _, k in work)):
            live = [i for i, (_, _, k) in enumerate(work) if k > step]
            for i in live:
                req, state, _ = work[i]
                token, q = self._pick(rows[i], req, state.drafts)
                state.drafts.append(token)
                if q is not None:
                    probs[i].append(q)
            feed = [i for i in live if work[i][2] > step + 1]  # one more draft to make
            if not feed:
                break
            batch = StepBatch(
                [work[i][0].request_id for i in feed],
                [[work[i][1].drafts[-1]] for i in feed],
                [work[i][1].computed for i in feed],
                [work[i][1].blocks for i in feed],
            )
            logits = self._execute(batch)
            for j, i in enumerate(feed):
                work[i][1].computed += 1
                rows[i] = logits[j]
        for i, (req, state, _) in enumerate(work):
            req.spec_token_ids = list(state.drafts)
            state.probs = torch.stack(probs[i]) if probs[i] else None

    def _execute(self, batch: StepBatch) -> torch.Tensor:
        self.num_steps += 1
        if self._tp_pool is not None:
            self._tp_pool.send_step(batch, None, kind="draft_step")
        return self.runner.execute(batch)

    def _pick(self, row: torch.Tensor, req: Request, history: list[int]
              ) -> tuple[int, torch.Tensor | None]:
        """The next draft from the draft's logits ``row``: the argmax for a greedy request,
        else a draw from ``q`` (returned) under the request's sampling settings, with the
        drafts so far counted as generated (penalties, ``min_tokens``)."""
        saved = req.output_token_ids
        req.output_token_ids = saved + history
        try:
            q, best = self.sampler.target_distribution(row.unsqueeze(0), req)
        finally:
            req.output_token_ids = saved
        if q is None:
            return best, None
        return self.sampler.draw(q, req), q

    # ------------------------------------------------------------------ sleep / wake-up
    def sleep(self, level: int = 1) -> int:
        """Release the draft's KV cache storage with the target's (``LLM.sleep``); every
        request's draft KV is forgotten (its content is gone). Returns the bytes freed."""
        if self._sleeper is None:
            self._sleeper = KVCacheSleeper(self.runner)
        freed = self._sleeper.sleep(level)
        self.shutdown()
        return freed

    def wake_up(self, tags: list[str] | None = None) -> int:
        """Re-allocate the draft's KV cache, zeroed (``LLM.wake_up``); the bytes allocated."""
        return 0 if self._sleeper is None else self._sleeper.wake_up(tags)

    def shutdown(self) -> None:
        """Drop every request's draft KV blocks."""
        for rid in list(self._states):
            self._release(rid)
