"""The native few-row linear (``csrc/linear_few_rows.c``), built at first use.

Decode steps multiply one or two activation rows by each weight; that product streams the
weight from memory and does little arithmetic. oneDNN's bf16 matmul reaches about 15 GB/s a
core on such products here (packed or not); the native kernel reads the plain row-major weight
in blocks of rows with VDPBF16PS and reaches 20-28 GB/s a core with the weight on huge pages.
For float32 it saves MKL's per-call overhead on the small matrices of small models. For more
rows oneDNN's packed matmul is faster (it is compute-bound there) and stays in use.

The C file is compiled with the system C compiler (``$CC``, else ``cc``) into
``$FORWARDKIT_CACHE_ROOT/native/`` under a name derived from the source and flags, checked
against ``F.linear`` once, and loaded with ``ctypes``. The bf16 kernel needs AVX-512-BF16, the
float32 one AVX-512F/BW/VL. Anything that fails (no compiler, missing instructions, a wrong
result) disables it with one log line; ``F.linear``/oneDNN then serve every call.
``FORWARDKIT_CPU_NATIVE_LINEAR=0`` disables it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from forwardkit import envs
from forwardkit.logger import init_logger

__all__ = ["MAX_ROWS", "available", "cpu_flags", "cpu_has_avx512_bf16", "cpu_model_name",
           "cpu_supports", "linear_rows"]

logger = init_logger(__name__)

MAX_ROWS = 2  # rows up to which the kernel beats oneDNN's packed matmul (measured, 2-core EPYC)
_SOURCE = Path(__file__).with_name("csrc") / "linear_few_rows.c"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared",
          "-fPIC"]
_ABI_VERSION = 2
_NEEDS = {torch.bfloat16: {"avx512_bf16"}, torch.float32: {"avx512f", "avx512bw", "avx512vl"}}


def _cpuinfo(field: str) -> str:
    """The first ``field`` line's value in Linux ``/proc/cpuinfo`` ("" elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    return frozenset(_cpuinfo("flags").split())


@functools.lru_cache(maxsize=1)
def cpu_model_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; "" elsewhere)."""
    return _cpuinfo("model name")


def cpu_has_avx512_bf16() -> bool:
    """Whether the CPU reports AVX-512-BF16."""
    return "avx512_bf16" in cpu_flags()


def cpu_supports(dtype: torch.dtype) -> bool:
    """Whether the CPU has the instructions of the ``dtype`` kernel (the library itself needs
    AVX-512F/BW/VL; the bf16 kernel also AVX-512-BF16). A compiler is needed besides."""
    if dtype not in _NEEDS:
        return False
    return (_NEEDS[torch.float32] | _NEEDS[dtype]) <= cpu_flags()


def _build(cache_dir: Path) -> Path:
    """Compile the kernel into ``cache_dir`` (once per source and flags) and return its path."""
    source = _SOURCE.read_bytes()
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS]).encode()).hexdigest()[:16]
    target = cache_dir / f"linear_few_rows-{key}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder sees the old name or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _self_check(fn: Callable[..., int], dtype: torch.dtype) -> None:
    """Small products (with a K tail and a bias) against ``F.linear`` in float64."""
    gen = torch.Generator().manual_seed(0)
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(rows, 70, generator=gen).to(dtype)
        w = torch.randn(13, 70, generator=gen).to(dtype)
        b = torch.randn(13, generator=gen).to(dtype)
        y = torch.empty(rows, 13, dtype=dtype)
        rc = fn(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), rows, 13, 70)
        ref = F.linear(x.double(), w.double(), b.double())
        if rc != 0 or not torch.allclose(y.double(), ref, rtol=2e-2, atol=2e-2):
            raise RuntimeError(f"{dtype} self-check failed for {rows} rows (rc={rc})")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if not envs.FORWARDKIT_CPU_NATIVE_LINEAR:
        return None
    if not cpu_supports(torch.float32):
        logger.info_once("Native linear off: the CPU has no AVX-512")
        return None
    try:
        lib = ctypes.CDLL(str(_build(Path(envs.FORWARDKIT_CACHE_ROOT) / "native")))
        lib.fk_abi_version.restype = ctypes.c_int
        if lib.fk_abi_version() != _ABI_VERSION:
            raise RuntimeError(f"ABI version {lib.fk_abi_version()} != {_ABI_VERSION}")
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning_once("Native linear off (%s); oneDNN/MKL serve small products", exc)
        return None
    return lib


@functools.cache
def _kernel(dtype: torch.dtype) -> Callable[..., int] | None:
    lib = _library()
    if lib is None or not cpu_supports(dtype):
        return None
    fn = lib.fk_linear_bf16 if dtype == torch.bfloat16 else lib.fk_linear_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    try:
        _self_check(fn, dtype)
    except RuntimeError as exc:
        logger.warning_once("Native %s linear off (%s)", dtype, exc)
        return None
    return fn


def cache_clear() -> None:
    """Forget the loaded kernels (the next call re-reads the environment and rebuilds)."""
    _kernel.cache_clear()
    _library.cache_clear()


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the native kernel for ``dtype`` is built and usable on this machine."""
    return _kernel(dtype) is not None


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` by the native kernel, or None when it does not apply
    (not bf16/float32 on the CPU, more than :data:`MAX_ROWS` rows, non-contiguous operands,
    kernel unavailable): the caller then takes another path."""
    dtype = x.dtype
    if dtype not in _NEEDS or weight.dtype != dtype or x.device.type != "cpu":
        return None
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 1 <= rows <= MAX_ROWS or not weight.is_contiguous() or weight.shape[1] != k:
        return None
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    fn = _kernel(dtype)
    if fn is None:
        return None
    x = x.contiguous()
    n = weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=dtype)
    fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
       rows, n, k)
    return out
