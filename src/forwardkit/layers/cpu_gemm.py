"""oneDNN-prepacked weights for bf16 linear layers on the CPU.

A bf16 ``F.linear`` on the CPU reorders its weight into oneDNN's blocked layout on every call;
for the one-to-64-row products of decoding that reorder is most of the cost (a decode step of
a 1B model streams its weights at about half the speed the memory allows). Reordering each
weight once after loading and calling oneDNN's matmul on the packed copy removes it.

The graph sees ``torch.ops.forwardkit.linear(x, weight, bias)``: an opaque op whose kernel
looks the packed copy up by the weight's data pointer, so every layer's graph stays the same
(identical pieces still share one compiled artifact) and nothing is baked into a compiled
graph. The packed copy is derived data: :func:`refresh_packed` re-derives it after the weight
is written (the layers' weight loaders call it, so live weight updates stay correct).

NOTE: the plain weight is kept (loading, tied embeddings and updates read it), so a packed
layer holds its weight twice; :func:`prepack_linear_weights` skips packing when that would not
fit in memory.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from forwardkit.layers import native_linear
from forwardkit.logger import init_logger

__all__ = ["batched_refresh", "linear", "pack_weight", "packed_weight_count", "prepack_supported", "refresh_packed",
           "unpack_weight"]

logger = init_logger(__name__)

# data_ptr of a plain weight -> (weak reference to the weight, its packed copy). The entry
# goes when the weight is freed, so a later tensor at the same address never meets it.
_PACKED: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def prepack_supported(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether weights of ``dtype`` on ``device`` are worth packing (bf16 with native bf16
    instructions on the CPU: AVX-512-BF16 or AMX)."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> None:
    """Pack ``weight`` [out, in] (idempotent: packing again re-derives the copy)."""
    ptr = weight.data_ptr()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    _PACKED[ptr] = (weakref.ref(weight, lambda _ref: _forget(ptr, _ref)), packed)


def _forget(ptr: int, ref: weakref.ref) -> None:
    entry = _PACKED.get(ptr)
    if entry is not None and entry[0] is ref:
        del _PACKED[ptr]


def unpack_weight(weight: torch.Tensor) -> None:
    """Drop the packed copy of ``weight`` (no-op when it has none)."""
    _PACKED.pop(weight.data_ptr(), None)


# Inside ``batched_refresh``: data_ptr -> weight whose packed copy is re-derived at the end.
_deferred: dict[int, torch.Tensor] | None = None


def refresh_packed(written: torch.Tensor) -> None:
    """Re-derive the packed copy of the weight that ``written`` (the weight or a slice of it)
    belongs to, after ``written`` was modified in place."""
    if not _PACKED or written.device.type == "meta":
        return
    ptr = written.untyped_storage().data_ptr()
    entry = _PACKED.get(ptr)
    weight = entry[0]() if entry is not None else None
    if weight is None:
        return
    if _deferred is not None:
        _deferred[ptr] = weight
    else:
        pack_weight(weight)


@contextlib.contextmanager
def batched_refresh() -> Iterator[None]:
    """Within the block, writes only mark packed weights stale; each is re-derived once at the
    end (a merged q/k/v weight written shard by shard is repacked once, not three times)."""
    global _deferred
    if _deferred is not None:  # nested: the outer block repacks
        yield
        return
    _deferred = {}
    try:
        yield
    finally:
        todo, _deferred = _deferred, None
        for weight in todo.values():
            pack_weight(weight)


def packed_weight_count() -> int:
    """Number of weights with a live packed copy (for tests and logs)."""
    return len(_PACKED)


def available_memory_bytes() -> int | None:
    """Memory the OS reports available (None when it cannot tell)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through the packed copy of ``weight`` when it has one."""
    entry = _PACKED.get(weight.data_ptr())
    if entry is None:
        return F.linear(x, weight, bias)
    out = native_linear.linear_rows(x, weight, bias)  # 1-2 rows: the plain weight streams faster
    if out is not None:
        return out
    return torch.ops.mkldnn._linear_pointwise(x, entry[1], bias, "none", [], "")


# NOTE: registered through ``torch.library.Library`` (direct kernel dispatch, ~2 us a call)
# rather than ``torch.library.custom_op`` (Python wrapper layers, ~15 us): it runs once per
# projection per step.
_LIB = torch.library.Library("forwardkit", "FRAGMENT")
_LIB.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("linear", linear, "CompositeExplicitAutograd")


@torch.library.register_fake("forwardkit::linear", lib=_LIB)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
