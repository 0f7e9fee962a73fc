"""The native linear over block-quantized weights (``csrc/quant_linear.c``), built at first use.

Serves ``forwardkit::quant_linear`` (``quantization/ops.py``) on the CPU for ``q8_0``, ``q4_0``
and ``q4_1`` weights, reading the packed GGUF blocks directly (34, 18 or 20 bytes per 32
weights instead of 64 in bf16). bf16 activations go in and results come out as they are (the
C code widens them exactly and rounds the results as torch does); float16 ones through
float32. Two kernels, chosen by the number of activation rows:

* **few rows** (1 row by default, any up to :data:`MAX_ROWS` when asked: decode steps of one
  sequence): each weight row streams once past groups of 4 activation rows (one row of int8
  activations: each thread splits its weight rows into 4 contiguous parts and takes one row
  of each at a time, 4 long sequential streams the hardware prefetchers follow: over 6 layers
  of the 1B shape q4_0 31.9 -> 35.0 GB/s with VNNI and q8_0 42-50 -> 54-56, against 4 adjacent
  rows with the next 4 prefetched and one q8_0 row at a time). Two strategies:
  ``int8`` (the default; activations quantized per block of 32 to int8, integer dot products,
  as llama.cpp does) and ``float`` (each weight block dequantized in registers:
  dequantize-then-matmul's products, summed in another order). ``int8`` measured faster on one
  core of an AVX-512 Xeon with a 2048 x 2048 weight: 0.18 / 0.54 / 2.2 ms at 1 / 4 / 16 rows
  (q8_0) against ``float``'s 0.56 / 0.61 / 2.7 (q4_0: 0.21 / 0.57 / 2.4 against 0.58 / 0.61 /
  2.6): one ``maddubs`` per 32 products instead of widening every weight to float32.
* **tiles** (from :data:`TILES_MIN_ROWS` = 2 rows: batched decode and prompts): the
  activations are quantized to int8 once per call; each tile is 8 weight rows (16 in 512-bit
  registers in the ``avx512_vnni`` build) against up to 64 activation rows. Per 32-weight block the 8 weight rows are unpacked to bytes and
  transposed in 4-byte groups (lane ``c`` of vector ``s`` holds bytes ``4s..4s+3`` of weight
  row ``c``), so one integer dot product (``vpdpbusd`` in the ``avx512_vnni`` build,
  ``maddubs`` + ``madd`` otherwise) takes 4 bytes of an activation row, broadcast, against
  all 8 weight rows, its 8 lanes being the 8 outputs, and one conversion and one FMA with the
  8 scales finish the row's block; the unpacked block serves all the rows of the pass, whose
  accumulators stay in L1. Weight tiles are split over the OpenMP threads. The int8
  activations are copied block-major first (each block's 32 bytes of every row adjacent): read
  row-major, the rows of one block lay K bytes apart, in one or two L1 sets, and each pass went
  to L2 (1B-shape products, 2 threads, the same bits: AVX2 q8_0 at 16 rows 5-15% faster, at 64
  rows 15-50%; ``avx512_vnni`` q8_0 at 16 rows 10-20%). This replaced
  register tiles of 4 x 4 pairs whose 8-lane dot products each needed their own conversion,
  scale product and FMA per block: with 2 threads on the 2-core EPYC a 64 x 8192 x 2048
  product went from 11.2 to 6.1 ms (q4_0, ``avx512_vnni``), 15.5 to 7.6 (q4_0, ``avx2``),
  10.8 to 5.6 (q8_0, ``avx512_vnni``) and 15.8 to 10.7 (q8_0, ``avx2``), and the tiles
  overtook the few-row kernel from 2 rows (q4_0 0.44 against 0.73 ms at 2 rows of an
  8192 x 2048 weight, 1.71 against 4.26 at 16; at 1 row 0.37 against 0.38, q8_0 0.43 against
  0.33), hence :data:`TILES_MIN_ROWS`. The tiles were chosen over dequantizing the weight and
  calling ``F.linear`` (the op's former path) by measurement (``benchmarks/quantized_prefill.py``
  and the README's quantization section), and need no float copy of the weight per call.

* **AMX tiles** (the ``amx`` build, from :data:`AMX_MIN_ROWS` = 24 rows: prompts and large
  batches, on CPUs with AMX-INT8 where Linux grants the tile state): the same products with the
  integer dot products on the tile unit. Each 16-row weight tile is unpacked once per call into
  the tile unit's 4-byte-group layout (the 512-bit tile's vectors, stored), the activations are
  packed as 16 rows x 32 bytes per block, and one ``tdpbssd`` (``tdpbsud`` for q4_1's unsigned
  nibbles; q4_0's nibbles less 8 are signed) computes a block's 16 x 16 x 32 products; the
  int32 results are stored and finished with the same conversion and FMA as the 512-bit tile,
  in the same order, so the outputs equal the ``avx512_vnni`` build's bit for bit. With 2
  threads on a 2-core AMX Xeon the 1B shape's qkv, gate_up and down products took 9.4-10.5 ms
  at 64 rows against 14.5 with the VNNI tiles (1.4-1.5x), 34-37 against 64 at 256 rows
  (1.7-1.9x), the same at 16 rows and more below, hence :data:`AMX_MIN_ROWS`. Each block's
  results pass through memory (the tile unit has no move to vector registers), which with the
  finishing arithmetic bounds the tiles near 50 cycles a block, far under the tile unit's peak.

Both kernels' results differ from dequantize-then-matmul by the activations' int8 rounding
(like llama.cpp's); ``q4_1``'s minimum adds ``m * d_x * sum(q_x)`` per block.

One portable C source compiled per ISA, like the native decode attention: ``amx`` (the
``avx512_vnni`` build with AMX-INT8), ``avx512_vnni``
(AVX-512F/BW/VL + VNNI + FMA + F16C), ``avx512`` (the same without VNNI), ``avx2`` (AVX2 + FMA
+ F16C) or ``generic`` (the compiler's baseline), through
:mod:`forwardkit.kernels.cpu.native_build` (the checked, checksummed ``native/`` directory of
the cache root). Each build is self-checked at first load against dequantize-then-``F.linear``
in float64 for every format, every few-row count, both strategies and tiled row counts (and
its dequantization, :func:`dequantize_rows`, against the torch one bit for bit); the first
build this CPU runs that passes serves, and when none does the op's reference path serves
every call. The kernel reads no switch: a quantized projection reaches it through the
``forwardkit::quant_linear`` op when its layer was built with the ``cpu_linear`` custom op on
(the switch of every native linear kernel); with ``"-cpu_linear"`` the layer computes
dequantize-then-``F.linear`` in plain torch (``config/custom_ops.py``). :data:`kernel_calls`'s
``quant`` counts the products it served.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from forwardkit.kernels.cpu import native_build
from forwardkit.logger import init_logger

__all__ = ["AMX_MIN_ROWS", "FORMATS", "MAX_ROWS", "STRATEGIES", "TILES_MIN_ROWS", "available", "candidate_builds", "dequantize_rows",
           "isa_supported", "kernel_isa", "max_rows", "quant_linear_q8_rows", "quant_linear_rows"]

logger = init_logger(__name__)

_ABI_VERSION = 4
# the `io` argument of the float entry points: x, y in bfloat16 (else float32)
_X_BF16, _Y_BF16 = 1, 2
MAX_ROWS = 16
FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}  # the kernel's format ids
_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # the GGUF block layouts (formats.py)
STRATEGIES = {"float": 0, "int8": 1}
# int8 measured faster at every row count 1-16 (module doc); "float" is exact to summation order
DEFAULT_STRATEGY = "int8"
# From this many rows the tiled kernel serves (int8): measured 1.5-2.5x the few-row kernel at
# 2-16 rows, not faster at 1 (module doc)
TILES_MIN_ROWS = 2
# From this many rows the amx build's tiles run on the tile unit (csrc/quant_linear.c
# FK_AMX_MIN_ROWS; measured as fast as the VNNI tiles at 16 rows, slower below: module doc)
AMX_MIN_ROWS = 24
_BLOCK = 32


_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c", "-mprefer-vector-width=512")
_AVX512_NEEDS = frozenset({"avx512f", "avx512bw", "avx512vl", "fma", "f16c"})
# Tried in this order; the first this CPU runs that builds and passes its self-check serves.
KERNEL = native_build.NativeKernel(
    name="quantized linear", source=Path(__file__).with_name("csrc") / "quant_linear.c",
    isas={"amx": native_build.Isa((*_AVX512, "-mavx512vnni", "-mamx-tile", "-mamx-int8"),
                                  _AVX512_NEEDS | {"avx512_vnni", "amx_tile", "amx_int8"}),
          "avx512_vnni": native_build.Isa((*_AVX512, "-mavx512vnni"), _AVX512_NEEDS | {"avx512_vnni"}),
          "avx512": native_build.Isa(_AVX512, _AVX512_NEEDS),
          "avx2": native_build.Isa(("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"})),
          "generic": native_build.Isa((), frozenset())},
    abi_symbol="fk_quant_abi_version", abi_version=_ABI_VERSION, logger=logger,
    fallback="dequantize + F.linear serve every call",
    # no contracted a * b + c: q4_1's d * q + m rounds twice, as ggml's dequantization does
    flags=("-ffp-contract=off",))


def isa_supported(isa: str) -> bool:
    """Whether this CPU has the instructions build ``isa`` (a key of ``KERNEL.isas``: "amx",
    "avx512_vnni", "avx512", "avx2", "generic") uses."""
    return KERNEL.isa_supported(isa)


def candidate_builds() -> list[str]:
    """The builds this CPU could run, best first (cheap: no compiling)."""
    return KERNEL.candidate_builds()


def compile_only(directory: Path, isa: str) -> Path:
    """Compile build ``isa`` into ``directory`` without loading it (a CPU without the ISA can
    still check that it compiles); returns the file."""
    return KERNEL.compile_only(directory, isa)


def _reference(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               fmt: str) -> torch.Tensor:
    from forwardkit.quantization.formats import dequantize

    return F.linear(x.double(), dequantize(packed, fmt).double(),
                    None if bias is None else bias.double())


class _Build(NamedTuple):
    """One loaded, self-checked build's entry points."""

    isa: str
    few_rows: Callable[..., int]  # fk_quant_linear: 1..MAX_ROWS rows, either strategy
    tiles: Callable[..., int]  # fk_quant_linear_tiles: any rows, int8 activations
    dequantize: Callable[..., int]  # fk_quant_dequantize
    few_rows_q8: Callable[..., int]  # fk_quant_linear_q8: the few-row int8 kernel, quantized x
    tiles_q8: Callable[..., int]  # fk_quant_linear_tiles_q8: the tiles, quantized x


def _self_check(build: _Build) -> None:
    """Every format against float64 dequantize-then-matmul, with a bias: the few-row kernel at
    every row count and both strategies, the tiles at row counts that leave short tiles; an
    output count that leaves a short weight tile."""
    from forwardkit.quantization.formats import quantize

    gen = torch.Generator().manual_seed(0)
    for fmt, fmt_id in FORMATS.items():
        w = torch.randn(13, 96, generator=gen)
        packed = quantize(w, fmt)
        b = torch.randn(13, generator=gen)
        for rows in [*range(1, MAX_ROWS + 1), 17, 22]:
            x = torch.randn(rows, 96, generator=gen)
            ref = _reference(x, packed, b, fmt)
            for strategy, mode in STRATEGIES.items():
                if rows > MAX_ROWS and strategy == "float":
                    continue
                y = torch.full((rows, 13), float("nan"))
                args = (x.data_ptr(), packed.data_ptr(), b.data_ptr(), y.data_ptr(), rows, 13, 96, fmt_id)
                rc = build.few_rows(*args, mode, 0) if rows <= MAX_ROWS else build.tiles(*args, 0)
                # int8 activations carry their own rounding: 2% of the largest output
                tol = 1e-4 if strategy == "float" else 0.02 * float(ref.abs().max())
                if rc != 0 or not torch.allclose(y.double(), ref, rtol=tol, atol=tol):
                    raise RuntimeError(f"{fmt} {strategy} self-check failed for {rows} rows (rc={rc})")


def _self_check_quantized_input(build: _Build) -> None:
    """Both kernels on activations quantized by :func:`quantize_activations` give the float
    entry points' results bit for bit (the torch rounding is the kernels' own)."""
    from forwardkit.quantization.formats import quantize, quantize_activations

    gen = torch.Generator().manual_seed(2)
    for fmt, fmt_id in FORMATS.items():
        packed = quantize(torch.randn(9, 128, generator=gen), fmt)
        b = torch.randn(9, generator=gen)
        for rows in (1, 3, 4, 7):
            x = torch.randn(rows, 128, generator=gen) * 3
            x[0, :32] = 0  # a block of zeros: scale 0
            q, d, sums = quantize_activations(x)
            want = torch.empty(rows, 9)
            got = torch.full((rows, 9), float("nan"))
            tail = (packed.data_ptr(), b.data_ptr())
            if rows < TILES_MIN_ROWS:
                rc = build.few_rows(x.data_ptr(), *tail, want.data_ptr(), rows, 9, 128, fmt_id, 1, 0)
                rc2 = build.few_rows_q8(q.data_ptr(), d.data_ptr(), sums.data_ptr(), *tail,
                                        got.data_ptr(), rows, 9, 128, fmt_id)
            else:
                rc = build.tiles(x.data_ptr(), *tail, want.data_ptr(), rows, 9, 128, fmt_id, 0)
                rc2 = build.tiles_q8(q.data_ptr(), d.data_ptr(), sums.data_ptr(), *tail,
                                     got.data_ptr(), rows, 9, 128, fmt_id)
            if rc != 0 or rc2 != 0 or not torch.equal(got, want):
                raise RuntimeError(f"{fmt} quantized-input self-check failed for {rows} rows")


def _self_check_dequantize(deq: Callable[..., int]) -> None:
    """Every format's dequantization equals the torch one bit for bit."""
    from forwardkit.quantization.formats import dequantize, quantize

    w = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    for fmt, fmt_id in FORMATS.items():
        packed = quantize(w, fmt)
        out = torch.empty(7, 96)
        if deq(packed.data_ptr(), out.data_ptr(), 7, 96, fmt_id) != 0 or not torch.equal(
                out, dequantize(packed, fmt)):
            raise RuntimeError(f"{fmt} dequantize self-check failed")


def _bind(fn: Callable[..., int], argtypes: list[type]) -> Callable[..., int]:
    """A C entry point returning int, with its argument types set."""
    fn.restype = ctypes.c_int  # type: ignore[attr-defined]
    fn.argtypes = argtypes  # type: ignore[attr-defined]
    return fn


@KERNEL.cached
def _function(isa: str) -> _Build | None:
    """Build ``isa`` loaded and self-checked; None when unsupported or failing."""
    lib = KERNEL.library(isa)
    if lib is None:
        return None
    lib.fk_quant_max_rows.restype = ctypes.c_int
    if lib.fk_quant_max_rows() != MAX_ROWS:
        logger.warning_once("Native %s quantized linear off (row limit differs)", isa)
        return None
    ptr, size, flag = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    few = _bind(lib.fk_quant_linear, [ptr] * 4 + [size] * 3 + [flag] * 3)
    tiles = _bind(lib.fk_quant_linear_tiles, [ptr] * 4 + [size] * 3 + [flag] * 2)
    deq = _bind(lib.fk_quant_dequantize, [ptr] * 2 + [size] * 2 + [flag])
    few_q8 = _bind(lib.fk_quant_linear_q8, [ptr] * 6 + [size] * 3 + [flag])
    tiles_q8 = _bind(lib.fk_quant_linear_tiles_q8, [ptr] * 6 + [size] * 3 + [flag])
    lib.fk_quant_amx.restype = ctypes.c_int
    amx_rows = lib.fk_quant_amx()
    if isa == "amx" and amx_rows != AMX_MIN_ROWS:
        # 0: the CPU has AMX but Linux did not grant this process the tile state
        logger.warning_once("Native amx quantized linear off (%s)",
                            "the OS refused the AMX tile state" if amx_rows == 0
                            else "AMX row threshold differs")
        return None
    build = _Build(isa, few, tiles, deq, few_q8, tiles_q8)
    try:
        _self_check(build)
        _self_check_quantized_input(build)
        _self_check_dequantize(deq)
    except RuntimeError as exc:
        logger.warning_once("Native %s quantized linear off (%s)", isa, exc)
        return None
    return build


def _packed_ok(packed: torch.Tensor, fmt: str, k: int) -> bool:
    return (packed.dtype == torch.uint8 and packed.dim() == 2 and packed.is_contiguous()
            and k % _BLOCK == 0 and k > 0 and packed.shape[1] == k // _BLOCK * _BLOCK_BYTES[fmt])


def dequantize_rows(packed: torch.Tensor, fmt: str) -> torch.Tensor | None:
    """The float32 weight ``packed`` holds (bit for bit the torch dequantization), by the native
    build; None when it does not apply (another format, no usable build)."""
    fmt_id = FORMATS.get(fmt)
    found = _selected()
    if fmt_id is None or found is None or packed.dtype != torch.uint8 or packed.dim() != 2:
        return None
    k = packed.shape[1] // _BLOCK_BYTES[fmt] * _BLOCK
    if not _packed_ok(packed, fmt, k):
        return None
    n = packed.shape[0]
    out = torch.empty((n, k), dtype=torch.float32)
    if found.dequantize(packed.data_ptr(), out.data_ptr(), n, k, fmt_id) != 0:
        return None
    return out


@KERNEL.cached
def _selected() -> _Build | None:
    """The first build in ``KERNEL.isas`` that this CPU runs and that passes its self-check."""
    found = KERNEL.first(_function)
    return None if found is None else found[1]


def kernel_isa() -> str | None:
    """Which build serves here (a key of ``KERNEL.isas``), or None."""
    found = _selected()
    return None if found is None else found.isa


def available() -> bool:
    """Whether a native quantized linear build is usable here."""
    return _selected() is not None


def max_rows() -> int:
    """Most activation rows the few-row kernel serves (0 when no build is usable); more rows
    take the tiled kernel (:func:`quant_linear_rows`)."""
    return MAX_ROWS if available() else 0


def cache_clear() -> None:
    """Forget the loaded kernels (the next call loads or rebuilds them: tests that change
    ``FORWARDKIT_CACHE_ROOT`` or ``CC``)."""
    KERNEL.cache_clear()


def quant_linear_rows(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                      isa: str | None = None, strategy: str | None = None,
                      path: str | None = None) -> torch.Tensor | None:
    """``x @ W.T + bias`` for the ``fmt`` weight ``packed`` holds, by the native kernel; None when
    it does not apply (another format or device, a shape that does not match, no usable build):
    the caller then takes the reference path. Fewer than :data:`TILES_MIN_ROWS` rows take the
    few-row kernel, more the tiled one (both with int8 activations); with the ``float``
    strategy, up to :data:`MAX_ROWS` rows take the few-row kernel and more decline (the tiles
    have no float strategy: the caller's dequantize-then-matmul gives those products).
    ``isa`` forces one build, ``strategy`` ("float", "int8") one few-row strategy (None:
    :data:`DEFAULT_STRATEGY`) and ``path`` ("few", "tiles") one kernel whatever the row count
    (tests and benchmarks; "few" declines more than :data:`MAX_ROWS` rows)."""
    fmt_id = FORMATS.get(fmt)
    if fmt_id is None or x.device.type != "cpu" or not x.is_floating_point():
        return None
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    n = packed.shape[0] if packed.dim() == 2 else 0
    if rows < 1 or n < 1 or not _packed_ok(packed, fmt, k):
        return None
    strategy = strategy or DEFAULT_STRATEGY
    if path is None:
        if strategy == "float":  # dequantize-then-matmul's products: the few-row kernel only
            path = "few"
        else:
            path = "few" if rows < TILES_MIN_ROWS else "tiles"
    if path == "few" and rows > MAX_ROWS:
        return None
    build = _selected() if isa is None else _function(isa)
    if build is None:
        return None
    # bf16 goes in and comes out as it is (the kernel widens and rounds: the same values as
    # converting here, without two more tensors a call); other dtypes through float32
    bf16 = x.dtype == torch.bfloat16
    flat = x.dim() == 2  # [rows, k] already (a step's tokens): no reshape either way
    xin = x if flat else x.reshape(rows, k)
    xin = xin.contiguous() if bf16 else xin.to(torch.float32).contiguous()
    b32 = None if bias is None else bias.to(torch.float32).contiguous()
    out = torch.empty((rows, n), dtype=torch.bfloat16 if bf16 else torch.float32)
    args = (xin.data_ptr(), packed.data_ptr(), None if b32 is None else b32.data_ptr(),
            out.data_ptr(), rows, n, k, fmt_id)
    io = _X_BF16 | _Y_BF16 if bf16 else 0
    if path == "few":
        rc = build.few_rows(*args, STRATEGIES[strategy], io)
    elif path == "tiles":
        rc = build.tiles(*args, io)
    else:
        raise ValueError(f"path must be 'few', 'tiles' or None, got {path!r}")
    if rc != 0:
        return None
    native_build.kernel_calls.quant += 1  # the kernel, not the reference path, served it
    if not flat:
        out = out.reshape(*x.shape[:-1], n)
    return out if bf16 or x.dtype == torch.float32 else out.to(x.dtype)


def quant_linear_q8_rows(q: torch.Tensor, d: torch.Tensor, sums: torch.Tensor, packed: torch.Tensor,
                         bias: torch.Tensor | None, fmt: str,
                         dtype: torch.dtype) -> torch.Tensor | None:
    """:func:`quant_linear_rows` on activations already quantized by
    :func:`~forwardkit.quantization.formats.quantize_activations` (``q`` int8 ``[..., k]``,
    ``d`` and ``sums`` float32 ``[..., k / 32]``), the result in ``dtype``: the same kernels
    and the same values as the float call on the activations ``q`` came from. None when it
    does not apply (the caller then dequantizes ``q``)."""
    fmt_id = FORMATS.get(fmt)
    if fmt_id is None or q.device.type != "cpu" or q.dtype != torch.int8:
        return None
    k, prefix = q.shape[-1], q.shape[:-1]
    rows = q.numel() // k if k else 0
    n = packed.shape[0] if packed.dim() == 2 else 0
    if rows < 1 or n < 1 or not _packed_ok(packed, fmt, k):
        return None
    build = _selected()
    if build is None:
        return None
    q = q.reshape(rows, k).contiguous()
    d = d.reshape(rows, k // _BLOCK).to(torch.float32).contiguous()
    sums = sums.reshape(rows, k // _BLOCK).to(torch.float32).contiguous()
    b32 = None if bias is None else bias.to(torch.float32).contiguous()
    out = torch.empty((rows, n), dtype=torch.float32)
    args = (q.data_ptr(), d.data_ptr(), sums.data_ptr(), packed.data_ptr(),
            None if b32 is None else b32.data_ptr(), out.data_ptr(), rows, n, k, fmt_id)
    rc = build.few_rows_q8(*args) if rows < TILES_MIN_ROWS else build.tiles_q8(*args)
    if rc != 0:
        return None
    native_build.kernel_calls.quant += 1
    return out.reshape(*prefix, n).to(dtype)
