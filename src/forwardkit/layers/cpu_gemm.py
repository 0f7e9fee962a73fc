"""Fast bf16 linear layers on the CPU: a native kernel for few rows, oneDNN-packed weights for more.

A bf16 ``F.linear`` on the CPU reorders its weight into oneDNN's blocked layout on every call;
for the few-row products of decoding that reorder is most of the cost. Three paths, chosen per
call by the number of rows of the input:

- 1-2 rows (batch-1/2 decode), and 3-16 rows in bf16 where the AVX2 build serves it (no
  native bf16 arithmetic on the CPU: ``native_linear.max_rows``): the native kernel of
  :mod:`native_linear` streams the plain weight (memory-bound; no packed copy needed);
- 3..``LAZY_PACK_MAX_ROWS`` rows (batched decode): oneDNN's matmul on a packed copy of the
  weight, made at the first such call (compute-bound; the packing pays for itself);
- more rows (prompts): the packed copy if it exists, else plain ``F.linear``.

When a model's routed weights together are under :data:`TUNE_MAX_BYTES` (a small model), they
stay in the caches, a product is over in microseconds, and which path wins depends on the
machine: on the 2-core EPYC forwardkit's paths beat MKL's small GEMMs (the toy model's lead
came from them), on the 2-core Xeon MKL's ``F.linear`` was 1.5-3x faster at 2-8 rows. Then
:func:`tune` (called by ``layers.linear.prepack_weights``) times both, per weight shape and row
bucket (1, 2, 3-4, 5-8, ... rows), and the weight's entry keeps the choice, so a call reads it
with one list index (``FORWARDKIT_CPU_LINEAR_TUNE=0``: always the fast path). Larger models
stream their weights from memory, where the fast paths win everywhere measured (and a timing
loop over one cache-hot weight would mislead); they are not timed.

The graph sees ``torch.ops.forwardkit.linear(x, weight, bias)``: an opaque op whose kernel
looks the weight up by its data pointer, so every layer's graph stays the same (identical
pieces still share one compiled artifact) and nothing is baked into a compiled graph. The
packed copy is derived data: :func:`refresh_packed` re-derives it after the weight is written
(the layers' weight loaders call it, so live weight updates stay correct).

NOTE: the plain weight is kept (loading, tied embeddings, updates and the native kernel read
it), so a packed layer holds its weight twice; ``layers.linear.prepack_weights`` does not
register weights when that would not fit in memory. Batch-1 workloads never pack.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from forwardkit import envs
from forwardkit.layers import native_linear
from forwardkit.logger import init_logger

__all__ = ["LAZY_PACK_MAX_ROWS", "TUNE_MAX_BYTES", "batched_refresh", "clear_routes", "linear",
           "pack_weight", "packed_weight_count", "prepack_supported", "refresh_packed", "route_supported",
           "register_weight", "routes", "tune", "tuning_applies", "unpack_weight"]

logger = init_logger(__name__)

# data_ptr of a plain weight -> [weak reference to the weight, its packed copy or None]. None:
# registered, packed at its first product of a few rows. The entry goes when the weight is
# freed, so a later tensor at the same address never meets it.
_PACKED: dict[int, list[Any]] = {}

# Products of up to this many rows pack a registered weight on first use; longer ones (prompts)
# run F.linear on the plain weight until something packs it: oneDNN's per-call reorder is then
# a small share of the work (measured: 7% slower at 64 rows, 25% at 32, 40% at 16).
LAZY_PACK_MAX_ROWS = 32

# The row count oneDNN picks the packed layout for. Packed copies serve 3+ rows (1-2 rows take
# the native kernel); a layout picked for 64 rows was 10-40% faster at 4-16 rows than one picked
# for 1 row (bf16 and float32, measured on 2048x16384 and 256x4096 weights).
_PACK_ROWS_HINT = 64


# A model whose routed weights take at most this many bytes chooses its paths per weight shape
# and row bucket by timing (module doc).
TUNE_MAX_BYTES = 64 << 20
_TUNE_BUCKETS = 10  # 1, 2, 3-4, 5-8, ..., 257+ rows
_TUNE_CALLS = 9  # timed calls per candidate, after two untimed
# (out, in, dtype, has bias) -> per row bucket: True = fast path, False = F.linear, None = not
# timed yet.
_ROUTES: dict[tuple[int, int, torch.dtype, bool], list[bool | None]] = {}


def tune(weight: torch.Tensor, bias: torch.Tensor | None = None) -> list[bool]:
    """Choose the path of every row bucket for ``weight``'s shape now (on random inputs of 1, 2,
    4, ..., 512 rows) and return the choices (True = the fast path). Registers ``weight`` if it
    is not registered.

    Choices are kept on disk per machine (CPU model and flags, torch version, thread count)
    under ``$FORWARDKIT_CACHE_ROOT/linear_routes/``: which layers are routed decides the graph
    that is compiled, so a later process must choose the same way to find its compiled pieces
    in the cache (and it then skips the timing)."""
    register_weight(weight)
    key = (weight.shape[0], weight.shape[1], weight.dtype, bias is not None)
    if not _ROUTES and not _routes_loaded:
        _load_routes()
    route = _ROUTES.setdefault(key, [None] * _TUNE_BUCKETS)
    _PACKED[weight.data_ptr()][2] = route  # shared by every weight of this shape
    if None in route:
        gen = torch.Generator().manual_seed(0)
        for bucket in range(_TUNE_BUCKETS):
            if route[bucket] is None:
                x = torch.randn(1 << bucket, weight.shape[1], generator=gen).to(weight.dtype)
                route[bucket] = _faster_is_fast_path(x, weight, bias)
        _save_routes()
    return [bool(r) for r in route]


_routes_loaded = False


def _routes_file() -> str:
    import hashlib
    import json

    machine = json.dumps([sorted(native_linear.cpu_flags()), native_linear.cpu_model_name(), torch.__version__,
                          torch.get_num_threads(), _TUNE_BUCKETS, _TUNE_CALLS,
                          native_linear.candidate_builds()])
    digest = hashlib.sha256(machine.encode()).hexdigest()[:16]
    return os.path.join(envs.FORWARDKIT_CACHE_ROOT, "linear_routes", f"{digest}.json")


def _route_key(key: tuple[int, int, torch.dtype, bool]) -> str:
    return f"{key[0]},{key[1]},{str(key[2]).removeprefix('torch.')},{int(key[3])}"


def _load_routes() -> None:
    """Read the choices saved for this machine (none, or an unreadable file: time anew)."""
    import json

    global _routes_loaded
    _routes_loaded = True
    try:
        with open(_routes_file(), encoding="utf-8") as f:
            saved = json.load(f)
        for text, route in saved.items():
            n, k, dtype, has_bias = text.split(",")
            if (len(route) == _TUNE_BUCKETS and all(isinstance(r, bool) for r in route)
                    and isinstance(getattr(torch, dtype, None), torch.dtype)):
                _ROUTES[(int(n), int(k), getattr(torch, dtype), has_bias == "1")] = list(route)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        if not isinstance(exc, FileNotFoundError):
            logger.warning_once("Ignoring saved linear-path choices (%s); timing anew", exc)


def _save_routes() -> None:
    """Write every complete choice atomically (a failure only logs: the choices still hold for
    this process)."""
    import json
    import tempfile

    path = _routes_file()
    data = {_route_key(k): v for k, v in _ROUTES.items() if None not in v}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning_once("Could not save linear-path choices to %s: %s", path, exc)


def tuning_applies(nbytes: int) -> bool:
    """Whether a model whose routed weights take ``nbytes`` chooses its paths by timing."""
    return envs.FORWARDKIT_CPU_LINEAR_TUNE and nbytes <= TUNE_MAX_BYTES


def routes() -> dict[tuple[int, int, torch.dtype, bool], list[bool | None]]:
    """The path chosen per small-weight shape and row bucket so far (for tests and logs)."""
    return {k: list(v) for k, v in _ROUTES.items()}


def clear_routes() -> None:
    """Forget every choice made or loaded in this process (the next product of each bucket
    times the paths again; the file of saved choices is left alone)."""
    global _routes_loaded
    _ROUTES.clear()
    _routes_loaded = False


def prepack_supported(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether weights of ``dtype`` on ``device`` go through these paths: float32 on a CPU
    with oneDNN, bf16 on one with native bf16 instructions (AVX-512-BF16 or AMX)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def _packable(dtype: torch.dtype) -> bool:
    return prepack_supported(dtype)


def route_supported(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether weights of ``dtype`` on ``device`` are worth routing through :func:`linear`:
    where oneDNN packs them (:func:`prepack_supported`), or bf16 where only the native few-row
    kernel serves them (an AVX2 CPU: oneDNN has no bf16 there, so 3+ rows take plain
    ``F.linear`` and 1-2 rows the kernel). Asking may build the kernel (once per machine)."""
    if prepack_supported(dtype, device):
        return True
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and native_linear.available(dtype))


def _entry(weight: torch.Tensor, packed: torch.Tensor | None) -> None:
    ptr = weight.data_ptr()
    old = _PACKED.get(ptr)
    route = old[2] if old is not None else None  # the timed choice survives repacking
    _PACKED[ptr] = [weakref.ref(weight, lambda _ref: _forget(ptr, _ref)), packed, route]


def register_weight(weight: torch.Tensor) -> None:
    """Route ``weight`` [out, in] through the fast paths: the native kernel for 1-2 rows, a
    packed copy made at its first product of 3..``LAZY_PACK_MAX_ROWS`` rows."""
    if weight.data_ptr() not in _PACKED:
        _entry(weight, None)


def pack_weight(weight: torch.Tensor) -> None:
    """Pack ``weight`` [out, in] now (idempotent: packing again re-derives the copy)."""
    _entry(weight, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT))


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
    if entry is None or entry[1] is None:  # not packed yet: packing will read the new values
        return
    weight = entry[0]()
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
    return sum(1 for entry in _PACKED.values() if entry[1] is not None)


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
    """``F.linear`` by the fastest path for ``weight`` (registered or packed) and the number of
    rows: the native kernel for 1-2 rows, else the packed copy (made now for a few rows),
    else plain ``F.linear``."""
    entry = _PACKED.get(weight.data_ptr())
    if entry is None:
        return F.linear(x, weight, bias)
    route = entry[2]  # set by tune(): per row bucket, False = plain F.linear is faster here
    if route is not None:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if route[min(max(rows - 1, 0).bit_length(), _TUNE_BUCKETS - 1)] is False:
            return F.linear(x, weight, bias)
    return _fast_path(x, weight, bias, entry)


def _fast_path(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               entry: list[Any]) -> torch.Tensor:
    out = native_linear.linear_rows(x, weight, bias)  # the rows the native kernel serves
    if out is not None:
        return out
    packed = entry[1]
    if packed is None:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows > LAZY_PACK_MAX_ROWS or not _packable(weight.dtype):
            return F.linear(x, weight, bias)
        pack_weight(weight)
        packed = _PACKED[weight.data_ptr()][1]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _faster_is_fast_path(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Time plain ``F.linear`` against the fast path as the model calls it (through the
    ``forwardkit::linear`` op, whose dispatch costs microseconds too; a bucket not chosen yet
    takes the fast path) on this product: two untimed calls each, then interleaved calls. The
    fast path is kept only when its median is at least 10% lower (a tie keeps the plain matmul,
    which needs no op and no packed copy)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(_TUNE_CALLS + 2):
        for fast in (False, True):
            start = time.perf_counter()
            if fast:
                torch.ops.forwardkit.linear(x, weight, bias)
            else:
                F.linear(x, weight, bias)
            if i >= 2:
                times[fast].append(time.perf_counter() - start)
    return statistics.median(times[True]) < 0.9 * statistics.median(times[False])


# NOTE: registered through ``torch.library.Library`` (direct kernel dispatch, ~2 us a call)
# rather than ``torch.library.custom_op`` (Python wrapper layers, ~15 us): it runs once per
# projection per step.
_LIB = torch.library.Library("forwardkit", "FRAGMENT")
_LIB.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("linear", linear, "CompositeExplicitAutograd")


@torch.library.register_fake("forwardkit::linear", lib=_LIB)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
