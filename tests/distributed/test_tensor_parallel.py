"""Tensor parallelism on CPU (gloo): TP layers shard and reassemble, uneven collectives, and
whole engines at tp=2 that give the tokens and logits of tp=1 while each rank really holds and
reads only its part of the weights."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from forwardkit.distributed.launch import spawn
from forwardkit.engine import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
import tp_models  # noqa: E402

pytestmark = [pytest.mark.distributed]

PROMPTS = [[3, 17, 42, 5, 9, 200], [7, 8], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, dtype="float32")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = tp_models.build(name, str(tmp_path_factory.mktemp(f"tp-{name}")))
        return made[name]

    return get


def _run(llm: LLM, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs or []]
                for o in outs]
    return tokens, logprobs


def _assert_same(a, b, atol=2e-4):
    tokens_a, lps_a = a
    tokens_b, lps_b = b
    assert tokens_a == tokens_b
    for seq_a, seq_b in zip(lps_a, lps_b):
        for da, db in zip(seq_a, seq_b):
            assert set(da) == set(db)  # the same top-5 tokens
            for t in da:
                assert abs(da[t] - db[t]) < atol, (t, da[t], db[t])


# ---------------------------------------------------------------------------- layers, no groups
def test_qkv_row_and_vocab_shards_reassemble_the_full_weights():
    from forwardkit.layers.parallel import (
        ParallelLMHead,
        QKVParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    torch.manual_seed(0)
    head_dim, hidden = 8, 32
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (4, 1, 1))
    row_w = torch.randn(hidden, 4 * head_dim)
    vocab = torch.randn(11, hidden)
    ranks = []
    for rank in range(2):
        qkv = QKVParallelLinear(hidden, head_dim, 4, 1, tp_rank=rank, tp_size=2)
        for sid, t in (("q", q), ("k", k), ("v", v)):
            qkv.weight_loader(qkv.weight, t, sid)
        row = RowParallelLinear(4 * head_dim, hidden, bias=True, tp_rank=rank, tp_size=2)
        row.weight_loader(row.weight, row_w)
        emb = VocabParallelEmbedding(11, hidden, tp_rank=rank, tp_size=2)
        emb.weight.weight_loader(emb.weight, vocab)
        head = ParallelLMHead(11, hidden, tp_rank=rank, tp_size=2)
        head.weight.weight_loader(head.weight, vocab)
        assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1)
        ranks.append((qkv.weight.clone(), row.weight.clone(), emb.weight.clone(), head.weight.clone()))
    # each rank: its 2 query heads and the one KV head, replicated
    for rank, (w, _, _, _) in enumerate(ranks):
        assert torch.equal(w[: 2 * head_dim], q[rank * 2 * head_dim:(rank + 1) * 2 * head_dim])
        assert torch.equal(w[2 * head_dim: 3 * head_dim], k)
        assert torch.equal(w[3 * head_dim:], v)
    assert torch.equal(torch.cat([r[1] for r in ranks], dim=1), row_w)
    # 11 rows over 2 ranks: 6 each, the last row of rank 1 is zero padding
    emb_full = torch.cat([r[2] for r in ranks])
    assert emb_full.shape[0] == 12 and torch.equal(emb_full[:11], vocab)
    assert torch.count_nonzero(emb_full[11]) == 0
    assert torch.equal(torch.cat([r[3] for r in ranks])[:11], vocab)


@pytest.mark.parametrize("tp, heads, kv_heads", [(4, 8, 2), (8, 8, 2), (4, 4, 1), (4, 8, 4)])
def test_each_rank_holds_the_kv_head_its_query_heads_attend_to(tp, heads, kv_heads):
    """GQA: query head ``h`` attends to KV head ``h // (heads / kv_heads)``. Rank ``r`` holds
    query heads ``r * heads/tp ...``; with fewer KV heads than ranks its KV head must be the one
    those query heads use (tp=4, 2 KV heads: ranks 0, 1 -> head 0; ranks 2, 3 -> head 1)."""
    from forwardkit.layers.parallel import QKVParallelLinear

    head_dim, hidden = 4, 8
    # every row of head n is filled with n: the loaded rows name the head they came from
    q = torch.arange(heads).repeat_interleave(head_dim)[:, None].expand(-1, hidden).float()
    k = torch.arange(kv_heads).repeat_interleave(head_dim)[:, None].expand(-1, hidden).float()
    v = k + 100
    group = heads // kv_heads
    for rank in range(tp):
        qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp_rank=rank, tp_size=tp)
        for sid, t in (("q", q), ("k", k), ("v", v)):
            qkv.weight_loader(qkv.weight, t, sid)
        nq, nkv = qkv.num_heads, qkv.num_kv_heads
        w = qkv.weight[:, 0].reshape(nq + 2 * nkv, head_dim)[:, 0].long().tolist()
        local_q, local_k, local_v = w[:nq], w[nq:nq + nkv], w[nq + nkv:]
        assert local_q == list(range(rank * nq, (rank + 1) * nq))
        wanted = sorted({h // group for h in local_q})  # the KV heads these queries read
        assert local_k == wanted, (rank, local_q, local_k)
        assert local_v == [h + 100 for h in wanted]


def test_shard_loader_rejects_a_wrong_full_shape():
    from forwardkit.layers.linear import WeightShapeError
    from forwardkit.layers.parallel import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(16, [(0, 32), (1, 32)], tp_rank=1, tp_size=2)
    with pytest.raises(WeightShapeError, match=r"expected shape \(32, 16\), got \(30, 16\)"):
        layer.weight_loader(layer.weight, torch.zeros(30, 16), 0)
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=2"):
        MergedColumnParallelLinear(16, [(0, 33)], tp_rank=0, tp_size=2, what="intermediate_size")


# ---------------------------------------------------------------------------- collectives
def _collectives(rank: int, nprocs: int, port: int) -> dict:
    from forwardkit.distributed import destroy_distributed, get_tp_group, init_distributed

    init_distributed(world_size=nprocs, rank=rank, master_port=port, tensor_parallel_size=nprocs,
                     backend="gloo", timeout_s=60)
    try:
        group = get_tp_group()
        sizes = [3, 1, 2]
        mine = torch.full((sizes[rank], 2), float(rank + 1))
        gathered = group.all_gather_v(mine, sizes)
        full = torch.arange(12, dtype=torch.float32).reshape(6, 2) * (rank + 1)
        scattered = group.reduce_scatter_v(full, sizes)
        x = torch.full((2, 4), float(rank))
        reduced = torch.ops.forwardkit.all_reduce(x, "tp")
        cat = torch.ops.forwardkit.all_gather(x, -1, nprocs, "tp")
        rs = torch.ops.forwardkit.reduce_scatter(torch.ones(6, 2) * (rank + 1), 0, nprocs, "tp")
        obj = group.broadcast_object({"hello": rank} if rank == 0 else None)
        return {"gathered": gathered.tolist(), "scattered": scattered.tolist(),
                "reduced": reduced.tolist(), "x_after": x.tolist(), "cat": cat.tolist(),
                "rs": rs.tolist(), "obj": obj}
    finally:
        destroy_distributed()


@pytest.mark.timeout(120)
def test_uneven_all_gather_and_reduce_scatter_on_gloo():
    out = spawn(_collectives, 3, timeout_s=100)
    expected_gather = [[1.0, 1.0]] * 3 + [[2.0, 2.0]] + [[3.0, 3.0]] * 2
    full_sum = (torch.arange(12, dtype=torch.float32).reshape(6, 2) * 6)
    bounds = [(0, 3), (3, 4), (4, 6)]
    for rank, res in enumerate(out):
        assert res["gathered"] == expected_gather
        lo, hi = bounds[rank]
        assert res["scattered"] == full_sum[lo:hi].tolist()
        assert res["reduced"] == [[3.0] * 4] * 2 and res["x_after"] == [[float(rank)] * 4] * 2
        assert res["cat"] == [[0.0] * 4 + [1.0] * 4 + [2.0] * 4] * 2
        assert res["rs"] == [[6.0, 6.0]] * 2
        assert res["obj"] == {"hello": 0}


# ---------------------------------------------------------------------------- whole engines
@pytest.mark.timeout(600)
def test_llama_tp2_matches_tp1_and_splits_the_weights(checkpoint, monkeypatch):
    from forwardkit.models.loader import SafetensorsSlice

    path = checkpoint("llama")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5,
                            prompt_logprobs=3)
    single = LLM(path, enforce_eager=True, **ENGINE)
    read: dict[str, int] = {}  # bytes this process (TP rank 0) reads from the checkpoint
    real_narrow, real_whole = SafetensorsSlice.narrow, SafetensorsSlice.materialize

    def narrow(self, dim, start, length):
        out = real_narrow(self, dim, start, length)
        read[self._name] = read.get(self._name, 0) + out.numel() * out.element_size()
        return out

    def whole(self):
        out = real_whole(self)
        read[self._name] = read.get(self._name, 0) + out.numel() * out.element_size()
        return out

    monkeypatch.setattr(SafetensorsSlice, "narrow", narrow)
    monkeypatch.setattr(SafetensorsSlice, "materialize", whole)
    tp2 = LLM(path, enforce_eager=True, tensor_parallel_size=2, **ENGINE)
    monkeypatch.undo()
    try:
        # rank 0 read half of every split tensor and all of the small replicated ones
        tensors = _hf_tensors(path)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        assert set(read) == set(tensors)
        for name, n in read.items():
            full = tensors[name].numel() * tensors[name].element_size()
            split = name.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight")) or \
                name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "gate_proj.bias",
                               "up_proj.bias"))
            # the single KV head is replicated: both ranks read all of k_proj / v_proj
            if split and ".k_proj." not in name and ".v_proj." not in name:
                assert n <= full // 2 + full // 251, (name, n, full)
            else:
                assert n == full, (name, n, full)
        assert sum(read.values()) < 0.6 * total
        expected = _run(single, params=params)
        got = _run(tp2, params=params)
        _assert_same(got, expected)
        # two all-reduces per dense decoder layer (o_proj, down_proj) and one for the
        # embedding; one all-gather for the logits: per step, as vLLM
        from forwardkit.distributed.parallel_state import RankGroup

        calls = {"all_reduce": 0, "all_gather": 0}
        real = {name: getattr(RankGroup, name) for name in calls}

        def counting(name):
            def call(self, *args, **kwargs):
                calls[name] += 1
                return real[name](self, *args, **kwargs)
            return call

        for name in calls:
            monkeypatch.setattr(RankGroup, name, counting(name))
        _run(tp2, prompts=[[5, 6, 7]], params=SamplingParams(temperature=0.0, max_tokens=3,
                                                             ignore_eos=True))
        monkeypatch.undo()
        assert calls == {"all_reduce": 3 * (1 + 2 * 2), "all_gather": 3}, calls
        # prompt logprobs go through the gathered LM head too
        p1 = single.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params, use_tqdm=False)
        p2 = tp2.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params, use_tqdm=False)
        for d1, d2 in zip(p1[0].prompt_logprobs[1:], p2[0].prompt_logprobs[1:]):
            assert {t: round(v.logprob, 3) for t, v in d1.items()} == \
                   {t: round(v.logprob, 3) for t, v in d2.items()}
        # each rank holds about half of the weights (norms and the o/down biases are whole)
        full = single.weight_bytes_per_rank()
        halves = tp2.weight_bytes_per_rank()
        assert len(full) == 1 and len(halves) == 2
        for b in halves:
            assert 0.45 * full[0] < b < 0.55 * full[0], (b, full)
        # live weight updates take full tensors and shard them on every rank
        torch.manual_seed(7)
        new = {name: torch.randn_like(t) * 0.2 for name, t in _hf_tensors(path).items()
               if name.endswith(("o_proj.weight", "down_proj.weight", "q_proj.weight",
                                 "embed_tokens.weight", "lm_head.weight"))}
        single.update_weights(new)
        tp2.update_weights(new)
        after1, after2 = _run(single), _run(tp2)
        assert after1[0] != expected[0]  # the update changed the model
        _assert_same(after2, after1)
        # sleep / wake-up reach the workers' KV caches too
        assert tp2.sleep() > 0 and tp2.wake_up() > 0
        _assert_same(_run(tp2), after1)
    finally:
        tp2.shutdown()


def _hf_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode, sp", [(2, False), (3, False), (3, True)],
                         ids=["mode2", "mode3", "mode3-sequence-parallel"])
def test_llama_tp2_compiled_matches_tp1(checkpoint, mode, sp):
    """Mode 2 (one Dynamo trace, whole graph to Inductor) and mode 3 (piecewise, also with the
    sequence-parallelism pass): the collective ops are graph nodes the compilers keep."""
    from forwardkit.compilation.counters import compilation_counter

    path = checkpoint("llama_tied")
    cc = {"mode": mode, "compile_sizes": [4]}
    if sp:
        cc["pass_config"] = {"enable_sp": True}
    single = LLM(path, enforce_eager=True, **ENGINE)
    before = compilation_counter.num_sp_reduce_scatters
    tp2 = LLM(path, compilation_config=cc, tensor_parallel_size=2, **ENGINE)
    try:
        # embedding + o_proj and down_proj of 2 layers: 5 all-reduces feed RMSNorms
        assert compilation_counter.num_sp_reduce_scatters - before == (5 if sp else 0)
        if sp:  # the runner pads every step to a multiple of TP
            tp2.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False)
            assert tp2.runner.last_step.num_padded_tokens % 2 == 0
        _assert_same(_run(tp2), _run(single), atol=1e-3)
    finally:
        tp2.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-experts", "ep"])
def test_mixtral_tp2_matches_tp1(checkpoint, expert_parallel):
    path = checkpoint("mixtral")
    single = LLM(path, enforce_eager=True, **ENGINE)
    tp2 = LLM(path, enforce_eager=True, tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel, **ENGINE)
    try:
        _assert_same(_run(tp2), _run(single))
        full, halves = single.weight_bytes_per_rank()[0], tp2.weight_bytes_per_rank()
        assert all(b < 0.56 * full for b in halves), (halves, full)
    finally:
        tp2.shutdown()


def test_tp_settings_that_cannot_split_the_model_fail_at_config_time(checkpoint):
    from forwardkit.config.builder import build_engine_config

    path = checkpoint("llama")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        build_engine_config(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_key_value_heads=3.*one must divide the other"):
        _kv_mismatch(build_engine_config)
    with pytest.raises(ValueError, match="at least one expert per rank"):
        build_engine_config(checkpoint("mixtral"), tensor_parallel_size=2, data_parallel_size=4,
                            enable_expert_parallel=True)


def _kv_mismatch(build):
    from forwardkit.config.model_shapes import model_shape_config

    # 12 query heads over 3 KV heads cannot be split over 2 ranks' KV heads
    shape = {**model_shape_config("default"), "num_attention_heads": 12, "num_key_value_heads": 3,
             "hidden_size": 384}
    return build(None, default_hf_config=shape, tensor_parallel_size=2)


def test_world_size_must_be_dp_times_tp():
    from forwardkit.config.parallel import ParallelConfig
    from forwardkit.distributed import init_distributed

    with pytest.raises(ValueError, match=r"data_parallel_size x tensor_parallel_size = 2 x 2 = 4, "
                                         r"but the world has 6 ranks"):
        init_distributed(ParallelConfig(data_parallel_size=2, tensor_parallel_size=2),
                         world_size=6, rank=0, master_port=1, backend="gloo")
    with pytest.raises(ValueError, match="pass this process's global rank"):
        init_distributed(ParallelConfig(tensor_parallel_size=2), world_size=2, master_port=1,
                         backend="gloo")


def test_sequence_parallel_compile_sizes_must_be_multiples_of_tp():
    from forwardkit.config.builder import build_engine_config

    with pytest.raises(ValueError, match=r"compile_sizes \[3\] are not multiples of "
                                         r"tensor_parallel_size=2"):
        build_engine_config(None, tensor_parallel_size=2, compilation_config={
            "mode": 3, "compile_sizes": [3, 4], "pass_config": {"enable_sp": True}})
    cfg = build_engine_config(None, tensor_parallel_size=2, compilation_config={
        "mode": 3, "compile_sizes": [4], "cudagraph_capture_sizes": [1, 2, 3, 4],
        "pass_config": {"enable_sp": True}}, platform="cuda")
    assert cfg.compilation_config.cudagraph_capture_sizes == [2, 4]  # vLLM drops the odd ones
    assert "+rms_norm" in cfg.compilation_config.custom_ops


# ---------------------------------------------------------------------------- the SP pass
def _decoder_chain(ids, w, emb, o_w, d_w, moe_w):
    ops = torch.ops.forwardkit
    h = ops.all_reduce(emb[ids], "tp")              # vocabulary-parallel embedding
    residual = h
    x = ops.rms_norm(h, w, 1e-6)                     # first pattern
    o = ops.all_reduce(x @ o_w, "tp")               # row-parallel o_proj
    x, residual = ops.fused_add_rms_norm(o, residual, w, 1e-6)   # middle pattern
    d = ops.all_gather(x @ moe_w, 0, 2, "tp")[: x.shape[0]]      # a block that gathers itself
    x, residual = ops.fused_add_rms_norm(d, residual, w, 1e-6)   # residual scattered, x sliced
    e = ops.all_reduce(x @ d_w, "tp")
    out, _ = ops.fused_add_rms_norm(e, residual, w, 1e-6)
    return out


def test_sequence_parallel_pass_rewrites_the_residual_chain():
    import torch.fx

    import forwardkit.layers.kernels  # noqa: F401 - registers the norm ops
    from forwardkit.compilation.sequence_parallelism import SequenceParallelismPass

    gm = torch.fx.symbolic_trace(_decoder_chain)

    def count(name):
        return sum(1 for n in gm.graph.nodes if n.op == "call_function"
                   and getattr(n.target, "__name__", "").split(".")[0] == name)

    assert count("all_reduce") == 3
    converted = SequenceParallelismPass(2, 1)(gm)
    assert converted == 3 and count("all_reduce") == 0 and count("reduce_scatter") == 3
    # gathers: the first norm's output, the two fused norms' outputs that feed matmuls and the
    # last one (the model output); the residual is never gathered
    assert count("sp_all_gather") == 4
    assert count("sp_slice") == 1  # the gathered MoE output is sliced to this rank's rows
    slice_node = next(n for n in gm.graph.nodes if getattr(n.target, "__name__", "").startswith("sp_slice"))
    assert slice_node.args[1:] == (2, 1)  # TP 2, rank 1
    gathers = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "").startswith("sp_all_gather")]
    assert all(not g.args[0].target.__name__.startswith("getitem") or g.args[0].args[1] == 0
               for g in gathers if g.args[0].op == "call_function")
    with pytest.raises(ValueError, match="needs tensor_parallel_size >= 2"):
        SequenceParallelismPass(1, 0)
