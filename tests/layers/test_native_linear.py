"""The native few-row bf16 linear and huge-page backing of CPU weights."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from forwardkit.layers import cpu_gemm, hugepages, native_linear

BF16 = torch.bfloat16
# Each case is gated on the kernel it runs (native_linear.cpu_supports): the float32 kernel
# needs AVX-512F/BW/VL, the bf16 one AVX-512-BF16 too.
needs_bf16_kernel = pytest.mark.skipif(
    not native_linear.cpu_supports(BF16),
    reason="the CPU has no AVX-512-BF16 (the native bf16 kernel's instructions)")
needs_f32_kernel = pytest.mark.skipif(
    not native_linear.cpu_supports(torch.float32),
    reason="the CPU has no AVX-512F/BW/VL (the native float32 kernel's instructions)")
KERNEL_DTYPES = [pytest.param(BF16, marks=needs_bf16_kernel, id="bf16"),
                 pytest.param(torch.float32, marks=needs_f32_kernel, id="fp32")]


@pytest.fixture(autouse=True)
def _fast_paths(monkeypatch):
    """These tests exercise the fast paths themselves: no timing may route a small weight to
    plain F.linear."""
    monkeypatch.setenv("FORWARDKIT_CPU_LINEAR_TUNE", "0")


@pytest.fixture
def fresh_kernel(monkeypatch):
    """The kernel loader re-run under this test's environment, and again after it."""
    native_linear.cache_clear()
    yield monkeypatch
    native_linear.cache_clear()


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(8, 32), (13, 70), (3072, 2048), (257, 1000)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_matches_a_float64_linear(rows, n, k, with_bias, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    out = native_linear.linear_rows(x, w, b)
    assert out is not None and out.dtype == dtype and out.shape == (rows, n)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    if dtype == BF16:  # fp32 accumulation, one rounding to bf16: bf16's half-ulp of the result
        torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=1e-3 * ref.abs().max().item())
    else:  # fp32 accumulation in another order than MKL: a few fp32 ulps of the sum's size
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(out, native_linear.linear_rows(x, w, b))  # deterministic


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_leading_dims_and_non_contiguous_input(dtype):
    x = torch.randn(1, 64, 2).to(dtype)[..., 0]  # [1, 64], not contiguous
    w = torch.randn(24, 64).to(dtype)
    out = native_linear.linear_rows(x, w, None)
    assert out is not None and out.shape == (1, 24)
    torch.testing.assert_close(out.float(), _reference(x, w, None), rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_declines_what_it_does_not_cover(dtype):
    other = torch.float32 if dtype == BF16 else BF16
    w = torch.randn(16, 64).to(dtype)
    x1 = torch.randn(1, 64).to(dtype)
    assert native_linear.linear_rows(x1, w, None) is not None  # the kernel is there and applies
    assert native_linear.linear_rows(torch.randn(native_linear.MAX_ROWS + 1, 64).to(dtype), w, None) is None
    assert native_linear.linear_rows(x1.half(), w.half(), None) is None
    assert native_linear.linear_rows(x1.to(other), w, None) is None  # mixed dtypes
    assert native_linear.linear_rows(x1, w.t().contiguous().t(), None) is None  # strided weight
    assert native_linear.linear_rows(x1, w, torch.zeros(16, dtype=other)) is None  # bias dtype
    assert native_linear.linear_rows(torch.randn(0, 64).to(dtype), w, None) is None


@needs_bf16_kernel
def test_packed_layers_use_it_for_few_rows_only(monkeypatch):
    w = torch.randn(40, 96).to(BF16)
    cpu_gemm.pack_weight(w)
    try:
        calls = []
        real = native_linear.linear_rows

        def spy(x, weight, bias):
            out = real(x, weight, bias)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(native_linear, "linear_rows", spy)
        for rows in (1, 2, 7):
            x = torch.randn(rows, 96).to(BF16)
            torch.testing.assert_close(cpu_gemm.linear(x, w).float(), _reference(x, w, None),
                                       rtol=2e-2, atol=2e-2)
        assert calls == [True, True, False]  # 7 rows go to oneDNN's packed matmul
        calls.clear()
        cpu_gemm.linear(torch.randn(1, 40).to(BF16), torch.randn(8, 40).to(BF16))  # not packed
        assert calls == []
    finally:
        cpu_gemm.unpack_weight(w)


def test_switched_off_by_environment(fresh_kernel):
    fresh_kernel.setenv("FORWARDKIT_CPU_NATIVE_LINEAR", "0")
    assert not native_linear.available()
    x, w = torch.randn(1, 32).to(BF16), torch.randn(8, 32).to(BF16)
    assert native_linear.linear_rows(x, w, None) is None


def test_missing_compiler_disables_with_a_reason(fresh_kernel, tmp_path):
    """Runs on any CPU: without a compiler (or without AVX-512) the kernel is off and a
    registered weight's 1-2-row products still equal F.linear (the packed oneDNN path serves
    them), so a machine without a compiler works."""
    fresh_kernel.setenv("FORWARDKIT_CACHE_ROOT", str(tmp_path))  # nothing built there yet
    fresh_kernel.setenv("CC", "no-such-compiler-xyz")
    with pytest.raises(RuntimeError, match="no C compiler 'no-such-compiler-xyz'"):
        native_linear._build(tmp_path / "native")
    for dtype in (BF16, torch.float32):
        assert not native_linear.available(dtype)  # the engine falls back instead of failing
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(24, 70, generator=gen)
    b = torch.randn(24, generator=gen)
    cpu_gemm.pack_weight(w)
    try:
        for rows in (1, 2):
            x = torch.randn(rows, 70, generator=gen)
            assert native_linear.linear_rows(x, w, b) is None
            # fp32 oneDNN vs MKL: the same products summed in another order
            torch.testing.assert_close(cpu_gemm.linear(x, w, b), F.linear(x, w, b),
                                       rtol=1e-5, atol=1e-5)
    finally:
        cpu_gemm.unpack_weight(w)
    assert not list((tmp_path / "native").glob("*.so"))  # nothing was built


@needs_f32_kernel
def test_build_is_cached_by_source(fresh_kernel, tmp_path):
    fresh_kernel.setenv("FORWARDKIT_CACHE_ROOT", str(tmp_path))
    assert native_linear.available(torch.float32)
    built = sorted((tmp_path / "native").glob("linear_few_rows-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native_linear.cache_clear()
    assert native_linear.available(torch.float32)
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert sorted((tmp_path / "native").iterdir()) == built  # no temporary files left


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
