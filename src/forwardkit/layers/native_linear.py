"""The native few-row bf16 linear (``csrc/linear_bf16.c``), built at first use.

Decode steps multiply 1-4 activation rows by each weight; that product streams the weight
from memory and does little arithmetic. oneDNN's bf16 matmul reaches about 15 GB/s a core on
such products here (packed or not); the native kernel reads the plain row-major weight in
blocks of rows with VDPBF16PS and reaches 20-28 GB/s a core with the weight on huge pages.
For more rows oneDNN's packed matmul is faster (it is compute-bound there) and stays in use.

The C file is compiled with the system C compiler (``$CC``, else ``cc``) into
``$FORWARDKIT_CACHE_ROOT/native/`` under a name derived from the source and flags, checked
against ``F.linear`` once, and loaded with ``ctypes``. Anything that fails (no compiler, no
AVX-512-BF16, a wrong result) disables it with one log line; ``F.linear``/oneDNN then serve
every call. ``FORWARDKIT_CPU_NATIVE_LINEAR=0`` disables it.
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

__all__ = ["MAX_ROWS", "available", "cpu_has_avx512_bf16", "linear_rows"]

logger = init_logger(__name__)

MAX_ROWS = 2  # rows up to which the kernel beats oneDNN's packed matmul (measured, 2-core EPYC)
_SOURCE = Path(__file__).with_name("csrc") / "linear_bf16.c"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared",
          "-fPIC"]
_ABI_VERSION = 1


def cpu_has_avx512_bf16() -> bool:
    """Whether the CPU reports AVX-512-BF16 (Linux ``/proc/cpuinfo``; False elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_bf16" in line.split()
    except OSError:
        pass
    return False


def _build(cache_dir: Path) -> Path:
    """Compile the kernel into ``cache_dir`` (once per source and flags) and return its path."""
    source = _SOURCE.read_bytes()
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS]).encode()).hexdigest()[:16]
    target = cache_dir / f"linear_bf16-{key}.so"
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


def _self_check(fn: Callable[..., int]) -> None:
    """One small product (with a K tail and a bias) against ``F.linear``."""
    gen = torch.Generator().manual_seed(0)
    for rows in range(1, 5):
        x = torch.randn(rows, 70, generator=gen).bfloat16()
        w = torch.randn(13, 70, generator=gen).bfloat16()
        b = torch.randn(13, generator=gen).bfloat16()
        y = torch.empty(rows, 13, dtype=torch.bfloat16)
        rc = fn(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), rows, 13, 70)
        ref = F.linear(x.float(), w.float(), b.float())
        if rc != 0 or not torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2):
            raise RuntimeError(f"self-check failed for {rows} rows (rc={rc})")


@functools.lru_cache(maxsize=1)
def _kernel() -> Callable[..., int] | None:
    if not envs.FORWARDKIT_CPU_NATIVE_LINEAR:
        return None
    if not cpu_has_avx512_bf16():
        logger.info_once("Native bf16 linear off: the CPU has no AVX-512-BF16")
        return None
    try:
        lib = ctypes.CDLL(str(_build(Path(envs.FORWARDKIT_CACHE_ROOT) / "native")))
        lib.fk_abi_version.restype = ctypes.c_int
        if lib.fk_abi_version() != _ABI_VERSION:
            raise RuntimeError(f"ABI version {lib.fk_abi_version()} != {_ABI_VERSION}")
        fn = lib.fk_linear_bf16
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
        _self_check(fn)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning_once("Native bf16 linear off (%s); oneDNN serves small products", exc)
        return None
    return fn


def available() -> bool:
    """Whether the native kernel is built and usable on this machine."""
    return _kernel() is not None


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` by the native kernel, or None when it does not apply
    (not bf16 on the CPU, more than :data:`MAX_ROWS` rows, non-contiguous operands, kernel
    unavailable): the caller then takes another path."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 1 <= rows <= MAX_ROWS or not weight.is_contiguous() or weight.shape[1] != k:
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return None
    fn = _kernel()
    if fn is None:
        return None
    x = x.contiguous()
    n = weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16)
    fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
       rows, n, k)
    return out
