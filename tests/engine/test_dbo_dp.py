"""Dual-batch overlap on 2 real DP ranks with expert parallelism (gloo, CPU).

Every rank builds two runners of the same tiny Mixtral checkpoint, one with DBO and one
without, and feeds both the same steps (prefill, decode, mixed, uneven micro-batches, a last
micro-batch that would be empty, token counts at the threshold): the logits must agree, the
ranks must agree on which steps were micro-batched, the second micro-batch must compute while
the first's collective is in flight, and a fault injected at every yield point must end that
step with the fault on every rank and leave the runners working.
"""

from __future__ import annotations

import os
import time

import pytest

THRESHOLDS = dict(dbo_decode_token_threshold=4, dbo_prefill_token_threshold=8)

# Per step: (tokens per request on rank 0, on rank 1, micro-batched?). A request is
# "p<n>" (new prompt of n tokens), "d" (decode one token of a running request), "c<n>" (next
# prompt chunk of n tokens of a running request). Requests are kept per rank in order.
STEPS = [
    # prefill, both ranks above the prefill threshold; uneven (21 vs 18 real tokens)
    (["p7", "p5", "p9"], ["p12", "p6"], True),
    # decode: 3 and 2 tokens, below the decode threshold of 4 -> not micro-batched
    (["d", "d", "d"], ["d", "d"], False),
    # mixed: decodes plus new prompts (a request straddles the micro-batch boundary)
    (["d", "d", "d", "p11"], ["d", "d", "p4", "p3", "p2"], True),
    # uniform decode 4 vs 4: exactly at the threshold -> micro-batched (2 + 2)
    (["d", "d", "d", "d"], ["d", "d", "d", "d"], True),
    # uniform decode 4 vs 5 at the threshold on both: uneven halves 3 + 2 (rank 0: 3 + 1)
    (["d", "d", "d", "d"], ["d", "d", "d", "d", "d"], True),
    # rank 1 one token below the threshold: no rank micro-batches
    (["d", "d", "d", "d"], ["d", "d", "d"], False),
    # both vote yes, but padded to 8 the 4 real tokens of rank 1 leave its last half empty
    (["d", "d", "d", "d", "p4"], ["d", "d", "d", "d"], False),
    # long mixed step with a chunked prompt continuing
    (["d", "d", "d", "d", "d", "p20"], ["d", "d", "d", "d", "d", "p9"], True),
]

FAULT_POINTS = 8
PEER_DELAY_S = 1.0  # how long rank 1 holds back its part of the recorded step's first all-gather
CAPTURE_SIZES = [1, 2, 4, 8]  # 2 layers x (dispatch + combine) per micro-batch, 2 micro-batches


def _config(path: str, dbo: bool, rank: int, graphs: bool = False):
    from forwardkit.config.builder import build_engine_config

    extra = dict(enable_dbo=True, **THRESHOLDS) if dbo else {}
    if graphs:
        extra.update(compilation_config={"mode": 0}, optimization_level=0)
    cfg = build_engine_config(path, data_parallel_size=2, data_parallel_rank=rank,
                              enable_expert_parallel=True,
                              enforce_eager=not graphs, max_num_seqs=16,
                              max_num_batched_tokens=64, max_model_len=128, num_gpu_blocks=128,
                              **extra)
    if graphs:
        from forwardkit.config.compilation import CUDAGraphMode
        from forwardkit.config.frozen import unfrozen

        cc = cfg.compilation_config
        with unfrozen(cfg):  # graphs on the CPU: resolution turned them off
            cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
            cc.cudagraph_capture_sizes = list(CAPTURE_SIZES)
            cc.max_cudagraph_capture_size = CAPTURE_SIZES[-1]
            cc.cudagraph_num_of_warmups = 1
            cc.compute_bs_to_padded_graph_size()
    return cfg


class _Requests:
    """One rank's running requests: token history and block table per request."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.reqs: list[dict] = []  # {"computed": int, "tokens": list[int], "blocks": list[int]}

    def batch(self, spec: list[str]):
        from forwardkit.runner.batch import StepBatch

        ids, toks, computed, tables, sample = [], [], [], [], []
        running = iter(list(self.reqs))
        for item in spec:
            if item.startswith("p"):
                n = int(item[1:])
                req = {"computed": 0, "blocks": [len(self.reqs) * 8 + b for b in range(8)],
                       "prompt": [(17 * len(self.reqs) + 5 * i + 3 * self.rank) % 250 + 1
                                  for i in range(n + 3)]}
                self.reqs.append(req)
                chunk = req["prompt"][:n]
                sample.append(False)  # the prompt continues in a later "c" step
            else:
                req = next(running)
                if item == "d":
                    chunk = [(req["computed"] * 7 + 11) % 250 + 1]
                    sample.append(True)
                else:
                    n = int(item[1:])
                    chunk = req["prompt"][req["computed"] : req["computed"] + n]
                    sample.append(True)
            ids.append(str(id(req)))
            toks.append(chunk)
            computed.append(req["computed"])
            tables.append(req["blocks"])
            req["computed"] += len(chunk)
        return StepBatch(ids, toks, computed, tables, sample)


def _rank_main(rank: int, nprocs: int, port: int, path: str) -> dict:
    import torch

    from forwardkit.distributed import destroy_dp_group, init_dp_group
    from forwardkit.distributed import parallel_state as ps
    from forwardkit.microbatching import overlap as ubatching
    from forwardkit.runner.model_runner import ModelRunner

    init_dp_group(world_size=nprocs, rank=rank, master_port=port, backend="gloo", timeout_s=60)
    try:
        plain, dbo = ModelRunner(_config(path, False, rank)), ModelRunner(_config(path, True, rank))
        reqs_plain, reqs_dbo = _Requests(rank), _Requests(rank)
        # a model's first forward (the compile trace) is never micro-batched, even when every
        # rank's step is above the threshold; the next one is
        first = []
        for _ in range(2):
            dbo.execute(_Requests(rank).batch(["p9", "p9"]))
            first.append(dbo.last_step.ubatch_slices is not None)
        plain.dummy_run(2)
        ubatched, max_diff = [], 0.0
        events: list[tuple] = []
        record = [False]

        # --- recording hooks for the overlap check (active on one step only) ---
        start_gather = ps.RankGroup.start_all_gather

        class Tagged:
            def __init__(self, pending):
                self.pending = pending
                events.append(("gather_start", ubatching.dbo_current_ubatch_id(), id(self),
                               time.time()))

            def wait(self):
                out = self.pending.wait()
                events.append(("gather_done", ubatching.dbo_current_ubatch_id(), id(self),
                               time.time()))
                return out

        def recording_start(self, tensor, **kw):
            if record[0] and rank == 1 and not any(e[0] == "gather_start" for e in events):
                # The test's barrier: rank 1 holds back its part of the step's first all-gather,
                # so on rank 0 that all-gather cannot complete before PEER_DELAY_S has passed.
                time.sleep(PEER_DELAY_S)
            pending = start_gather(self, tensor, **kw)
            return Tagged(pending) if record[0] else pending

        ps.RankGroup.start_all_gather = recording_start  # type: ignore[method-assign]
        backend = dbo.attn_backend
        attn_forward = backend.forward

        def recording_attn(layer, *args, **kw):
            if record[0]:
                events.append(("attention", ubatching.dbo_current_ubatch_id(), None, time.time()))
            return attn_forward(layer, *args, **kw)

        backend.forward = staticmethod(recording_attn)  # type: ignore[method-assign]

        def step(spec_pair, record_overlap=False):
            nonlocal max_diff
            spec = spec_pair[rank]
            a = plain.execute(reqs_plain.batch(spec))
            record[0] = record_overlap
            try:
                b = dbo.execute(reqs_dbo.batch(spec))
            finally:
                record[0] = False
            assert a.shape == b.shape
            if a.numel():
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
                assert torch.equal(a.argmax(-1), b.argmax(-1))
                max_diff = max(max_diff, float((a - b).abs().max()))
            return dbo.last_step.ubatch_slices is not None

        for i, (r0, r1, _) in enumerate(STEPS):
            ubatched.append(step((r0, r1), record_overlap=(i == 0)))

        # --- a fault at every yield point of a micro-batched step, on both ranks ---
        class Fault(Exception):
            pass

        faults = []
        for point in range(FAULT_POINTS):
            count = [0]

            def inject(ub, event, point=point, count=count):
                if event == "yield":
                    if count[0] == point:
                        count[0] += 1
                        raise Fault(f"yield point {point} (micro-batch {ub})")
                    count[0] += 1

            spec = ["d"] * 4
            batch = reqs_dbo.batch(spec)
            previous = ubatching.set_ubatch_event_hook(inject)
            try:
                dbo.execute(batch)
                faults.append(None)
            except Fault as exc:
                faults.append(str(exc))
            finally:
                ubatching.set_ubatch_event_hook(previous)
            reqs_plain.batch(spec)  # keep the two runners' histories aligned
            assert not [t for t in __import__("threading").enumerate()
                        if t.name.startswith("forwardkit-ubatch")]
        # afterwards both runners still agree on a micro-batched step (collectives in sync);
        # the faulted steps wrote the same KV entries as the plain ones would have or left
        # them for the next write, so compare a fresh set of requests
        fresh = (["p9", "p6"], ["p8", "p7"], True)
        reqs_plain.reqs.clear()
        reqs_dbo.reqs.clear()
        after = step(fresh[:2])
        return {"first": first, "ubatched": ubatched, "max_diff": max_diff, "events": events,
                "faults": faults, "after": after}
    finally:
        destroy_dp_group()


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_dbo_dp2_expert_parallel(make_checkpoint):
    from forwardkit.distributed.launch import spawn

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    path = make_checkpoint("mixtral")
    results = spawn(_rank_main, 2, args=(path,), timeout_s=300)
    expected = [s[2] for s in STEPS]
    for rank, res in enumerate(results):
        assert res["first"] == [False, True]
        # both ranks took the same path every step, the expected one
        assert res["ubatched"] == expected, (rank, res["ubatched"])
        # every injected fault surfaced on the caller, at each yield point
        assert all(f is not None and f.startswith(f"yield point {p} ")
                   for p, f in enumerate(res["faults"])), res["faults"]
        assert res["after"] is True
        # order: micro-batch 1 ran attention after micro-batch 0 started its first dispatch
        # all-gather and before that all-gather was finished
        ev = res["events"]
        first = next(e for e in ev if e[0] == "gather_start" and e[1] == 0)
        start = ev.index(first)
        done = next(i for i, e in enumerate(ev) if e[0] == "gather_done" and e[2] == first[2])
        assert any(e[:2] == ("attention", 1) for e in ev[start:done]), ev
    # concurrency: on rank 0, micro-batch 1 computed (attention) while micro-batch 0's first
    # all-gather was in flight: after rank 0 started it, before rank 1 had even joined it (rank 1
    # holds its part back PEER_DELAY_S), so that all-gather could not have finished. A start
    # that waited for the collective would return only after rank 1 joined.
    ev0, ev1 = results[0]["events"], results[1]["events"]
    started = next(e[3] for e in ev0 if e[0] == "gather_start" and e[1] == 0)
    peer_joined = next(e[3] for e in ev1 if e[0] == "gather_start")
    computing = [e[3] for e in ev0 if e[:2] == ("attention", 1) and e[3] > started]
    assert computing and computing[0] < peer_joined, (started, computing[:1], peer_joined)
    assert peer_joined - started > PEER_DELAY_S / 2  # the barrier held
    assert results[0]["faults"] == results[1]["faults"]


def _one_rank_faults(rank: int, nprocs: int, port: int, path: str) -> str:
    from forwardkit.distributed import (
        DPCollectiveError,
        destroy_dp_group,
        get_dp_group,
        init_dp_group,
    )
    from forwardkit.microbatching import overlap as ubatching
    from forwardkit.runner.model_runner import ModelRunner

    init_dp_group(world_size=nprocs, rank=rank, master_port=port, backend="gloo", timeout_s=60)
    try:
        runner = ModelRunner(_config(path, True, rank))
        runner.dummy_run(2)
        group = get_dp_group()
        group.barrier()
        group.timeout_s = 10  # short from here on: the test waits for it once
        reqs = _Requests(rank)
        runner.execute(reqs.batch(["p9", "p9"]))  # micro-batched, no fault
        assert runner.last_step.ubatch_slices is not None

        class Fault(Exception):
            pass

        def inject(ub, event):
            if rank == 0 and event == "yield" and ub == 1:
                raise Fault("only rank 0, micro-batch 1, first yield")

        ubatching.set_ubatch_event_hook(inject)
        try:
            runner.execute(reqs.batch(["p9", "p9"]))
        except Fault as exc:
            return f"fault: {exc}"
        except DPCollectiveError as exc:
            return f"collective error: {exc}"
        finally:
            ubatching.set_ubatch_event_hook(None)
        return "no error"
    finally:
        destroy_dp_group()


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_fault_on_one_rank_ends_the_step_on_every_rank(make_checkpoint):
    """Rank 0 fails in a micro-batch, rank 1 does not: rank 0 raises its fault, rank 1 a
    DPCollectiveError at the collective timeout; nobody hangs."""
    from forwardkit.distributed.launch import spawn

    path = make_checkpoint("mixtral")
    out = spawn(_one_rank_faults, 2, args=(path,), timeout_s=150)
    assert out[0] == "fault: only rank 0, micro-batch 1, first yield"
    assert out[1].startswith("collective error: DP ") and "within 10 s" in out[1], out[1]


# --- micro-batched FULL CUDA graphs (recording stand-in for the graph backend) ---
# (step, micro-batched?, padded size); every step of the graphed runner runs FULL but the first
GRAPH_STEPS = [
    (["p5"] * 8, True, 40),  # prefill above its threshold: eager micro-batches (mode NONE)
    (["d"] * 8, True, 8),  # decode 8: the micro-batched graph of 8 (4 + 4)
    (["d"] * 5, True, 8),  # decode 5 padded to 8: uneven (4 + 1 real)
    (["d"] * 4, True, 4),  # at the threshold: the micro-batched graph of 4 (2 + 2)
    (["d"] * 3, False, 4),  # 3 -> 4, below the threshold: the ordinary FULL graph of 4
    (["d"] * 2, False, 2),  # the ordinary FULL graph of 2
    (["d"] * 8, True, 8),  # the graph of 8 again
]


def _graphs_rank_main(rank: int, nprocs: int, port: int, path: str) -> dict:
    import sys

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "cudagraph"))
    from recording import RecordingGraphs

    from forwardkit.config.compilation import CUDAGraphMode
    from forwardkit.distributed import destroy_dp_group, init_dp_group
    from forwardkit.microbatching import overlap as ubatching
    from forwardkit.runner import model_runner

    model_runner.GraphBackend = RecordingGraphs  # type: ignore[misc]
    from forwardkit.platforms import Platform

    Platform.can_capture_graphs = lambda self: True  # type: ignore[method-assign]
    init_dp_group(world_size=nprocs, rank=rank, master_port=port, backend="gloo", timeout_s=60)
    try:
        plain = model_runner.ModelRunner(_config(path, False, rank))
        dbo = model_runner.ModelRunner(_config(path, True, rank, graphs=True))
        out: dict = {"mode": str(dbo.cudagraph_mode)}
        backend = dbo.graph_backend
        starts: list = []

        def on_event(ub, event):
            if event == "start":
                starts.append((ub, id(backend._capturing) if backend._capturing else None))

        plain.dummy_run(2)
        dbo.dummy_run(2)  # the model's first forward is never micro-batched
        previous = ubatching.set_ubatch_event_hook(on_event)
        try:
            dbo.capture_model()
        finally:
            ubatching.set_ubatch_event_hook(previous)
        graphs = dbo.ubatch_graphs
        out["sizes"] = graphs.sizes()
        out["stats"] = {k: dbo.capture_stats[k] for k in ("graphs", "keys")}
        out["starts"] = starts

        calls: list = []
        from forwardkit.runner import microbatched  # the runner's micro-batched forward

        real_run = microbatched.run_ubatches

        def counting_run(fns, contexts):
            calls.append(len(fns))
            return real_run(fns, contexts)

        microbatched.run_ubatches = counting_run  # type: ignore[assignment]
        ub_graphs = {n: graphs._entries[n].graph for n in graphs.sizes()}
        full = dbo.model.concrete_cudagraph_entries
        reqs_plain, reqs_dbo = _Requests(rank), _Requests(rank)
        steps, max_diff = [], 0.0

        def step(spec):
            nonlocal max_diff
            ub_before = {n: g.replays for n, g in ub_graphs.items()}
            full_before = {d.num_tokens: e.cudagraph.replays for d, e in full.items()}
            calls.clear()
            a = plain.execute(reqs_plain.batch(spec))
            b = dbo.execute(reqs_dbo.batch(spec))
            assert a.shape == b.shape and (a.numel() > 0) == (spec[0] == "d"), spec
            if a.numel():  # a first prompt chunk samples nothing
                assert not torch.isnan(b).any(), spec
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
                assert torch.equal(a.argmax(-1), b.argmax(-1))
                max_diff = max(max_diff, float((a - b).abs().max()))
            s = dbo.last_step
            return {"mode": str(s.mode), "ubatched": s.ubatch_slices is not None,
                    "padded": s.num_padded_tokens, "calls": list(calls),
                    "ub_replays": {n: g.replays - ub_before[n] for n, g in ub_graphs.items()},
                    "full_replays": {d.num_tokens: e.cudagraph.replays - full_before[d.num_tokens]
                                     for d, e in full.items()}}

        for spec, _, _ in GRAPH_STEPS:
            steps.append(step(spec))
        out["steps"] = steps
        out["planned"] = sorted(d.num_tokens for d in dbo.planner.microbatched_capture_descs())
        out["max_diff"] = max_diff
        out["full_mode"] = str(CUDAGraphMode.FULL)
        return out
    finally:
        destroy_dp_group()


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_dbo_microbatched_full_graphs_dp2(make_checkpoint):
    """Both micro-batches of a uniform decode step above the threshold are captured in one
    FULL graph per padded size; a replay runs them once (the stand-in re-running the capture)
    with no threads started by the runner; logits equal a plain eager runner's; a step the
    vote keeps off micro-batching replays the size's ordinary FULL graph."""
    from forwardkit.cudagraph.ubatch_graphs import MICROBATCHED_FULL
    from forwardkit.distributed.launch import spawn

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    path = make_checkpoint("mixtral")
    results = spawn(_graphs_rank_main, 2, args=(path,), timeout_s=300)
    for rank, res in enumerate(results):
        assert res["mode"] == "FULL_DECODE_ONLY"
        # sizes >= the decode threshold (4) whose last micro-batch holds a real token
        assert res["sizes"] == [4, 8], res["sizes"]
        assert res["stats"]["graphs"] == {"FULL": 4, MICROBATCHED_FULL: 2}, res["stats"]
        assert res["stats"]["keys"][MICROBATCHED_FULL] == 2
        # inside each micro-batched capture both micro-batches started: 2 captures x 2
        captured = [(ub, g) for ub, g in res["starts"] if g is not None]
        assert sorted(ub for ub, _ in captured) == [0, 0, 1, 1], res["starts"]
        assert len({g for _, g in captured}) == 2
        for (spec, ubatched, padded), got in zip(GRAPH_STEPS, res["steps"]):
            graph_step = spec[0] == "d"
            want_mode = res["full_mode"] if graph_step else "NONE"
            assert (got["mode"], got["ubatched"], got["padded"]) == (want_mode, ubatched, padded), (
                rank, spec, got)
            if graph_step and ubatched:
                # one replay of that size's micro-batched graph, the micro-batches run once
                # (by the stand-in's replay), the ordinary FULL graphs not at all
                assert got["ub_replays"] == {n: int(n == padded) for n in (4, 8)}, got
                assert got["calls"] == [2], got
                assert sum(got["full_replays"].values()) == 0, got
            elif graph_step:
                assert sum(got["ub_replays"].values()) == 0 and got["calls"] == [], got
                assert got["full_replays"][padded] == 1, got
            else:
                assert got["calls"] == [2] and sum(got["ub_replays"].values()) == 0, got
        assert res["planned"] == res["sizes"]  # the planner replays exactly what was captured
