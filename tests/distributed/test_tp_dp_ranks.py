"""Four ranks as torchrun starts them (data_parallel_size 2 x tensor_parallel_size 2, every
process builds its own LLM): sequence-parallel MoE over the EP group of all four ranks, with
uneven token counts per replica so the per-rank sizes really vary; a killed rank gives the
others a clear error within the collective timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import time

import pytest

from forwardkit.distributed.launch import find_free_port, spawn
from forwardkit.engine import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
import tp_models  # noqa: E402

pytestmark = [pytest.mark.distributed]

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, dtype="float32",
              enforce_eager=True)
# per DP replica (both TP ranks of a replica get the same prompts): uneven work, so the
# replicas' token counts differ step by step; replica 1 runs dummy steps at the end
PROMPTS = [
    [[3, 17, 42, 5, 9, 200, 11], [7, 8], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]],
    [[90, 91, 92]],
]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return tp_models.build("mixtral", str(tmp_path_factory.mktemp("tp-dp-mixtral")))


def _summary(outs):
    return ([o.outputs[0].token_ids for o in outs],
            [[{t: round(lp.logprob, 4) for t, lp in d.items()} for d in o.outputs[0].logprobs]
             for o in outs])


def _sp_rank(rank: int, nprocs: int, port: int, path: str, backend: str, chunk: int) -> dict:
    os.environ["FORWARDKIT_MOE_DP_CHUNK_SIZE"] = str(chunk)
    from forwardkit.distributed import destroy_distributed, init_distributed
    from forwardkit.distributed.dp_utils import DPMetadata
    from forwardkit.layers.fused_moe import FusedMoE

    seen: list[tuple[str, list[int]]] = []
    real_get = DPMetadata.get_chunk_sizes_across_dp_rank
    real_sp, real_chunked = DPMetadata.sp_local_sizes, DPMetadata.chunked_sizes

    def record_get(self):
        sizes = real_get(self)
        seen.append(("sizes", list(sizes)))
        return sizes

    def record_sp(self, sp):
        seen.append(("sp_local_sizes", [sp]))
        return real_sp(self, sp)

    def record_chunked(self, sp, max_chunk, idx):
        seen.append(("chunked_sizes", [sp, max_chunk, idx]))
        return real_chunked(self, sp, max_chunk, idx)

    DPMetadata.get_chunk_sizes_across_dp_rank = record_get
    DPMetadata.sp_local_sizes = record_sp
    DPMetadata.chunked_sizes = record_chunked
    init_distributed(world_size=nprocs, rank=rank, master_port=port, tensor_parallel_size=2,
                     backend="gloo", timeout_s=120)
    try:
        llm = LLM(path, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True,
                  all2all_backend=backend, **ENGINE)
        moe = [m for m in llm.runner.model.modules() if isinstance(m, FusedMoE)]
        layout = [(m.is_sequence_parallel, m.ep_rank, m.ep_size, m.num_local_experts) for m in moe]
        outs = llm.generate(prompt_token_ids=PROMPTS[rank // 2], sampling_params=GREEDY,
                            use_tqdm=False)
        return {"out": _summary(outs), "seen": seen, "layout": layout,
                "bytes": llm.weight_bytes_per_rank()}
    finally:
        destroy_distributed()


# Parameters every TP rank holds whole (norm scales, the MoE router): everything else but the
# experts is split in two by TP; the experts are split by EP.
_REPLICATED = ("layernorm.weight", "model.norm.weight", "mlp.gate.weight")


def _expected_rank_bytes(single: LLM, ep_size: int, tp_size: int) -> int:
    """Bytes one rank of a DP x TP layout with expert parallelism should hold, from the
    one-process model's parameters (this vocabulary divides by the TP size: no padding rows)."""
    total = 0
    for name, param in single.runner.module.named_parameters():
        if ".experts." in name:
            assert param.nbytes % ep_size == 0, name
            total += param.nbytes // ep_size
        elif name.endswith(_REPLICATED):
            total += param.nbytes
        else:
            assert param.nbytes % tp_size == 0, name
            total += param.nbytes // tp_size
    return total


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend, chunk", [("allgather_reducescatter", 256), ("naive", 3)],
                         ids=["allgather-reducescatter", "naive-chunked"])
def test_dp2_tp2_sequence_parallel_moe_matches_one_process(mixtral, backend, chunk):
    single = LLM(mixtral, **ENGINE)
    expected = [_summary(single.generate(prompt_token_ids=p, sampling_params=GREEDY,
                                         use_tqdm=False)) for p in PROMPTS]
    per_rank = _expected_rank_bytes(single, ep_size=4, tp_size=2)
    assert 0 < per_rank < sum(t.nbytes for t in single.runner.module.parameters()) // 3
    results = spawn(_sp_rank, 4, args=(mixtral, backend, chunk), timeout_s=500)
    for rank, res in enumerate(results):
        tokens, lps = res["out"]
        assert tokens == expected[rank // 2][0], rank
        for got, want in zip(lps, expected[rank // 2][1]):
            for dg, dw in zip(got, want):
                assert dg.keys() == dw.keys()
                assert all(abs(dg[t] - dw[t]) < 5e-4 for t in dg)
        # 4 experts over the EP group of 4 ranks: EP rank = dp_rank * 2 + tp_rank, 1 expert each
        assert all(layout == (True, rank, 4, 1) for layout in res["layout"])
        # the MoE layers really asked DPMetadata for the per-EP-rank sizes of every exchange
        sizes = [s for kind, s in res["seen"] if kind == "sizes"]
        entered = {kind for kind, _ in res["seen"]}
        assert sizes and all(len(s) == 4 for s in sizes)
        assert all(s[0] == s[1] and s[2] == s[3] for s in sizes)  # one count per replica
        assert any(s[0] != s[2] for s in sizes)  # uneven replicas: the sizes vary
        assert ("chunked_sizes" in entered) == (chunk == 3)
        assert "sp_local_sizes" in entered or chunk == 3
        # each rank holds a quarter of the experts, half of the sharded rest and all of the
        # replicated parameters; both TP ranks of its replica report the same
        assert res["bytes"] == [per_rank, per_rank], (rank, res["bytes"], per_rank)


# ---------------------------------------------------------------------------- a killed rank
TIMEOUT_S = 8.0


def _dying_rank(rank: int, port: int, path: str, victim: int, results) -> None:
    os.environ["FORWARDKIT_DP_TIMEOUT_S"] = str(TIMEOUT_S)
    from forwardkit.distributed import init_distributed

    init_distributed(world_size=4, rank=rank, master_port=port, tensor_parallel_size=2,
                     backend="gloo")
    llm = LLM(path, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True,
              **ENGINE)
    steps = 0
    execute = llm.runner.execute

    def step(batch, pad_to=None):
        nonlocal steps
        steps += 1
        if rank == victim and steps == 3:
            results.put((rank, "killed", time.time()))
            results.close()
            results.join_thread()  # the message is out before the process dies
            os.kill(os.getpid(), signal.SIGKILL)
        return execute(batch, pad_to)

    llm.runner.execute = step
    try:
        llm.generate(prompt_token_ids=PROMPTS[rank // 2] * 3, sampling_params=GREEDY,
                     use_tqdm=False)
        results.put((rank, "finished", time.time()))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}", time.time()))


@pytest.mark.timeout(300)
def test_killing_one_of_four_ranks_gives_the_others_a_clear_error_in_time(mixtral):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    victim = 3
    procs = [ctx.Process(target=_dying_rank, args=(r, port, mixtral, victim, results), daemon=True)
             for r in range(4)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, float]] = {}
    try:
        while len(got) < 4:
            rank, what, when = results.get(timeout=240)
            got[rank] = (what, when)
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(4)) - set(got))} never reported: {got}")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert got[victim][0] == "killed"
    killed_at = got[victim][1]
    for rank in (0, 1, 2):
        what, when = got[rank]
        assert what != "finished", rank
        # within the collective timeout (plus 2 s), not a launcher's or pytest's timeout
        assert when - killed_at < TIMEOUT_S + 2, (rank, when - killed_at, what)
        # the error names the collective and the dead rank
        assert "DPCollectiveError" in what and "rank 3 (pid" in what and "has exited" in what, \
            (rank, what)


# ---------------------------------------------------------------------------- DBO with SP MoE
DBO_PROMPTS = [  # per DP replica: similar token counts, so steps are micro-batched
    [[3, 17, 42, 5, 9, 200, 11], [7, 8, 9, 10, 11]],
    [[90, 91, 92, 93, 94, 95, 96, 97, 98, 99], [5, 6, 7]],
]


def _sp_dbo_rank(rank: int, nprocs: int, port: int, path: str) -> dict:
    from forwardkit.distributed import destroy_distributed, init_distributed

    init_distributed(world_size=nprocs, rank=rank, master_port=port, tensor_parallel_size=2,
                     backend="gloo", timeout_s=120)
    try:
        llm = LLM(path, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True,
                  enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4,
                  **ENGINE)
        from forwardkit.layers.fused_moe import FusedMoE
        from forwardkit.microbatching import overlap as ubatching

        ubatched = [0]
        step = llm.runner.execute
        events: list[tuple[int, str]] = []  # (micro-batch, event) of the first micro-batched step
        interleaved: list[bool] = []  # per micro-batched step: did micro-batch 1 start early?

        def execute(batch, pad_to=None):
            events.clear()
            logits = step(batch, pad_to)
            if llm.runner.last_step.ubatch_slices is not None:
                ubatched[0] += 1
                # micro-batch 1 started while micro-batch 0 was parked at one of the MoE
                # exchange's yields (not after micro-batch 0 ended)
                interleaved.append(events.index((1, "start")) < events.index((0, "end")))
                yields.append(sum(e == "yield" for _, e in events))
            return logits

        yields: list[int] = []
        ubatching.set_ubatch_event_hook(lambda ub, event: events.append((ub, event)))
        llm.runner.execute = execute
        try:
            outs = llm.generate(prompt_token_ids=DBO_PROMPTS[rank // 2], sampling_params=GREEDY,
                                use_tqdm=False)
        finally:
            ubatching.set_ubatch_event_hook(None)
        sp = [m.is_sequence_parallel for m in llm.runner.model.modules() if isinstance(m, FusedMoE)]
        return {"out": _summary(outs), "ubatched": ubatched[0], "interleaved": interleaved,
                "yields": yields, "sp": sp}
    finally:
        destroy_distributed()


@pytest.mark.timeout(600)
def test_dp2_tp2_sequence_parallel_moe_with_dbo_matches_one_process(mixtral):
    """Dual-batch overlap on the sequence-parallel exchange (all-gather-v / reduce-scatter-v
    started asynchronously, yields in between): same tokens and logprobs as one process."""
    single = LLM(mixtral, **ENGINE)
    expected = [_summary(single.generate(prompt_token_ids=p, sampling_params=GREEDY,
                                         use_tqdm=False)) for p in DBO_PROMPTS]
    results = spawn(_sp_dbo_rank, 4, args=(mixtral,), timeout_s=500)
    for rank, res in enumerate(results):
        tokens, lps = res["out"]
        assert tokens == expected[rank // 2][0], rank
        for got, want in zip(lps, expected[rank // 2][1]):
            for dg, dw in zip(got, want):
                assert dg.keys() == dw.keys()
                assert all(abs(dg[t] - dw[t]) < 5e-4 for t in dg)
        assert res["ubatched"] > 0
        assert res["sp"] and all(res["sp"])  # the sequence-parallel exchange served the MoE
        # the MoE exchange yielded while its collectives were in flight (two exchanges per
        # layer and micro-batch at least), so the micro-batches took turns instead of running
        # one after the other
        assert all(res["interleaved"]) and len(res["interleaved"]) == res["ubatched"], res
        assert all(n >= 2 * 2 * 2 for n in res["yields"]), res["yields"]
    assert len({res["ubatched"] for res in results}) == 1  # every rank took the same path
