"""The native few-row bf16 linear and huge-page backing of CPU weights."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from forwardkit.compilation import kernel_cache
from forwardkit.kernels.cpu import hugepages, native_build, native_linear, router

BF16 = torch.bfloat16
ISAS = ["avx512", "avx2"]
needs_kernel = pytest.mark.skipif(
    not any(native_linear.isa_supported(isa, BF16) for isa in ISAS),
    reason="the CPU has neither AVX-512-BF16 nor AVX2+FMA (the native kernel's instructions)")


def _require(isa: str, dtype: torch.dtype) -> None:
    if not native_linear.isa_supported(isa, dtype):
        pytest.skip(f"the CPU lacks the instructions of the {isa} build for {dtype}")


@pytest.fixture
def fresh_kernel(monkeypatch):
    """The kernel loader re-run under this test's environment, and again after it."""
    native_linear.cache_clear()
    yield monkeypatch
    native_linear.cache_clear()


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(8, 32), (13, 70), (3072, 2048), (257, 1000), (5, 31), (9, 47)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_matches_a_float64_linear(isa, rows, n, k, with_bias, dtype):
    _require(isa, dtype)
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    out = native_linear.linear_rows(x, w, b, isa=isa)
    assert out is not None and out.dtype == dtype and out.shape == (rows, n)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    if dtype == BF16:  # fp32 accumulation, one rounding to bf16: bf16's half-ulp of the result
        torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=1e-3 * ref.abs().max().item())
    else:  # fp32 accumulation in another order than MKL: a few fp32 ulps of the sum's size
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(out, native_linear.linear_rows(x, w, b, isa=isa))  # deterministic


@pytest.mark.parametrize("rows", [3, 4, 5, 6, 7, 8, 9, 12, 16])
@pytest.mark.parametrize(("n", "k"), [(13, 70), (3072, 2048), (257, 1000), (9, 47)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_avx2_bf16_serves_batched_decode_rows(rows, n, k, with_bias):
    """The AVX2 build in bf16 takes 3-16 rows too: 3-5 in groups of up to 4 activation rows
    through each block of weight rows, 6-16 by the broadcast kernel (8 or 16 activation rows
    a vector, 8 or 6 weight rows at a time and a tail of single rows), whose sums are the
    blocked prompt kernel's bit for bit (each output summed over k in order)."""
    _require("avx2", BF16)
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(BF16)
    b = torch.randn(n, generator=gen).to(BF16) if with_bias else None
    out = native_linear.linear_rows(x, w, b, isa="avx2")
    assert out is not None and out.shape == (rows, n)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=1e-3 * ref.abs().max().item())
    # each row equals that row computed alone: no group mixes rows up
    for r in (0, rows - 1):
        alone = native_linear.linear_rows(x[r:r + 1], w, b, isa="avx2")
        assert alone is not None
        torch.testing.assert_close(out[r:r + 1].double(), alone.double(), rtol=8e-3, atol=1e-3 * ref.abs().max().item())
    if rows >= 6:
        assert torch.equal(out, native_linear.linear_bf16_rows(x, w, b))


def test_row_limits_per_build():
    """The AVX2 bf16 build reports 16 rows; every other build serves MAX_ROWS; more rows than
    a build serves fall through to the caller's other path (None)."""
    _require("avx2", BF16)
    assert native_linear._row_limit("avx2", BF16) == 16
    assert native_linear._row_limit("avx2", torch.float32) == native_linear.MAX_ROWS == 2
    w = torch.randn(8, 32).to(BF16)
    assert native_linear.linear_rows(torch.randn(17, 32).to(BF16), w, None, isa="avx2") is None
    assert native_linear.linear_rows(torch.randn(16, 32).to(BF16), w, None, isa="avx2") is not None
    wf = torch.randn(8, 32)
    assert native_linear.linear_rows(torch.randn(3, 32), wf, None, isa="avx2") is None
    if native_linear.kernel_isa(BF16) == "avx2":
        assert native_linear.max_rows(BF16) == 16


def test_each_dtype_takes_the_widest_build_the_cpu_has():
    for dtype in (BF16, torch.float32):
        expected = next((isa for isa in ISAS if native_linear.isa_supported(isa, dtype)), None)
        assert native_linear.kernel_isa(dtype) == expected  # this machine's compiler builds both
    assert native_linear.kernel_isa(torch.float16) is None


def test_a_build_the_cpu_cannot_run_is_never_used(monkeypatch, fresh_kernel):
    monkeypatch.setattr(native_linear, "cpu_flags", lambda: frozenset({"sse2"}))
    assert native_linear.kernel_isa(BF16) is None and native_linear.candidate_builds() == []
    x, w = torch.randn(1, 32).to(BF16), torch.randn(8, 32).to(BF16)
    assert native_linear.linear_rows(x, w, None) is None
    assert native_linear.linear_rows(x, w, None, isa="avx2") is None
    monkeypatch.setattr(native_linear, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert native_linear.candidate_builds() == ["avx2:bfloat16", "avx2:float32"]


@needs_kernel
def test_leading_dims_and_non_contiguous_input():
    x = torch.randn(1, 64, 2).to(BF16)[..., 0]  # [1, 64], not contiguous
    w = torch.randn(24, 64).to(BF16)
    out = native_linear.linear_rows(x, w, None)
    assert out is not None and out.shape == (1, 24)
    torch.testing.assert_close(out.float(), _reference(x, w, None), rtol=8e-3, atol=1e-2)


@needs_kernel
def test_declines_what_it_does_not_cover():
    w = torch.randn(16, 64).to(BF16)
    x1 = torch.randn(1, 64).to(BF16)
    too_many = max(native_linear.max_rows(BF16), native_linear.MAX_ROWS) + 1
    assert native_linear.linear_rows(torch.randn(too_many, 64).to(BF16), w, None) is None
    assert native_linear.linear_rows(x1.half(), w.half(), None) is None
    assert native_linear.linear_rows(x1.float(), w, None) is None  # mixed dtypes
    assert native_linear.linear_rows(x1, w.t().contiguous().t(), None) is None  # strided weight
    assert native_linear.linear_rows(x1, w, torch.zeros(16)) is None  # fp32 bias
    assert native_linear.linear_rows(torch.randn(0, 64).to(BF16), w, None) is None


@needs_kernel
@pytest.mark.skipif(not router.prepack_supported(BF16), reason="this CPU has no native bf16 matmul (oneDNN: no AVX-512-BF16 / AMX)")
def test_packed_layers_use_it_for_few_rows_only(monkeypatch):
    w = torch.randn(40, 96).to(BF16)
    routes = router.CpuLinearRouter(timing=False)  # the fast paths themselves, never timed away
    routes.pack(w)
    with router.bind(routes):
        calls = []
        real = native_linear.linear_rows

        def spy(x, weight, bias):
            out = real(x, weight, bias)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(native_linear, "linear_rows", spy)
        for rows in (1, 2, 7):
            x = torch.randn(rows, 96).to(BF16)
            torch.testing.assert_close(router.linear(x, w).float(), _reference(x, w, None),
                                       rtol=2e-2, atol=2e-2)
        assert calls == [True, True, False]  # 7 rows go to oneDNN's packed matmul
        calls.clear()
        router.linear(torch.randn(1, 40).to(BF16), torch.randn(8, 40).to(BF16))  # not routed
        assert calls == []


@needs_kernel
def test_routed_bf16_layers_without_onednn_bf16_use_it_and_never_pack(monkeypatch):
    """An AVX2 CPU (no oneDNN bf16): bf16 layers are routed for the native kernels alone; the
    rows the few-row kernel serves (1-16 with the AVX2 build) take it, more rows the AVX2
    build's blocked kernel (never PyTorch's emulated bf16 matmul), and nothing is packed."""
    from forwardkit.layers.linear import Linear, linear_op_weights

    monkeypatch.setattr(router, "_packable", lambda dtype: False)  # as on such a CPU
    assert router.route_supported(BF16)
    layer = Linear(96, 40, dtype=BF16)
    with torch.no_grad():
        layer.weight.normal_()
    routes = router.CpuLinearRouter(timing=False)  # the fast paths themselves, never timed away
    assert routes.route_weights(linear_op_weights(layer)) == 1 and routes.is_routed(layer.weight)
    calls = []
    real = native_linear.linear_rows

    def spy(x, weight, bias, isa=None):
        out = real(x, weight, bias, isa)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(native_linear, "linear_rows", spy)
    before = native_build.kernel_calls.snapshot()
    with router.bind(routes):
        for rows in (1, 2, 3, 40):
            x = torch.randn(rows, 96).to(BF16)
            torch.testing.assert_close(layer(x).float(), _reference(x, layer.weight, None),
                                       rtol=2e-2, atol=2e-2)
    assert calls == [r <= native_linear.max_rows(BF16) for r in (1, 2, 3, 40)]
    assert calls[:2] == [True, True] and calls[3] is False
    assert routes.packed_count() == 0
    # every product served natively once: the few-row kernel or the blocked one
    assert native_build.kernel_calls.since(before) == {"attention": 0, "linear": 4, "quant": 0}


@needs_kernel
def test_served_products_are_counted_declined_ones_not():
    """``native_build.kernel_calls.linear`` counts the products the kernel computed: what the
    engine's stats and the bench profile report as kernel use."""
    dtype = BF16 if native_linear.available(BF16) else torch.float32
    w = torch.randn(8, 32).to(dtype)
    before = native_build.kernel_calls.snapshot()
    assert native_linear.linear_rows(torch.randn(1, 32).to(dtype), w, None) is not None
    assert native_linear.linear_rows(torch.randn(2, 32).to(dtype), w, None) is not None
    too_many = native_linear.max_rows(dtype) + 1
    assert native_linear.linear_rows(torch.randn(too_many, 32).to(dtype), w, None) is None
    assert native_linear.linear_rows(torch.randn(1, 32).half(), w.half(), None) is None
    assert native_build.kernel_calls.since(before) == {"attention": 0, "linear": 2, "quant": 0}


@needs_kernel
def test_missing_compiler_disables_with_a_reason(fresh_kernel, tmp_path, fk_log_records,
                                                 assert_linear_falls_back):
    """Without a compiler (and no verified build cached) the kernel is off with one log line
    and a registered weight's 1-2-row products still equal F.linear (another path serves
    them), so such a machine works."""
    fresh_kernel.setenv("FORWARDKIT_CACHE_ROOT", str(tmp_path))  # nothing built there yet
    fresh_kernel.setenv("CC", "no-such-compiler-xyz")
    # as on a CPU with every build's instructions: still one line (nothing runs: nothing builds)
    flags = native_linear.cpu_flags() | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
    fresh_kernel.setattr(native_linear, "cpu_flags", lambda: flags)
    for dtype in (BF16, torch.float32):
        assert not native_linear.available(dtype)  # the engine falls back instead of failing
    said = [r.getMessage() for r in fk_log_records if r.name == native_linear.__name__]
    assert len(said) == 1 and "no C compiler 'no-such-compiler-xyz'" in said[0], said
    assert_linear_falls_back(5)
    assert not list((tmp_path / "native").glob("*.so"))  # nothing was built


@needs_kernel
def test_build_is_cached_by_source(fresh_kernel, tmp_path):
    fresh_kernel.setenv("FORWARDKIT_CACHE_ROOT", str(tmp_path))
    assert native_linear.available()
    built = sorted((tmp_path / "native").glob("linear_few_rows*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native_linear.cache_clear()
    assert native_linear.available()
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    manifest = tmp_path / "native" / kernel_cache.MANIFEST
    lock = tmp_path / "native" / ".forwardkit_manifest.lock"
    assert sorted((tmp_path / "native").iterdir()) == sorted([*built, manifest, lock])  # no temporary files left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux")
def test_huge_pages_cover_the_aligned_interior_and_keep_values():
    t = torch.empty(3 * hugepages.HUGE_PAGE // 4)  # 6 MiB of float32
    covered = hugepages.advise(t)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
        enabled = "[never]" not in f.read()
    if enabled:
        assert hugepages.HUGE_PAGE <= covered <= t.numel() * 4
        assert covered % hugepages.HUGE_PAGE == 0
    else:
        assert covered == 0
    hugepages.collapse(t)
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32))
    assert hugepages.advise(torch.empty(100)) == 0  # smaller than a huge page: nothing to do
    assert hugepages.advise(torch.empty(8, device="meta")) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux")
def test_background_collapse_keeps_weights_usable():
    weights = [torch.randn(1024, 1024) for _ in range(3)]  # 4 MiB each
    expected = [w.clone() for w in weights]
    thread = hugepages.collapse_in_background([*weights, torch.empty(10)])
    if thread is not None:
        weights[0].add_(1.0)  # written while it may be moving
        thread.join(timeout=60)
        assert not thread.is_alive()
        expected[0].add_(1.0)
    for w, e in zip(weights, expected):
        assert torch.equal(w, e)
    assert hugepages.collapse_in_background([torch.empty(10)]) is None  # nothing large enough


@needs_kernel
def test_a_call_finds_its_row_limit_in_the_one_cached_selection(fresh_kernel):
    """``linear_rows`` runs once per projection per step: the build, its function and its row
    limit come from one cached lookup, with no second (``_row_limit``) call per product."""
    assert native_linear.available(BF16)
    isa, _, limit = native_linear._selected(BF16)
    assert limit == native_linear._row_limit(isa, BF16) == native_linear.max_rows(BF16)
    w = torch.randn(8, 32).to(BF16)
    with pytest.MonkeyPatch.context() as patch:  # undone before fresh_kernel clears the caches
        patch.setattr(native_linear, "_row_limit", lambda *a: pytest.fail("a per-call _row_limit lookup"))
        assert native_linear.linear_rows(torch.randn(limit, 32).to(BF16), w, None) is not None
        assert native_linear.linear_rows(torch.randn(limit + 1, 32).to(BF16), w, None) is None


@pytest.mark.parametrize("rows", [1, 17, 33, 63, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(13, 70), (259, 2080), (9, 47), (24, 8192)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_avx2_bf16_any_rows_kernel(rows, n, k, with_bias):
    """The blocked bf16 kernel for prompts (AVX2 build): any row count (short groups of 6 rows,
    100 rows in two passes of at most 96), full and short 16-row weight panels, K tails and
    K split into slices of 1024 (2080, 8192) against a float64 linear, and each row equal to
    that row computed alone."""
    _require("avx2", BF16)
    assert native_linear.bf16_rows_available()
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(BF16)
    b = torch.randn(n, generator=gen).to(BF16) if with_bias else None
    before = native_build.kernel_calls.linear
    out = native_linear.linear_bf16_rows(x, w, b)
    assert out is not None and out.dtype == BF16 and out.shape == (rows, n)
    assert native_build.kernel_calls.linear == before + 1
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=1e-3 * ref.abs().max().item())
    for r in (0, rows // 2, rows - 1):
        alone = native_linear.linear_bf16_rows(x[r:r + 1], w, b)
        assert alone is not None and torch.equal(out[r:r + 1], alone)


def test_avx2_bf16_any_rows_declines_what_it_does_not_serve():
    _require("avx2", BF16)
    w = torch.randn(8, 32).to(BF16)
    assert native_linear.linear_bf16_rows(torch.randn(20, 32), w, None) is None  # float32 x
    assert native_linear.linear_bf16_rows(torch.randn(20, 32).to(BF16), w.t().contiguous().t(), None) is None
    assert native_linear.linear_bf16_rows(torch.randn(20, 32).to(BF16), w, None) is not None
    assert native_linear.linear_bf16_rows(torch.randn(20, 48).to(BF16), w, None) is None  # wrong k


def test_router_sends_long_bf16_products_to_the_blocked_kernel_without_native_bf16(monkeypatch):
    """Where oneDNN has no bf16 (``_packable`` False: an AVX2 CPU), a routed bf16 weight's
    products of more than 16 rows take the AVX2 blocked kernel, not PyTorch's bf16 matmul."""
    _require("avx2", BF16)
    assert native_linear.bf16_rows_available()  # built and self-checked (with F.linear) first
    monkeypatch.setattr(router, "_packable", lambda dtype: dtype != BF16)
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(40, 96, generator=gen) * 0.05).to(BF16)
    routes = router.CpuLinearRouter(timing=False)
    assert routes.route_weights([(w, None)]) == 1
    monkeypatch.setattr(router, "F", types.SimpleNamespace(linear=_refuse_f_linear))  # router's only
    for rows in (17, 64):
        x = torch.randn(rows, 96, generator=gen).to(BF16)
        before = native_build.kernel_calls.linear
        with router.bind(routes):
            out = torch.ops.forwardkit.linear(x, w, None)
        assert native_build.kernel_calls.linear == before + 1 and routes.packed_count() == 0
        ref = torch.matmul(x.double(), w.double().t())
        torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=1e-3 * ref.abs().max().item())


def _refuse_f_linear(*args: object, **kwargs: object) -> torch.Tensor:
    raise AssertionError("the router called F.linear (the emulated bf16 matmul)")
