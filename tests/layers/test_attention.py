"""Paged attention through the forward context vs a dense float64 reference."""

from __future__ import annotations

import pytest
import torch

from forwardkit.forward_context import set_forward_context
from forwardkit.layers.attention import Attention, build_attention_metadata
from forwardkit.layers.kv_cache import bind_kv_cache

HQ, HK, D, BS = 4, 2, 8, 4


@pytest.fixture
def engine_config(decode_path_config):
    """Every test here runs with the native decode kernel and with the torch decode path."""
    return decode_path_config


def _dense(q, k_all, v_all, scale):
    """Causal attention of the last len(q) positions of a sequence, in float64."""
    s, n = k_all.shape[0], q.shape[0]
    group = HQ // HK
    k = k_all.double().repeat_interleave(group, dim=1)
    v = v_all.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(s - n, s).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(s).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class Harness:
    """One attention layer, its cache, and the full K/V history of each request."""

    def __init__(self, engine_config, num_blocks=24):
        self.config = engine_config
        self.layer = Attention(HQ, D, D**-0.5, HK, prefix="model.layers.0.self_attn.attn")
        self.cache = bind_kv_cache(engine_config.compilation_config.static_forward_context, num_blocks, BS, torch.float32, "cpu")[self.layer.layer_name]
        self.hist: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(0)
        # Non-contiguous, out-of-order block tables.
        self.tables = {0: [7, 2, 19, 11, 5], 1: [3, 17, 0, 9], 2: [22, 14, 6, 1], 3: [8, 20, 13]}

    def step(self, q_lens: dict[int, int], pad: int = 0, garbage_pad: bool = True):
        rids = list(q_lens)
        n = sum(q_lens.values())
        t = n + pad
        q = torch.randn(t, HQ * D, generator=self.gen)
        k = torch.randn(t, HK * D, generator=self.gen)
        v = torch.randn(t, HK * D, generator=self.gen)
        if not garbage_pad:
            q[n:], k[n:], v[n:] = 0, 0, 0
        seq_lens, off, expected = [], 0, []
        for rid in rids:
            ql = q_lens[rid]
            kk, vv = k[off : off + ql].view(ql, HK, D), v[off : off + ql].view(ql, HK, D)
            pk, pv = self.hist.get(rid, (kk[:0], vv[:0]))
            self.hist[rid] = (torch.cat([pk, kk]), torch.cat([pv, vv]))
            seq_lens.append(self.hist[rid][0].shape[0])
            expected.append(_dense(q[off : off + ql].view(ql, HQ, D), *self.hist[rid], D**-0.5))
            off += ql
        md = build_attention_metadata(list(q_lens.values()), seq_lens, [self.tables[r] for r in rids], t, BS, "cpu")
        with set_forward_context({self.layer.layer_name: md}, self.config, num_tokens=t):
            out = self.layer(q, k, v)
        return out.view(t, HQ, D), torch.cat(expected).float(), n


def test_mixed_prefill_chunked_decode_batch(engine_config):
    h = Harness(engine_config)
    out, ref, n = h.step({1: 5, 2: 9, 3: 3})  # plain prefills first
    torch.testing.assert_close(out[:n], ref, atol=1e-5, rtol=1e-5)
    # request 0: fresh prefill; 1: chunked (prefix 5 + 6 new); 2, 3: decode
    out, ref, n = h.step({0: 7, 1: 6, 2: 1, 3: 1}, pad=5)
    torch.testing.assert_close(out[:n], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()
    out, ref, n = h.step({2: 1, 0: 1, 1: 1, 3: 1})  # pure decode, requests reordered
    torch.testing.assert_close(out[:n], ref, atol=1e-5, rtol=1e-5)


def _run_once(engine_config, q, k, v, pad: int):
    """Fresh layer + cache; prefill 6 and 3 tokens, then one step of (1, 4) tokens + ``pad`` rows."""
    h = Harness(engine_config)
    h.step({0: 6, 1: 3})
    gen = torch.Generator().manual_seed(1)
    junk = [torch.randn(pad, x.shape[1], generator=gen) * 1e3 for x in (q, k, v)]
    q, k, v = (torch.cat([x, j]) for x, j in zip((q, k, v), junk))
    md = build_attention_metadata([1, 4], [7, 7], [h.tables[0], h.tables[1]], 5 + pad, BS, "cpu")
    with set_forward_context({h.layer.layer_name: md}, h.config):
        out = h.layer(q, k, v)
    h.config.compilation_config.static_forward_context.clear()
    return out, h.cache


def test_padding_rows_change_nothing(engine_config):
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(5, n * D, generator=gen) for n in (HQ, HK, HK))
    out_a, cache_a = _run_once(engine_config, q, k, v, pad=0)
    out_b, cache_b = _run_once(engine_config, q, k, v, pad=9)
    assert torch.equal(out_a, out_b[:5])
    assert torch.equal(out_b[5:], torch.zeros_like(out_b[5:]))
    # Only the scratch block (the last one) may differ: that is where padding rows write.
    assert torch.equal(cache_a[:, :-1], cache_b[:, :-1])
    assert not torch.equal(cache_a[:, -1], cache_b[:, -1])


def test_no_metadata_gives_zeros(engine_config):
    layer = Attention(HQ, D, 0.3, HK, prefix="attn0")
    q = torch.randn(3, HQ * D)
    k = torch.randn(3, HK * D)
    with set_forward_context(None, engine_config):
        out = layer(q, k, k)
    assert torch.equal(out, torch.zeros_like(q))


def test_unbound_cache_is_a_clear_error(engine_config):
    layer = Attention(HQ, D, 0.3, HK, prefix="attn0")
    md = build_attention_metadata([2], [2], [[0]], 2, BS, "cpu")
    with set_forward_context({"attn0": md}, engine_config), pytest.raises(RuntimeError, match="not bound"):
        layer(torch.randn(2, HQ * D), torch.randn(2, HK * D), torch.randn(2, HK * D))


def test_functional_op_matches_with_output(engine_config):
    h = Harness(engine_config)
    t = 6
    q, k, v = torch.randn(t, HQ * D), torch.randn(t, HK * D), torch.randn(t, HK * D)
    md = build_attention_metadata([4, 1], [4, 1], [[7], [3]], t, BS, "cpu")
    with set_forward_context({h.layer.layer_name: md}, engine_config):
        a = torch.ops.forwardkit.unified_attention(q, k, v, h.layer.layer_name)
        b = torch.empty_like(q)
        torch.ops.forwardkit.unified_attention_with_output(q, k, v, b, h.layer.layer_name)
    torch.testing.assert_close(a[:5], b[:5])


def test_ops_are_tagged_and_traceable(engine_config):
    for op in (torch.ops.forwardkit.unified_attention, torch.ops.forwardkit.unified_attention_with_output):
        assert torch.Tag.cudagraph_unsafe in op.default.tags
    h = Harness(engine_config)
    md = build_attention_metadata([3], [3], [[5]], 4, BS, "cpu")
    q, k, v = torch.randn(4, HQ * D), torch.randn(4, HK * D), torch.randn(4, HK * D)
    compiled = torch.compile(lambda a, b, c: h.layer(a * 2, b, c) + 1, backend="aot_eager", fullgraph=True)
    with set_forward_context({h.layer.layer_name: md}, engine_config):
        got = compiled(q, k, v)
    h.cache.zero_()
    with set_forward_context({h.layer.layer_name: md}, engine_config):
        want = h.layer(q * 2, k, v) + 1
    torch.testing.assert_close(got[:3], want[:3])


def test_duplicate_layer_name(engine_config):
    Attention(HQ, D, 0.3, HK, prefix="model.layers.0.self_attn.attn")
    with pytest.raises(ValueError, match="Duplicate layer name: model.layers.0.self_attn.attn"):
        Attention(HQ, D, 0.3, HK, prefix="model.layers.0.self_attn.attn")


@pytest.mark.parametrize(
    "args, match",
    [
        (([2, 1], [2], [[0]], 4), "one entry per request"),
        (([3], [2], [[0]], 4), "query_len <= seq_len"),
        (([3], [9], [[0, 1]], 4), "holds 8 tokens"),
        (([3], [3], [[0]], 2), "num_padded_tokens=2"),
        (([1], [1], [[-2]], 1), "negative block id"),
    ],
)
def test_metadata_validation(args, match):
    with pytest.raises(ValueError, match=match):
        build_attention_metadata(*args, BS, "cpu")


def test_metadata_slots_and_split():
    md = build_attention_metadata([3, 1], [6, 5], [[4, 9], [2, 8]], 6, 4, "cpu")
    # request 0: positions 3,4,5 -> block 4 slot 3, block 9 slots 0,1; request 1: position 4 -> block 8 slot 0
    assert md.slot_mapping.tolist() == [19, 36, 37, 32, -1, -1]
    assert md.prefill_reqs == [0] and md.decode_token_idx.tolist() == [3]
    assert md.query_start_loc.tolist() == [0, 3, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_step_replays_from_a_cuda_graph(engine_config):
    """The decode path has fixed shapes and no host syncs: capture once, replay with new values."""
    dev = "cuda"
    layer = Attention(HQ, D, D**-0.5, HK, prefix="gpu.attn")
    cache = bind_kv_cache(engine_config.compilation_config.static_forward_context, 16, BS, torch.float32, dev)["gpu.attn"]
    cache.normal_()
    tables = [[3, 5], [7, 1], [0, 2]]
    q, k, v = (torch.randn(3, n * D, device=dev) for n in (HQ, HK, HK))
    md = build_attention_metadata([1, 1, 1], [6, 8, 3], tables, 3, BS, dev, max_num_blocks_per_req=4)
    with set_forward_context({"gpu.attn": md}, engine_config):
        layer(q, k, v)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(q, k, v)
    md2 = build_attention_metadata([1, 1, 1], [7, 5, 4], tables, 3, BS, dev, max_num_blocks_per_req=4)
    for name in ("slot_mapping", "decode_key_mask", "decode_block_table", "decode_token_idx"):
        getattr(md, name).copy_(getattr(md2, name))
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    before = cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    replayed, after_replay = out.clone(), cache.clone()
    cache.copy_(before)
    with set_forward_context({"gpu.attn": md2}, engine_config):
        eager = layer(q, k, v)
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after_replay, cache)
