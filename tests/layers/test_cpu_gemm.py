"""oneDNN-prepacked bf16 linear weights: same results as ``F.linear``, kept fresh on writes."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from forwardkit.layers import cpu_gemm, native_linear
from forwardkit.layers.linear import (
    Linear,
    LMHead,
    MergedLinear,
    VocabEmbedding,
    copy_weight,
    prepack_weights,
)

BF16 = torch.bfloat16
needs_bf16 = pytest.mark.skipif(not cpu_gemm.prepack_supported(BF16),
                                reason="this CPU has no native bf16 matmul (AVX-512-BF16 / AMX)")


@pytest.fixture(autouse=True)
def _fast_paths(monkeypatch):
    """These tests exercise the fast paths themselves: no timing may route a small weight to
    plain F.linear."""
    monkeypatch.setenv("FORWARDKIT_CPU_LINEAR_TUNE", "0")


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    # both accumulate in float32 and round to bf16 once; the order of the sums may differ
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_only_bf16_on_cpu_is_packed():
    assert cpu_gemm.prepack_supported(torch.float32) == torch.backends.mkldnn.is_available()
    assert not cpu_gemm.prepack_supported(torch.float16, "cpu")
    assert not cpu_gemm.prepack_supported(BF16, "meta")
    assert not cpu_gemm.prepack_supported(torch.float32, "meta")
    fp16 = torch.nn.Sequential(Linear(8, 8, dtype=torch.float16))
    assert prepack_weights(fp16) == 0 and not fp16[0].packed


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=True, dtype=BF16)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(rows, 96, dtype=BF16)
    expected = F.linear(x, layer.weight, layer.bias)
    assert prepack_weights(torch.nn.Sequential(layer)) == 1 and layer.packed
    got = layer(x)
    assert got.dtype == BF16 and got.shape == (rows, 160)
    _close(got, expected)


@needs_bf16
def test_writes_through_weight_loaders_refresh_the_packed_copy():
    torch.manual_seed(1)
    merged = MergedLinear(32, [("q", 16), ("k", 8), ("v", 8)], dtype=BF16)
    plain = Linear(32, 24, dtype=BF16)
    for layer in (merged, plain):
        with torch.no_grad():
            layer.weight.normal_()
    prepack_weights(torch.nn.ModuleList([merged, plain]))
    x = torch.randn(3, 32, dtype=BF16)
    merged(x), plain(x)  # packs both: the writes below must re-derive the packed copies
    new_k = torch.randn(8, 32)  # float32 source, cast on copy
    merged.weight_loader(merged.weight, new_k, "k")
    assert torch.equal(merged.weight[16:24], new_k.to(BF16))
    _close(merged(x), F.linear(x, merged.weight))
    new_plain = torch.randn(24, 32, dtype=BF16)
    copy_weight(plain.weight.data, new_plain)
    _close(plain(x), F.linear(x, new_plain))


@needs_bf16
def test_tied_head_uses_the_embedding_table_and_sees_its_updates():
    embed = VocabEmbedding(50, 16, dtype=BF16)
    head = LMHead(50, 16, dtype=BF16, tie_to=embed)
    with torch.no_grad():
        embed.weight.normal_()
    prepack_weights(torch.nn.ModuleList([embed, head]))
    assert head.packed
    h = torch.randn(2, 16, dtype=BF16)
    fresh = torch.randn(50, 16)
    embed.weight.weight_loader(embed.weight, fresh)
    _close(head(h), F.linear(h, fresh.to(BF16)).float())


@needs_bf16
def test_packed_copy_goes_with_its_weight():
    gc.collect()  # layers of earlier tests
    before = cpu_gemm.packed_weight_count()
    layer = Linear(16, 16, dtype=BF16)
    prepack_weights(torch.nn.Sequential(layer))
    assert cpu_gemm.packed_weight_count() == before  # packed at first use, not before
    layer(torch.randn(4, 16, dtype=BF16))
    assert cpu_gemm.packed_weight_count() == before + 1
    del layer
    gc.collect()
    assert cpu_gemm.packed_weight_count() == before


@needs_bf16
def test_packing_waits_for_a_product_of_a_few_rows():
    gc.collect()
    layer = Linear(64, 48, dtype=BF16)
    with torch.no_grad():
        layer.weight.normal_()
    prepack_weights(torch.nn.Sequential(layer))
    before = cpu_gemm.packed_weight_count()
    few = (1, 2) if native_linear.available() else ()  # the native kernel, else packing
    for rows in (*few, cpu_gemm.LAZY_PACK_MAX_ROWS + 1):  # ... / a plain prompt matmul
        x = torch.randn(rows, 64, dtype=BF16)
        _close(layer(x), F.linear(x, layer.weight))
        assert cpu_gemm.packed_weight_count() == before
    x = torch.randn(cpu_gemm.LAZY_PACK_MAX_ROWS, 64, dtype=BF16)
    _close(layer(x), F.linear(x, layer.weight))
    assert cpu_gemm.packed_weight_count() == before + 1
    x = torch.randn(200, 64, dtype=BF16)  # a packed weight serves long products too
    _close(layer(x), F.linear(x, layer.weight))


@needs_bf16
def test_compiled_graph_reads_the_packed_copy_at_run_time():
    """The op is opaque and looks the packed weight up per call: an in-place weight update after
    compilation is seen without recompiling."""
    torch.manual_seed(2)
    layer = Linear(32, 32, dtype=BF16)
    with torch.no_grad():
        layer.weight.normal_()
    prepack_weights(torch.nn.Sequential(layer))
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda t: layer(t).relu(), backend=backend, dynamic=True)
    x = torch.randn(4, 32, dtype=BF16)
    _close(compiled(x), F.linear(x, layer.weight).relu())
    new = torch.randn(32, 32, dtype=BF16)
    copy_weight(layer.weight.data, new)
    _close(compiled(x), F.linear(x, new).relu())
    assert len(graphs) == 1
    graph_ops = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert "forwardkit.linear" in graph_ops  # the opaque op, not an aten matmul
    assert not any("mm" in op or "linear" == op for op in graph_ops)


# ------------------------------------------------------------------ timed path choice
@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """Tuning on, with a clean slate of choices (in memory and on disk) before and after."""
    monkeypatch.setenv("FORWARDKIT_CPU_LINEAR_TUNE", "1")
    monkeypatch.setenv("FORWARDKIT_CACHE_ROOT", str(tmp_path))
    cpu_gemm.clear_routes()
    yield monkeypatch
    cpu_gemm.clear_routes()


def _small_model(dtype):
    torch.manual_seed(3)
    model = torch.nn.Sequential(Linear(64, 48, bias=True, dtype=dtype), Linear(48, 40, dtype=dtype))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


@pytest.mark.parametrize("fast_wins", [False, True])
def test_small_models_keep_the_path_that_timed_faster(tuning, fast_wins):
    tuning.setattr(cpu_gemm, "_faster_is_fast_path", lambda *a: fast_wins)
    model = _small_model(torch.float32)
    routed = prepack_weights(model)
    assert [m.packed for m in model] == [fast_wins, fast_wins]
    assert routed == (2 if fast_wins else 0)
    for key, route in cpu_gemm.routes().items():
        assert route == [fast_wins] * len(route), key
    x = torch.randn(5, 64)
    torch.testing.assert_close(model(x), F.linear(F.linear(x, model[0].weight, model[0].bias),
                                                  model[1].weight))


def test_a_weight_is_routed_per_row_bucket(tuning):
    # the fast path only for 1 row: 2+ rows go to F.linear, the weight stays registered
    tuning.setattr(cpu_gemm, "_faster_is_fast_path", lambda x, *a: x.shape[0] == 1)
    layer = Linear(64, 48, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.normal_()
    assert prepack_weights(torch.nn.Sequential(layer)) == 1 and layer.packed
    (route,) = cpu_gemm.routes().values()
    assert route[0] is True and not any(route[1:])
    fast_rows: list[int] = []
    fast_path = cpu_gemm._fast_path

    def spy(x, *args):
        fast_rows.append(x.shape[0])
        return fast_path(x, *args)

    tuning.setattr(cpu_gemm, "_fast_path", spy)
    x = torch.randn(1, 64)  # the fast path: the native kernel, or (without one) a packed copy
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    before = cpu_gemm.packed_weight_count()
    for rows in (3, 20, 300, 1):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    assert fast_rows == [1, 1]  # 3+ rows took F.linear
    assert cpu_gemm.packed_weight_count() == before  # ... and packed nothing


def test_real_timing_gives_f_linear_results_either_way(tuning):
    model = _small_model(torch.float32)
    prepack_weights(model)
    assert all(all(r is not None for r in route) for route in cpu_gemm.routes().values())
    for rows in (1, 2, 7, 40):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(model(x), F.linear(F.linear(x, model[0].weight, model[0].bias),
                                                      model[1].weight), atol=1e-4, rtol=1e-4)


def test_large_models_and_the_switch_skip_the_timing(tuning):
    tuning.setattr(cpu_gemm, "_faster_is_fast_path", lambda *a: pytest.fail("timed"))
    tuning.setattr(cpu_gemm, "TUNE_MAX_BYTES", 0)  # as if the model were large
    model = _small_model(torch.float32)
    assert prepack_weights(model) == 2 and cpu_gemm.routes() == {}
    model(torch.randn(3, 64))
    tuning.setattr(cpu_gemm, "TUNE_MAX_BYTES", 64 << 20)
    tuning.setenv("FORWARDKIT_CPU_LINEAR_TUNE", "0")
    other = _small_model(torch.float32)
    assert prepack_weights(other) == 2 and cpu_gemm.routes() == {}
    other(torch.randn(3, 64))


def test_choices_are_saved_and_a_later_process_makes_the_same(tuning, tmp_path):
    tuning.setattr(cpu_gemm, "_faster_is_fast_path", lambda x, *a: x.shape[0] <= 2)
    prepack_weights(_small_model(torch.float32))
    chosen = cpu_gemm.routes()
    (saved,) = (tmp_path / "linear_routes").iterdir()
    cpu_gemm.clear_routes()  # as in a new process: the choices come from the file, untimed
    tuning.setattr(cpu_gemm, "_faster_is_fast_path", lambda *a: pytest.fail("timed again"))
    model = _small_model(torch.float32)
    prepack_weights(model)
    assert cpu_gemm.routes() == chosen and all(m.packed for m in model)
    saved.write_text("{not json")  # unreadable: ignored, timed anew
    cpu_gemm.clear_routes()
    tuning.setattr(cpu_gemm, "_faster_is_fast_path", lambda *a: False)
    other = _small_model(torch.float32)
    assert prepack_weights(other) == 0
