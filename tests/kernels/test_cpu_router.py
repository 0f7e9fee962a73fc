"""The CPU linear router and the ``forwardkit::linear`` op: the same results as ``F.linear``,
packed copies kept fresh on writes, routing decided by ``custom_ops`` (never by timing)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from forwardkit.kernels.cpu import native_linear, router
from forwardkit.kernels.cpu.router import CpuLinearRouter, bind
from forwardkit.layers.linear import (
    Linear,
    LMHead,
    MergedLinear,
    VocabEmbedding,
    copy_weight,
    linear_op_weights,
)

BF16 = torch.bfloat16
# float32 packs wherever oneDNN is there; bf16 only with native bf16 instructions
PACKED_DTYPES = [pytest.param(torch.float32, id="float32"),
                 pytest.param(BF16, id="bf16", marks=pytest.mark.skipif(
                     not router.prepack_supported(BF16),
                     reason="this CPU has no native bf16 matmul (AVX-512-BF16 / AMX)"))]


def _fast() -> CpuLinearRouter:
    """A router that takes the fast paths themselves: no timing may choose plain F.linear."""
    return CpuLinearRouter(timing=False)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    # both accumulate in float32 and round to bf16 once; the order of the sums may differ
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def _filled(layer: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


def test_only_bf16_and_float32_on_cpu_are_routed():
    assert router.prepack_supported(torch.float32) == torch.backends.mkldnn.is_available()
    assert not router.prepack_supported(torch.float16, "cpu")
    assert not router.prepack_supported(BF16, "meta")
    assert not router.prepack_supported(torch.float32, "meta")
    fp16 = Linear(8, 8, dtype=torch.float16)
    routes = _fast()
    assert routes.route_weights(linear_op_weights(fp16)) == 0 and not routes.is_routed(fp16.weight)


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_routed_linear_matches_f_linear(rows, dtype):
    torch.manual_seed(0)
    layer = _filled(Linear(96, 160, bias=True, dtype=dtype))
    x = torch.randn(rows, 96, dtype=dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    routes = _fast()
    assert routes.route_weights(linear_op_weights(layer)) == 1 and routes.is_routed(layer.weight)
    with bind(routes):
        got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 160)
    _close(got, expected)
    assert routes.packed_count() == (1 if native_linear.max_rows(dtype) < rows
                                     <= router.LAZY_PACK_MAX_ROWS else 0)


def test_the_op_without_a_bound_router_is_f_linear(monkeypatch):
    """No router bound, or a router that does not hold the weight: plain F.linear (the fast
    path is never asked)."""
    monkeypatch.setattr(router, "_fast_path", lambda *a: pytest.fail("fast path taken"))
    gen = torch.Generator().manual_seed(4)
    w, b = torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    routes = _fast()
    routes.route(w)
    assert router.current_router() is None
    for rows in (1, 2, 7, 40):
        x = torch.randn(rows, 40, generator=gen)
        assert torch.equal(torch.ops.forwardkit.linear(x, w, b), F.linear(x, w, b))
        with bind(_fast()):  # bound, but another model's router
            assert torch.equal(torch.ops.forwardkit.linear(x, w, b), F.linear(x, w, b))
    with bind(routes):
        assert router.current_router() is routes
        with pytest.raises(pytest.fail.Exception, match="fast path taken"):
            torch.ops.forwardkit.linear(torch.randn(1, 40), w, b)
    assert router.current_router() is None


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_writes_through_weight_loaders_refresh_the_packed_copy(dtype):
    torch.manual_seed(1)
    merged = _filled(MergedLinear(32, [("q", 16), ("k", 8), ("v", 8)], dtype=dtype))
    plain = _filled(Linear(32, 24, dtype=dtype))
    routes = _fast()
    routes.route_weights(linear_op_weights(torch.nn.ModuleList([merged, plain])))
    x = torch.randn(3, 32, dtype=dtype)
    with bind(routes):
        merged(x), plain(x)  # packs both: the writes below must re-derive the packed copies
        assert routes.packed_count() == 2
        new_k = torch.randn(8, 32)  # float32 source, cast on copy
        merged.weight_loader(merged.weight, new_k, "k")
        assert torch.equal(merged.weight[16:24], new_k.to(dtype))
        _close(merged(x), F.linear(x, merged.weight))
        new_plain = torch.randn(24, 32, dtype=dtype)
        copy_weight(plain.weight.data, new_plain)
        _close(plain(x), F.linear(x, new_plain))


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_writes_block_repacks_each_weight_once_at_its_end(dtype, monkeypatch):
    """``writes()`` binds the router for weight writes (as ``update_weights`` does) and
    re-derives a merged weight written shard by shard once, after the last shard."""
    merged = _filled(MergedLinear(32, [("q", 16), ("k", 8), ("v", 8)], dtype=dtype))
    routes = _fast()
    routes.route_weights(linear_op_weights(merged))
    x = torch.randn(4, 32, dtype=dtype)
    with bind(routes):
        merged(x)  # packed
    packs = []
    real = router._packed_copy
    monkeypatch.setattr(router, "_packed_copy", lambda w: packs.append(w) or real(w))
    fresh = {sid: torch.randn(n, 32) for sid, n in (("q", 16), ("k", 8), ("v", 8))}
    with routes.writes():
        for sid, t in fresh.items():
            merged.weight_loader(merged.weight, t, sid)
        assert packs == []  # deferred to the end of the block
    assert len(packs) == 1
    with bind(routes):
        _close(merged(x), F.linear(x, torch.cat(list(fresh.values())).to(dtype)))
    # a write with no router bound leaves the copy alone (it belongs to whoever binds it)
    merged.weight_loader(merged.weight, fresh["q"], "q")
    assert len(packs) == 1


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_tied_head_uses_the_embedding_table_and_sees_its_updates(dtype):
    embed = _filled(VocabEmbedding(50, 16, dtype=dtype))
    head = LMHead(50, 16, dtype=dtype, tie_to=embed)
    routes = _fast()
    routes.route_weights(linear_op_weights(torch.nn.ModuleList([embed, head])))
    assert routes.is_routed(head.weight) and head.calls_linear_op
    h = torch.randn(5, 16, dtype=dtype)
    fresh = torch.randn(50, 16)
    with bind(routes):
        head(h)  # packed
        embed.weight.weight_loader(embed.weight, fresh)
        _close(head(h), F.linear(h, fresh.to(dtype)).float())


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_packed_copy_goes_with_its_weight(dtype):
    routes = _fast()
    layer = Linear(16, 16, dtype=dtype)
    routes.route_weights(linear_op_weights(layer))
    assert routes.packed_count() == 0  # packed at first use, not before
    with bind(routes):
        layer(torch.randn(4, 16, dtype=dtype))
    assert routes.packed_count() == 1
    del layer
    gc.collect()
    assert routes.packed_count() == 0 and routes._entries == {}


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_packing_waits_for_a_product_of_a_few_rows(dtype):
    layer = _filled(Linear(64, 48, dtype=dtype))
    routes = _fast()
    routes.route_weights(linear_op_weights(layer))
    few = range(1, native_linear.max_rows(dtype) + 1)  # the native kernel, else packing
    with bind(routes):
        for rows in (*few, router.LAZY_PACK_MAX_ROWS + 1):  # ... / a plain prompt matmul
            x = torch.randn(rows, 64, dtype=dtype)
            _close(layer(x), F.linear(x, layer.weight))
            assert routes.packed_count() == 0
        x = torch.randn(router.LAZY_PACK_MAX_ROWS, 64, dtype=dtype)
        _close(layer(x), F.linear(x, layer.weight))
        assert routes.packed_count() == 1
        x = torch.randn(200, 64, dtype=dtype)  # a packed weight serves long products too
        _close(layer(x), F.linear(x, layer.weight))


def _graphs(fn, *args) -> list[str]:
    """The code of every graph Dynamo hands a backend when compiling ``fn``."""
    codes: list[str] = []

    def backend(gm, example_inputs):
        codes.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=True)(*args)
    return codes


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_compiled_graph_reads_the_packed_copy_at_run_time(dtype):
    """The op is opaque and finds the router and the packed weight per call: an in-place weight
    update after compilation is seen without recompiling."""
    torch.manual_seed(2)
    layer = _filled(Linear(32, 32, dtype=dtype))
    routes = _fast()
    routes.route_weights(linear_op_weights(layer))
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda t: layer(t).relu(), backend=backend, dynamic=True)
    x = torch.randn(4, 32, dtype=dtype)
    with bind(routes):
        _close(compiled(x), F.linear(x, layer.weight).relu())
        assert routes.packed_count() == 1  # the compiled call took the packed path
        new = torch.randn(32, 32, dtype=dtype)
        copy_weight(layer.weight.data, new)
        _close(compiled(x), F.linear(x, new).relu())
    _close(compiled(x), F.linear(x, new).relu())  # unbound: plain F.linear, same graph
    assert len(graphs) == 1
    graph_ops = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert "forwardkit.linear" in graph_ops  # the opaque op, not an aten matmul
    assert not any("mm" in op or "linear" == op for op in graph_ops)


def test_graph_is_the_same_whatever_the_router_chose(monkeypatch, tmp_path):
    """Routing and timing happen inside the op: a weight timed to plain F.linear everywhere,
    one timed to the fast path and one not routed at all compile to the same graph."""
    x = torch.randn(3, 64)
    codes = {}
    for name, fast_wins in (("plain", False), ("fast", True), ("unrouted", None)):
        monkeypatch.setenv("FORWARDKIT_CACHE_ROOT", str(tmp_path / name))  # no saved choices
        layer = _filled(Linear(64, 48))
        routes = CpuLinearRouter()
        if fast_wins is not None:
            monkeypatch.setattr(router, "_faster_is_fast_path", lambda *a, w=fast_wins: w)
            assert routes.route_weights(linear_op_weights(layer)) == 1
            assert routes.entry(layer.weight).choices == [fast_wins] * 10
        with bind(routes):
            (codes[name],) = _graphs(layer, x)
    assert codes["plain"] == codes["fast"] == codes["unrouted"]
    assert "torch.ops.forwardkit.linear" in codes["plain"]


# ------------------------------------------------------------------ routing by custom_ops
def _built_under(custom_ops: list[str], mode: int = 3) -> tuple[Linear, LMHead, object]:
    from forwardkit.config.compilation import CompilationConfig
    from forwardkit.config.engine import EngineConfig, set_current_engine_config

    config = EngineConfig(compilation_config=CompilationConfig(custom_ops=custom_ops, mode=mode))
    with set_current_engine_config(config):
        return Linear(8, 8), LMHead(10, 8), config.compilation_config


@pytest.mark.parametrize(("custom_ops", "mode", "calls_op"), [
    ([], 3, True),  # resolved to "none" (mode 3 + Inductor): cpu_linear stays on
    (["none"], 0, True),
    (["all"], 3, True),
    (["none", "+cpu_linear"], 3, True),
    (["-cpu_linear"], 3, False),
    (["all", "-cpu_linear"], 0, False),
])
def test_custom_ops_decide_which_layers_call_the_op(custom_ops, mode, calls_op, cpu_platform):
    linear, head, cc = _built_under(custom_ops, mode)
    assert linear.calls_linear_op is calls_op and head.calls_linear_op is calls_op
    assert cc.is_custom_op_enabled("cpu_linear") is calls_op  # the one rule agrees
    counter = cc.enabled_custom_ops if calls_op else cc.disabled_custom_ops
    assert counter["cpu_linear"] == 2
    x = torch.randn(2, 8)
    _filled(linear)
    codes = _graphs(linear, x)
    assert ("torch.ops.forwardkit.linear" in codes[0]) is calls_op
    found = linear_op_weights(torch.nn.ModuleList([linear, head]))
    assert [(w is linear.weight or w is head.weight, b) for w, b in found] == (
        [(True, None), (True, None)] if calls_op else [])


def test_loader_makes_the_router_and_the_runner_binds_it_per_step(monkeypatch):
    """The loader routes the op's weights in a router kept with the model; the runner holds
    it and binds it around each step (the op sees it there, and only there)."""
    from forwardkit import LLM, SamplingParams

    llm = LLM(enforce_eager=True)  # the built-in model (float32)
    routes = llm.runner.cpu_linear_router
    assert isinstance(routes, CpuLinearRouter) and router.attached_router(llm.runner.module) is routes
    layers = [m for m in llm.runner.module.modules() if isinstance(m, (Linear, LMHead))]
    assert layers and all(m.calls_linear_op and routes.is_routed(m.weight) for m in layers)
    routes.set_timing(False)  # every bucket the fast path: each product must meet the router
    seen = []
    real = router._fast_path
    monkeypatch.setattr(router, "_fast_path",
                        lambda *a: seen.append(router.current_router()) or real(*a))
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2),
                 use_tqdm=False)
    assert seen and all(r is routes for r in seen)
    assert router.current_router() is None  # unbound after the step


def test_memory_check_routes_without_packing(monkeypatch):
    """A second copy of the weights would not fit: weights stay routed (few rows take the native
    kernel, which reads the plain weight) but nothing is ever packed (more rows: plain F.linear)."""
    monkeypatch.setattr(router, "available_memory_bytes", lambda: 1 << 10)  # 1 KiB free
    layer = _filled(Linear(64, 48))
    routes = _fast()
    assert routes.route_weights(linear_op_weights(layer)) == 1 and routes.is_routed(layer.weight)
    assert not routes.may_pack
    assert layer.calls_linear_op  # the graph does not change
    native_calls = []
    real = router.native_linear.linear_rows
    monkeypatch.setattr(router.native_linear, "linear_rows",
                        lambda *a, **k: native_calls.append(a[0].shape[0]) or real(*a, **k))
    with bind(routes):
        for rows in (1, 3, 8, 40):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert routes.packed_count() == 0  # 3- and 8-row products would have packed with memory
    assert native_calls == [1, 3, 8, 40]  # every product asks the native kernel first
    enough = _fast()
    monkeypatch.setattr(router, "available_memory_bytes", lambda: 1 << 40)
    assert enough.route_weights(linear_op_weights(layer)) == 1 and enough.may_pack
    if router.prepack_supported(torch.float32) and router.native_linear.max_rows(torch.float32) < 8:
        with bind(enough):
            layer(torch.randn(8, 64))
        assert enough.packed_count() == 1  # the control: with memory, 8 rows pack


# ------------------------------------------------------------------ timed path choice
@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """Saved choices in this test's own cache root."""
    monkeypatch.setenv("FORWARDKIT_CACHE_ROOT", str(tmp_path))
    return monkeypatch


def _small_model(dtype):
    torch.manual_seed(3)
    return _filled(torch.nn.Sequential(Linear(64, 48, bias=True, dtype=dtype), Linear(48, 40, dtype=dtype)))


def _reference(model, x):
    return F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight)


@pytest.mark.parametrize("fast_wins", [False, True])
def test_small_models_keep_the_path_that_timed_faster(tuning, fast_wins):
    """Timing chooses inside the op; it never un-routes a layer (which would change the graph)."""
    tuning.setattr(router, "_faster_is_fast_path", lambda *a: fast_wins)
    model = _small_model(torch.float32)
    routes = CpuLinearRouter()
    assert routes.route_weights(linear_op_weights(model)) == 2
    assert all(m.calls_linear_op and routes.is_routed(m.weight) for m in model)
    for key, route in routes.routes().items():
        assert route == [fast_wins] * len(route), key
    fast_calls = []
    real = router._fast_path
    tuning.setattr(router, "_fast_path", lambda *a: fast_calls.append(1) or real(*a))
    x = torch.randn(5, 64)
    with bind(routes):
        torch.testing.assert_close(model(x), _reference(model, x), atol=1e-4, rtol=1e-4)
    assert len(fast_calls) == (2 if fast_wins else 0)


def test_a_weight_is_routed_per_row_bucket(tuning):
    # the fast path only for 1 row: 2+ rows go to F.linear, the weight stays routed
    tuning.setattr(router, "_faster_is_fast_path", lambda x, *a: x.shape[0] == 1)
    layer = _filled(Linear(64, 48, dtype=torch.float32))
    routes = CpuLinearRouter()
    assert routes.route_weights(linear_op_weights(layer)) == 1 and routes.is_routed(layer.weight)
    (route,) = routes.routes().values()
    assert route[0] is True and not any(route[1:])
    fast_rows: list[int] = []
    fast_path = router._fast_path

    def spy(x, *args):
        fast_rows.append(x.shape[0])
        return fast_path(x, *args)

    tuning.setattr(router, "_fast_path", spy)
    with bind(routes):
        x = torch.randn(1, 64)  # the fast path: the native kernel, or (without one) a packed copy
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
        before = routes.packed_count()
        for rows in (3, 20, 300, 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    assert fast_rows == [1, 1]  # 3+ rows took F.linear
    assert routes.packed_count() == before  # ... and packed nothing


def test_real_timing_gives_f_linear_results_either_way(tuning):
    model = _small_model(torch.float32)
    routes = CpuLinearRouter()
    routes.route_weights(linear_op_weights(model))
    assert all(all(r is not None for r in route) for route in routes.routes().values())
    with bind(routes):
        for rows in (1, 2, 7, 40):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(model(x), _reference(model, x), atol=1e-4, rtol=1e-4)


def test_large_models_and_the_switch_skip_the_timing(tuning):
    tuning.setattr(router, "_faster_is_fast_path", lambda *a: pytest.fail("timed"))
    tuning.setattr(router, "TUNE_MAX_BYTES", 0)  # as if the model were large
    model = _small_model(torch.float32)
    routes = CpuLinearRouter()
    assert routes.route_weights(linear_op_weights(model)) == 2 and routes.routes() == {}
    with bind(routes):
        model(torch.randn(3, 64))
    tuning.setattr(router, "TUNE_MAX_BYTES", 64 << 20)
    other = _small_model(torch.float32)
    untimed = CpuLinearRouter(timing=False)
    assert untimed.route_weights(linear_op_weights(other)) == 2 and untimed.routes() == {}
    with bind(untimed):
        other(torch.randn(3, 64))


def test_switching_timing_off_drops_the_choices(tuning):
    """``set_timing(False)``: the deterministic switch (parity tests use it): every routed
    weight takes the fast path whatever was timed."""
    tuning.setattr(router, "_faster_is_fast_path", lambda *a: False)
    model = _small_model(torch.float32)
    routes = CpuLinearRouter()
    routes.route_weights(linear_op_weights(model))
    assert all(routes.entry(m.weight).choices == [False] * 10 for m in model)
    routes.set_timing(False)
    assert all(routes.entry(m.weight).choices is None for m in model)
    fast_calls = []
    real = router._fast_path
    tuning.setattr(router, "_fast_path", lambda *a: fast_calls.append(1) or real(*a))
    x = torch.randn(2, 64)
    with bind(routes):  # the native kernel sums in another order than MKL
        torch.testing.assert_close(model(x), _reference(model, x), atol=1e-4, rtol=1e-4)
    assert len(fast_calls) == 2


def test_choices_are_saved_and_a_later_process_makes_the_same(tuning, tmp_path):
    tuning.setattr(router, "_faster_is_fast_path", lambda x, *a: x.shape[0] <= 2)
    first = CpuLinearRouter()
    first.route_weights(linear_op_weights(_small_model(torch.float32)))
    chosen = first.routes()
    (saved,) = (tmp_path / "linear_routes").iterdir()
    # a new router (as in a new process): the choices come from the file, untimed
    tuning.setattr(router, "_faster_is_fast_path", lambda *a: pytest.fail("timed again"))
    model = _small_model(torch.float32)
    second = CpuLinearRouter()
    second.route_weights(linear_op_weights(model))
    assert second.routes() == chosen and all(second.is_routed(m.weight) for m in model)
    saved.write_text("{not json")  # unreadable: ignored, timed anew
    tuning.setattr(router, "_faster_is_fast_path", lambda *a: False)
    other = _small_model(torch.float32)
    third = CpuLinearRouter()
    assert third.route_weights(linear_op_weights(other)) == 2  # still routed: F.linear inside
    assert all(route == [False] * 10 for route in third.routes().values())
