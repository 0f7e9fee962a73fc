"""The native few-row linear (``csrc/linear_few_rows*.c``), built at first use, and the AVX2
build's bf16 kernel for any number of rows.

Decode steps multiply one or two activation rows by each weight; that product streams the
weight from memory and does little arithmetic. oneDNN's bf16 matmul reaches about 15 GB/s a
core on such products here (packed or not); the native kernel reads the plain row-major weight
in blocks of rows with VDPBF16PS and reaches 20-28 GB/s a core with the weight on huge pages
(AVX2 build on a 2-core EPYC without AVX-512: 1.3-2.7x ``F.linear`` in bf16, see the README).
One row (one sequence) reads 4 rows far apart at a time, one from each of 4 contiguous parts of
a thread's rows, so each is a long sequential stream (2-core EPYC, bf16: 40 -> 58 GB/s with
AVX-512, 30-31 -> 35-36 with AVX2, against blocks of adjacent rows).
For float32 it saves MKL's per-call overhead on the small matrices of small models. For more
rows oneDNN's packed matmul is faster (it is compute-bound there) and stays in use, except on a
CPU without native bf16 arithmetic: there oneDNN widens the whole bf16 weight on every call, so
the AVX2 build also serves bf16 products of 3-16 rows (batched decode, short prompts): 3-5 rows
run in groups through each block of weight rows (2.5-3.9x ``F.linear`` on the 2-core EPYC), 6-16
rows take a kernel that broadcasts each bf16 weight (one 4-byte load and an AND widen it
exactly) against 8 or 16 activation rows held as float32 vectors, 12 accumulators in registers
across all of k and no packing (16 rows: 1.2-1.4x the blocked kernel below, with its bits; see
the source); :func:`max_rows` says how many rows a build takes.
Products of more rows on such a CPU (prompts) take the AVX2 build's blocked kernel
(:func:`linear_bf16_rows`, ``fk_linear_bf16_rows``): a packed outer-product GEMM whose threads
each own 16-column panels of the output; a panel's 16 weight rows are widened to float32 into a
``[k][16]`` buffer once per slice of 1024 k-values and pass of up to 96 activation rows, and a
6 x 16 register tile runs 12 float32 FMAs per k for 8 loads (no float32 copy of the whole
weight; each output rounded to bf16 once). Measured at 64 rows on the 2-core EPYC, 2 threads,
medians of 7 calls: 2048 x 2048 and 8192 x 2048 weights at 184-193 GFLOPS, about 80 % of the
FMA peak measured there (about 230) and twice the 4 x 2 dot-product tiles it replaced (96-103);
16 rows 147 GFLOPS against 97-102. Against what a user would write on such a CPU (the AVX2
stand-in, ``ONEDNN_MAX_CPU_ISA=AVX2``, medians of 7 interleaved calls): at 64 rows 3.9-4.1x
PyTorch's bf16 ``F.linear`` (emulated) and 1.3-1.7x float32 ``F.linear`` on a float32 copy of
the weight; at 16 rows of 8192 x 2048, 3.2x and 2.6x. The router calls it only where oneDNN has
no bf16 (with native bf16, oneDNN's matmul is faster still).

There are two builds, chosen per dtype by the CPU's flags: ``csrc/linear_few_rows.c`` for
AVX-512 (bf16 with VDPBF16PS, needs AVX-512-BF16; float32 needs AVX-512F/BW/VL) and
``csrc/linear_few_rows_avx2.c`` for AVX2 + FMA (bf16 widened to float32 in registers; both
dtypes), so a CPU without AVX-512 (or without its bf16 part) streams decode weights too. Each is
compiled with the system C compiler (``$CC``, else ``cc``) into ``<cache root>/native/``
(:func:`forwardkit.compilation.cache.native_kernel_dir`: ``$FORWARDKIT_CACHE_ROOT/native``)
under a name derived from the source, compiler and flags, checked against ``F.linear`` once, and
loaded with ``ctypes``.

A shared library is code, so that directory follows the compile cache's rules: it is created
owner-only and, before anything is loaded from it, checked to be owned by this user and not
group/other-writable; an unsafe one switches the kernel off for the process with one warning.
Every build's SHA-256 and size go into the directory's manifest
(:mod:`forwardkit.compilation.kernel_cache`), and an existing ``.so`` is loaded only when it
matches its entry; one that does not, or that the manifest does not list, is removed and rebuilt
(logged once, counted in ``num_cache_errors``), so a truncated library is never ``dlopen``-ed.
Checking, building, recording and loading happen under the manifest's exclusive ``fcntl`` lock,
so two processes building at once compile once. A verified build is loaded without a compiler.
These steps are :mod:`forwardkit.kernels.cpu.native_build`'s, shared with the native decode
attention (:mod:`forwardkit.kernels.cpu.native_attention`).

Anything that fails (no compiler and no verified build, missing instructions, a wrong result)
disables that build with one log line (the next one down is tried); ``F.linear``/oneDNN then
serve every call. The kernel reads no switch: whether a layer's products reach it is the
``cpu_linear`` custom op (``compilation_config.custom_ops``; ``"-cpu_linear"`` gives plain
``F.linear``), decided when the layer is built (``config/custom_ops.py``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from forwardkit.kernels.cpu import native_build
from forwardkit.logger import init_logger
from forwardkit.platforms import cpu_capabilities

__all__ = ["MAX_ROWS", "available", "max_rows", "cpu_flags", "cpu_has_avx512_bf16", "cpu_model_name",
           "bf16_rows_available", "candidate_builds", "isa_supported", "kernel_isa", "linear_bf16_rows",
           "linear_rows"]

logger = init_logger(__name__)

MAX_ROWS = 2  # rows up to which the kernel beats oneDNN's packed matmul (measured, 2-core EPYC)
_ABI_VERSION = 2

_CSRC = Path(__file__).with_name("csrc")
_AVX2_NEEDS = frozenset({"avx2", "fma"})
# Tried in this order for each dtype; the first whose CPU flags are present and that builds,
# loads and passes its self-check serves that dtype. A build loads where its float32 kernel
# runs; its bf16 kernel may need more (``_BF16_NEEDS``).
KERNEL = native_build.NativeKernel(
    name="linear", source=_CSRC / "linear_few_rows.c",
    isas={"avx512": native_build.Isa(("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
                                     frozenset({"avx512f", "avx512bw", "avx512vl"}),
                                     _CSRC / "linear_few_rows.c"),
          "avx2": native_build.Isa(("-mavx2", "-mfma"), _AVX2_NEEDS,
                                   _CSRC / "linear_few_rows_avx2.c")},
    abi_symbol="fk_abi_version", abi_version=_ABI_VERSION, logger=logger,
    fallback="oneDNN/MKL serve small products",
    cpu_flags=lambda: cpu_flags())  # late-bound: tests replace this module's cpu_flags
_BF16_NEEDS: dict[str, frozenset[str]] = {"avx512": frozenset({"avx512_bf16"})}
_DTYPES = (torch.bfloat16, torch.float32)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``platforms.cpu_capabilities``: Linux ``/proc/cpuinfo``;
    empty elsewhere)."""
    return cpu_capabilities().flags


def cpu_model_name() -> str:
    """The CPU's model name ("" where ``/proc/cpuinfo`` is absent)."""
    return cpu_capabilities().model_name


def cpu_has_avx512_bf16() -> bool:
    """Whether the CPU reports AVX-512-BF16."""
    return "avx512_bf16" in cpu_flags()


def isa_supported(isa: str, dtype: torch.dtype) -> bool:
    """Whether this CPU has the instructions build ``isa`` ("avx512", "avx2") uses for ``dtype``."""
    if not KERNEL.isa_supported(isa):
        return False
    return dtype != torch.bfloat16 or _BF16_NEEDS.get(isa, frozenset()) <= cpu_flags()


def candidate_builds() -> list[str]:
    """``"isa:dtype"`` for every build this CPU could run (cheap: no compiling); part of the
    machine key under which timed linear-path choices are saved."""
    return [f"{isa}:{str(dtype).removeprefix('torch.')}" for isa in KERNEL.isas
            for dtype in _DTYPES if isa_supported(isa, dtype)]




def _self_check(fn: Callable[..., int], dtype: torch.dtype, max_rows: int = MAX_ROWS) -> None:
    """Small products (with a K tail and a bias) against ``F.linear`` in float64, for every
    row count the build serves."""
    gen = torch.Generator().manual_seed(0)
    for rows in range(1, max_rows + 1):
        x = torch.randn(rows, 70, generator=gen).to(dtype)
        w = torch.randn(13, 70, generator=gen).to(dtype)
        b = torch.randn(13, generator=gen).to(dtype)
        y = torch.empty(rows, 13, dtype=dtype)
        rc = fn(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), rows, 13, 70)
        ref = F.linear(x.double(), w.double(), b.double())
        if rc != 0 or not torch.allclose(y.double(), ref, rtol=2e-2, atol=2e-2):
            raise RuntimeError(f"{dtype} self-check failed for {rows} rows (rc={rc})")


@KERNEL.cached
def _function(isa: str, dtype: torch.dtype) -> Callable[..., int] | None:
    """Build ``isa``'s kernel for ``dtype``, self-checked; None when this CPU lacks its
    instructions or it does not build, load or pass the check."""
    if dtype not in _DTYPES or not isa_supported(isa, dtype):
        return None
    lib = KERNEL.library(isa)
    if lib is None:
        return None
    fn = lib.fk_linear_bf16 if dtype == torch.bfloat16 else lib.fk_linear_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    try:
        _self_check(fn, dtype, _row_limit(isa, dtype))
    except RuntimeError as exc:
        logger.warning_once("Native %s %s linear off (%s)", isa, dtype, exc)
        return None
    return fn


@KERNEL.cached
def _row_limit(isa: str, dtype: torch.dtype) -> int:
    """Most activation rows build ``isa`` serves for ``dtype``: :data:`MAX_ROWS`, except the
    AVX2 build in bf16, which reports its own limit (``fk_max_rows_bf16``): without native bf16
    arithmetic oneDNN widens the whole weight on every call, so streaming it wins for batched
    decode too."""
    lib = KERNEL.library(isa)
    if dtype != torch.bfloat16 or lib is None or not hasattr(lib, "fk_max_rows_bf16"):
        return MAX_ROWS
    lib.fk_max_rows_bf16.restype = ctypes.c_int
    return max(MAX_ROWS, int(lib.fk_max_rows_bf16()))


def max_rows(dtype: torch.dtype = torch.bfloat16) -> int:
    """Most activation rows the native kernel serving ``dtype`` takes (0 when none serves)."""
    found = _selected(dtype)
    return 0 if found is None else found[2]


@KERNEL.cached
def _selected(dtype: torch.dtype) -> tuple[str, Callable[..., int], int] | None:
    """(build, function, most rows it serves) for ``dtype``: the first build in
    ``KERNEL.isas`` that this CPU can run and that passes its self-check; None when none does.
    One cached lookup gives :func:`linear_rows` all three (it runs once per projection per
    step)."""
    found = KERNEL.first(lambda isa: _function(isa, dtype))
    if found is not None:
        return found[0], found[1], _row_limit(found[0], dtype)
    if (dtype in _DTYPES
            and not any(isa_supported(i, dtype) for i in KERNEL.isas)):
        logger.info_once("Native %s linear off: the CPU has neither AVX-512 nor AVX2+FMA", dtype)
    return None


def _kernel(dtype: torch.dtype) -> Callable[..., int] | None:
    found = _selected(dtype)
    return None if found is None else found[1]


def kernel_isa(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Which build serves ``dtype`` here ("avx512", "avx2"), or None when none does."""
    found = _selected(dtype)
    return None if found is None else found[0]


def cache_clear() -> None:
    """Forget the loaded kernels (the next call loads or rebuilds them: tests that change
    ``FORWARDKIT_CACHE_ROOT`` or ``CC``)."""
    KERNEL.cache_clear()


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the native kernel for ``dtype`` is built and usable on this machine."""
    return _kernel(dtype) is not None


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                isa: str | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` by the native kernel, or None when it does not apply
    (not bf16/float32 on the CPU, more rows than the build serves (:func:`max_rows`),
    non-contiguous operands,
    kernel unavailable): the caller then takes another path. ``isa`` forces one build
    ("avx512", "avx2"; tests compare them), else the one :func:`kernel_isa` names serves."""
    dtype = x.dtype
    if (dtype is not torch.bfloat16 and dtype is not torch.float32) or weight.dtype != dtype or x.device.type != "cpu":
        return None
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows < 1 or not weight.is_contiguous() or weight.shape[1] != k:
        return None
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    if isa is None:
        found = _selected(dtype)
        if found is None:
            return None
        _, fn, limit = found
    else:
        forced = _function(isa, dtype)
        if forced is None:
            return None
        fn, limit = forced, _row_limit(isa, dtype)
    if rows > limit:
        return None
    x = x.contiguous()
    n = weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=dtype)
    fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
       rows, n, k)
    native_build.kernel_calls.linear += 1
    return out


# The build whose bf16 kernel takes any number of rows (``fk_linear_bf16_rows``): AVX2's, for
# CPUs without native bf16 arithmetic (an AVX-512-BF16 or AMX CPU has oneDNN's bf16 matmul).
_BF16_ROWS_ISA = "avx2"


def _self_check_bf16_rows(fn: Callable[..., int]) -> None:
    """Row counts past the few-row kernel's (short groups of 6 rows, a full 16-row weight panel
    packed by the vector transpose and a short one, a K tail, a bias) against ``F.linear`` in
    float64."""
    gen = torch.Generator().manual_seed(1)
    for rows in (17, 22):
        x = torch.randn(rows, 70, generator=gen).to(torch.bfloat16)
        w = torch.randn(19, 70, generator=gen).to(torch.bfloat16)
        b = torch.randn(19, generator=gen).to(torch.bfloat16)
        y = torch.empty(rows, 19, dtype=torch.bfloat16)
        rc = fn(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), rows, 19, 70)
        ref = F.linear(x.double(), w.double(), b.double())
        if rc != 0 or not torch.allclose(y.double(), ref, rtol=2e-2, atol=2e-2):
            raise RuntimeError(f"bf16 rows self-check failed for {rows} rows (rc={rc})")


@KERNEL.cached
def _bf16_rows() -> Callable[..., int] | None:
    """The AVX2 build's any-rows bf16 kernel, self-checked; None where it does not serve."""
    if _function(_BF16_ROWS_ISA, torch.bfloat16) is None:
        return None
    lib = KERNEL.library(_BF16_ROWS_ISA)
    if lib is None:
        return None
    fn = lib.fk_linear_bf16_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    try:
        _self_check_bf16_rows(fn)
    except RuntimeError as exc:
        logger.warning_once("Native %s bf16 prompt linear off (%s)", _BF16_ROWS_ISA, exc)
        return None
    return fn


def bf16_rows_available() -> bool:
    """Whether the blocked bf16 kernel for any number of rows (AVX2 build) is usable here."""
    return _bf16_rows() is not None


def linear_bf16_rows(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` in bf16 for any number of rows by the AVX2 build's blocked
    kernel (activations widened once, weights widened in registers, float32 accumulation, one
    rounding to bf16), or None when it does not apply (not bf16 on the CPU, non-contiguous
    weight, no usable build): the caller then takes another path. The router calls it for
    products too long for :func:`linear_rows` on CPUs without native bf16 arithmetic."""
    if (x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.device.type != "cpu"
            or weight.device.type != "cpu"):
        return None
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows < 1 or weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] != k:
        return None
    if bias is not None and (bias.dtype is not torch.bfloat16 or not bias.is_contiguous()):
        return None
    fn = _bf16_rows()
    if fn is None:
        return None
    x = x.contiguous()
    n = weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16)
    if fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
          rows, n, k) != 0:
        return None
    native_build.kernel_calls.linear += 1
    return out
