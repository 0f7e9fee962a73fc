"""The native paged decode attention (``csrc/decode_attention.c``), built at first use.

A decode step's attention in PyTorch is a dozen small ops per layer (``index_put_`` of the
step's K/V, then per length bucket ``index_select`` of the query rows and of the paged K and V,
transposes, an additive mask, SDPA, ``index_copy_``); on the CPU their fixed costs dominate a
decode step of a small model. :func:`paged_decode` does the same work in one call per layer:
it stores the step's keys and values at their slots, then attends every decode request over its
own blocks with a streaming (online) softmax, the query heads that share a KV head reading each
K/V row once, and writes each request's output row. Prompts (multi-token requests) stay with
PyTorch's SDPA.

One portable C source, compiled per ISA with the flags of :data:`KERNEL`'s builds (AVX-512, AVX2 + FMA,
or the compiler's baseline): the first whose CPU flags are present and that builds, loads and
passes its self-check serves both dtypes (bf16 and float32; query, cache and output of one
dtype, float32 arithmetic, bf16 outputs rounded to nearest even). Building, naming, the
manifest check and loading are :mod:`forwardkit.kernels.cpu.native_build`'s, the same as for
the native linear: the library lives in the checked owner-only ``<cache root>/native/``, its
name hashes the source and the header it includes, a ``.so`` is ``dlopen``-ed only when it
matches its SHA-256 manifest entry (under the manifest's ``fcntl`` lock), and a verified build
loads without a compiler. Anything that fails (no compiler and no verified build, an unsafe
directory, a wrong self-check) switches the kernel off with one log line, and the PyTorch path
serves every call. The kernel reads no switch: which layers use it is the ``cpu_attention``
custom op (``"-cpu_attention"`` turns it off; ``layers/attention.py``), decided when the layer is
built.
"""

from __future__ import annotations

import array
import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from forwardkit.kernels.cpu import native_build
from forwardkit.logger import init_logger

__all__ = ["DecodeIndex", "available", "cache_clear", "candidate_builds", "decode_index",
           "isa_supported", "kernel_isa", "paged_decode", "reference_decode"]

logger = init_logger(__name__)

_ABI_VERSION = 2
# int64 arguments per call (the layer's tensors) and per step (the decode requests' indices):
# the FK_L_* / FK_S_* layouts of decode_attention.c, in this order
_LAYER_ARGS = 16
_STEP_ARGS = 7
_DTYPES = (torch.bfloat16, torch.float32)


# Tried in this order; the first this CPU can run that builds and passes its self-check serves.
KERNEL = native_build.NativeKernel(
    name="decode attention", source=Path(__file__).with_name("csrc") / "decode_attention.c",
    isas={"avx512": native_build.Isa(("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma",
                                      "-mprefer-vector-width=512"),
                                     frozenset({"avx512f", "avx512bw", "avx512vl", "fma"})),
          "avx2": native_build.Isa(("-mavx2", "-mfma"), frozenset({"avx2", "fma"})),
          "generic": native_build.Isa((), frozenset())},
    abi_symbol="fk_attention_abi_version", abi_version=_ABI_VERSION, logger=logger,
    fallback="PyTorch attention serves decode steps")


def isa_supported(isa: str) -> bool:
    """Whether this CPU has the instructions build ``isa`` ("avx512", "avx2", "generic") uses."""
    return KERNEL.isa_supported(isa)


def candidate_builds() -> list[str]:
    """The builds this CPU could run, best first (cheap: no compiling)."""
    return KERNEL.candidate_builds()


@KERNEL.cached
def _checked_library(isa: str) -> ctypes.CDLL | None:
    """Build ``isa`` loaded with its argument layout checked, or None (instructions missing,
    build error, another layout)."""
    lib = KERNEL.library(isa)
    if lib is None:
        return None
    for fn in (lib.fk_attention_layer_args, lib.fk_attention_step_args):
        fn.restype = ctypes.c_int
    if (lib.fk_attention_layer_args(), lib.fk_attention_step_args()) != (_LAYER_ARGS, _STEP_ARGS):
        logger.warning_once("Native %s decode attention off (argument layout differs)", isa)
        return None
    for fn in (lib.fk_decode_attention_bf16, lib.fk_decode_attention_f32):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float]
    return lib


def reference_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The decode attention :func:`paged_decode` computes, in float64 and plain torch (one
    request at a time): ``[n, Hq, D]`` for the requests at ``rows``. For self-checks and tests."""
    hq, hk = query.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    outs = []
    for i, row in enumerate(rows.tolist()):
        length = int(seq_lens[i])
        blocks = block_table[i, : -(-length // block_size)]
        k = k_cache[blocks].reshape(-1, hk, k_cache.shape[3])[:length].double()
        v = v_cache[blocks].reshape(-1, hk, v_cache.shape[3])[:length].double()
        k, v = k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1)
        p = (torch.einsum("hd,khd->hk", query[row].double(), k) * scale).softmax(-1)
        outs.append(torch.einsum("hk,khd->hd", p, v))
    return torch.stack(outs)


def _self_check(fn: Callable[..., int], dtype: torch.dtype) -> None:
    """Small paged steps (GQA group 2, shuffled blocks, lengths across a block and a score
    chunk, the K/V write) against :func:`reference_decode`, for a head size of each code path
    (the constant 32 / 64 / 128 and one at run time); RuntimeError when one differs."""
    gen = torch.Generator().manual_seed(0)
    hq, hk, bs, num_blocks = 4, 2, 4, 24
    lens = [1, 5, 37]
    rows = torch.tensor([2, 0, 3], dtype=torch.int64)  # row 1: padding, left as it is
    t = len(lens) + 1
    for d in (24, 32, 64, 128):
        query = torch.randn(t, hq, d, generator=gen).to(dtype)
        key, value = (torch.randn(t, hk, d, generator=gen).to(dtype) for _ in range(2))
        kv_cache = torch.randn(2, num_blocks + 1, bs, hk, d, generator=gen).to(dtype)
        order = torch.randperm(num_blocks, generator=gen)
        table = torch.zeros(len(lens), 10, dtype=torch.int64)
        slots = torch.full((t,), -1, dtype=torch.int64)
        used = 0
        for i, length in enumerate(lens):
            width = -(-length // bs)
            table[i, :width] = order[used : used + width]
            used += width
            slots[rows[i]] = table[i, (length - 1) // bs] * bs + (length - 1) % bs
        seq_lens = torch.tensor(lens, dtype=torch.int64)
        out = torch.zeros(t, hq, d, dtype=dtype)
        index = decode_index(rows, table, seq_lens, slots)
        if index is None or not _call(fn, query, key, value, kv_cache, index, 0.3, out):
            raise RuntimeError(f"{dtype} self-check: the kernel declined the call")
        written = kv_cache.view(2, -1, hk, d)
        for r in rows.tolist():
            s = int(slots[r])
            if not (torch.equal(written[0, s], key[r]) and torch.equal(written[1, s], value[r])):
                raise RuntimeError(f"{dtype} self-check: K/V of row {r} not stored")
        ref = reference_decode(query, kv_cache[0], kv_cache[1], rows, table, seq_lens, 0.3)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        if not torch.allclose(out[rows].double(), ref, rtol=tol, atol=tol) or out[1].any():
            raise RuntimeError(f"{dtype} self-check failed at head size {d} (max error "
                               f"{(out[rows].double() - ref).abs().max().item():.3g})")


@KERNEL.cached
def _function(isa: str, dtype: torch.dtype) -> Callable[..., int] | None:
    """Build ``isa``'s kernel for ``dtype``, self-checked; None when it is unavailable."""
    if dtype not in _DTYPES:
        return None
    lib = _checked_library(isa)
    if lib is None:
        return None
    fn: Callable[..., int] = (lib.fk_decode_attention_bf16 if dtype == torch.bfloat16
                              else lib.fk_decode_attention_f32)
    try:
        _self_check(fn, dtype)
    except RuntimeError as exc:
        logger.warning_once("Native %s %s decode attention off (%s)", isa, dtype, exc)
        return None
    return fn


@KERNEL.cached
def _selected(dtype: torch.dtype) -> tuple[str, Callable[..., int]] | None:
    """(build, function) serving ``dtype``: the first build in ``KERNEL.isas`` that this CPU
    runs and that passes its self-check; None when none does."""
    return KERNEL.first(lambda isa: _function(isa, dtype))


def kernel_isa(dtype: torch.dtype = torch.float32) -> str | None:
    """Which build serves ``dtype`` here ("avx512", "avx2", "generic"), or None."""
    found = _selected(dtype)
    return None if found is None else found[0]


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the native decode attention for ``dtype`` is built and usable here."""
    return _selected(dtype) is not None


def cache_clear() -> None:
    """Forget the loaded kernels (the next call loads or rebuilds them: tests that change
    ``FORWARDKIT_CACHE_ROOT`` or ``CC``)."""
    KERNEL.cache_clear()


class DecodeIndex(NamedTuple):
    """The decode requests' index arrays of one step, checked once (:func:`decode_index`) and
    shared by every layer's :func:`paged_decode`."""

    args: array.array  # the FK_S_* int64 arguments
    n_write: int  # rows of K/V to store first (0: none)
    tensors: tuple[torch.Tensor, ...]  # kept alive while the pointers are in use


def _index_ok(t: torch.Tensor, n: int, dim: int = 1) -> bool:
    return (t.dtype is torch.int64 and t.dim() == dim and t.shape[0] == n and t.is_contiguous()
            and t.is_cpu)


def decode_index(rows: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 slot_mapping: torch.Tensor | None = None) -> DecodeIndex | None:
    """The step's decode requests for :func:`paged_decode`: their token ``rows`` [n], block
    tables [n, W] and sequence lengths [n], plus the ``slot_mapping`` [T'] at which the step's
    K/V rows are stored first (None: store nothing). None when they are not contiguous int64
    CPU tensors of those shapes (the values are checked by the kernel at every call)."""
    n = rows.shape[0] if rows.dim() == 1 else -1
    if not (_index_ok(rows, n) and _index_ok(seq_lens, n) and _index_ok(block_table, n, 2)):
        return None
    n_write, slots = 0, 0
    kept: tuple[torch.Tensor, ...] = (rows, block_table, seq_lens)
    if slot_mapping is not None:
        n_write = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
        if not _index_ok(slot_mapping, n_write):
            return None
        slots, kept = slot_mapping.data_ptr(), (*kept, slot_mapping)
    args = array.array("q", (rows.data_ptr(), block_table.data_ptr(), block_table.shape[1],
                             seq_lens.data_ptr(), n, slots, n_write))
    return DecodeIndex(args, n_write, kept)


def paged_decode(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                 kv_cache: torch.Tensor, index: DecodeIndex, scale: float, output: torch.Tensor,
                 isa: str | None = None) -> bool:
    """Store ``key``/``value`` [T', Hk, D] at the index's slot mapping (as ``write_kv_cache``:
    slot -1 is the scratch block's last row; only when the index has one), then write into
    ``output`` [T, Hq, D] at the index's rows the attention of ``query`` [T, Hq, D] at those
    rows over the first ``seq_lens`` keys of each request's blocks in ``kv_cache``
    [2, num_blocks + 1, block_size, Hk, D]. Other rows of ``output`` are left as they are.

    Returns False, having done nothing, when the kernel does not apply (not all of one dtype,
    bf16 or float32; not on the CPU; rows of a tensor not contiguous or the cache not
    contiguous; an index out of range; kernel unavailable): the caller then takes the PyTorch
    path. ``isa`` forces one build (tests compare them).
    """
    dtype = query.dtype
    if isa is None:
        found = _selected(dtype)
        if found is None:
            return False
        fn = found[1]
    else:
        forced = _function(isa, dtype)
        if forced is None:
            return False
        fn = forced
    if not _call(fn, query, key, value, kv_cache, index, scale, output):
        return False
    native_build.kernel_calls.attention += 1  # the kernel, not the PyTorch path, served it
    return True


def _rows(t: torch.Tensor, dtype: torch.dtype, heads: int, d: int) -> tuple[int, int] | None:
    """(rows, row stride) of ``t`` when it is a CPU ``[rows, heads, d]`` tensor of ``dtype``
    whose rows are contiguous (any row stride), else None. (Runs several times per layer and
    step: one ``shape`` and one ``stride()`` call.)"""
    if t.dtype is not dtype or not t.is_cpu:
        return None
    shape, stride = t.shape, t.stride()
    if len(shape) != 3 or shape[1] != heads or shape[2] != d or stride[1] != d or stride[2] != 1:
        return None
    return shape[0], stride[0]


def _call(fn: Callable[..., int], query: torch.Tensor, key: torch.Tensor | None,
          value: torch.Tensor | None, kv_cache: torch.Tensor, index: DecodeIndex, scale: float,
          output: torch.Tensor) -> bool:
    """:func:`paged_decode` by the kernel ``fn`` (of ``query``'s dtype)."""
    dtype = query.dtype
    if kv_cache.dtype is not dtype or not kv_cache.is_cpu or not kv_cache.is_contiguous():
        return False
    shape = kv_cache.shape
    if len(shape) != 5 or query.dim() != 3:
        return False
    _, blocks, block_size, hk, d = shape
    hq = query.shape[1]
    q = _rows(query, dtype, hq, d)
    out = _rows(output, dtype, hq, d)
    if hq % hk or q is None or out is None or out[0] != q[0]:
        return False
    key_ptr = value_ptr = key_stride = value_stride = 0
    n_write = index.n_write
    if n_write:
        if key is None or value is None:
            return False
        k, v = _rows(key, dtype, hk, d), _rows(value, dtype, hk, d)
        if k is None or v is None or k[0] < n_write or v[0] < n_write:
            return False
        key_ptr, value_ptr, key_stride, value_stride = key.data_ptr(), value.data_ptr(), k[1], v[1]
    k_ptr = kv_cache.data_ptr()
    slots = blocks * block_size
    layer = array.array("q", (query.data_ptr(), q[1], output.data_ptr(), out[1], q[0], k_ptr,
                              k_ptr + slots * hk * d * (2 if dtype is torch.bfloat16 else 4),
                              slots, block_size, hq, hk, d, key_ptr, key_stride, value_ptr,
                              value_stride))
    return fn(layer.buffer_info()[0], index.args.buffer_info()[0], scale) == 0
