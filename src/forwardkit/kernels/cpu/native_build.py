"""Building, verifying and loading forwardkit's native CPU kernels (``csrc/*.c``).

Shared by :mod:`~forwardkit.kernels.cpu.native_linear` and
:mod:`~forwardkit.kernels.cpu.native_attention`; the rules are the ones native_linear's module
doc describes:

* a build is compiled with the system C compiler (``$CC``, else ``cc``) into the checked,
  owner-only ``<cache root>/native/`` (:func:`build_dir`), whole or not at all (a temporary
  file renamed into place);
* its file name is the source's stem and a hash of every file that goes into it (the source and
  each file it ``#include "..."``-s, recursively), the compiler and the flags
  (:func:`library_name`), so a change to any of them is another file;
* every build's SHA-256 and size go into the directory's manifest
  (:mod:`forwardkit.compilation.kernel_cache`); :func:`load_library` loads an existing ``.so``
  only when it matches its entry, else removes it and builds it again, all under the manifest's
  ``fcntl`` lock, so no ``.so`` is ``dlopen``-ed before it is verified and two processes building
  at once compile once. A verified build loads without a compiler.

:data:`kernel_calls` counts the calls each kernel served (the kernels count themselves on
return), the production evidence that a kernel, not its PyTorch fallback, ran.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from forwardkit.compilation import kernel_cache
from forwardkit.compilation.cache import CacheDirError, native_kernel_dir
from forwardkit.logger import ForwardkitLogger

__all__ = ["COMMON_FLAGS", "KernelCalls", "NoCompiler", "build_dir", "build_inputs",
           "compile_library", "compiler", "kernel_calls", "library_name", "load_library",
           "open_checked"]

COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


class KernelCalls:
    """Calls served by each native CPU kernel in this process, counted by the kernels as they
    return a result (a call that declines and leaves the step to PyTorch is not counted).

    ``attention``: one per :func:`~forwardkit.kernels.cpu.native_attention.paged_decode` call the
    kernel served (one per layer and decode step); ``linear``: one per
    :func:`~forwardkit.kernels.cpu.native_linear.linear_rows` (or ``linear_bf16_rows``) product
    it computed; ``quant``: one per
    :func:`~forwardkit.kernels.cpu.native_quant.quant_linear_rows` product it computed.
    """

    __slots__ = ("attention", "linear", "quant")

    def __init__(self) -> None:
        self.attention = 0
        self.linear = 0
        self.quant = 0

    def snapshot(self) -> dict[str, int]:
        """The counts now, by kernel."""
        return {"attention": self.attention, "linear": self.linear, "quant": self.quant}

    def since(self, snapshot: dict[str, int]) -> dict[str, int]:
        """Calls served since ``snapshot`` was taken, by kernel."""
        return {name: count - snapshot[name] for name, count in self.snapshot().items()}


#: The process's counter (never reset; take a :meth:`KernelCalls.snapshot` and diff).
kernel_calls = KernelCalls()


class NoCompiler(RuntimeError):
    """No C compiler to build with (and no verified build to load)."""


def compiler() -> str:
    """The C compiler builds use: ``$CC``, else ``cc``."""
    return os.environ.get("CC") or "cc"


def build_inputs(source: Path) -> list[Path]:
    """``source`` and every file it includes with ``#include "..."`` (found next to the file
    that includes it), recursively, each once, in the order first met."""
    seen: list[Path] = []
    pending = [source]
    while pending:
        path = pending.pop(0)
        if path in seen:
            continue
        seen.append(path)
        for name in _LOCAL_INCLUDE.findall(path.read_bytes()):
            included = path.parent / name.decode()
            if included.is_file():
                pending.append(included)
    return seen


def library_name(source: Path, flags: Sequence[str]) -> str:
    """The file name of ``source`` built with ``flags``: its stem and a hash of the bytes of
    every build input (:func:`build_inputs`), the compiler and the flags."""
    data = b"".join(path.read_bytes() for path in build_inputs(source))
    key = hashlib.sha256(data + " ".join([compiler(), *flags]).encode()).hexdigest()[:16]
    return f"{source.stem}-{key}.so"


def compile_library(directory: Path, source: Path, flags: Sequence[str], name: str) -> None:
    """Compile ``source`` with ``flags`` into ``directory/name`` (whole or not at all).

    :class:`NoCompiler` when the compiler is not on ``PATH``; RuntimeError when it fails.
    """
    cc = compiler()
    if shutil.which(cc) is None:
        raise NoCompiler(f"no C compiler {cc!r} on PATH")
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, str(source), "-o", tmp],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, directory / name)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_dir(logger: ForwardkitLogger, off_message: str) -> Path | None:
    """The checked build directory (:func:`native_kernel_dir`), or None with one warning on the
    caller's ``logger`` (``off_message: reason``) when another user could write to it or it
    cannot be made: the caller's kernel is then off for the process. Callers cache the answer."""
    try:
        return Path(native_kernel_dir())
    except (OSError, CacheDirError) as exc:  # UnsafeCacheDirError is a PermissionError
        logger.warning_once("%s: %s", off_message, str(exc))
        return None


def load_library(directory: Path, name: str, what: str, build: Callable[[], None]) -> ctypes.CDLL:
    """``directory/name`` loaded: the existing file if it matches the manifest, else built by
    ``build()`` and recorded first. All under the manifest's lock, so no other process swaps or
    half-writes the file between its check and ``dlopen``. ``what`` names the build in the log
    line of a file that fails its check."""
    with kernel_cache.manifest_lock(str(directory)):
        if not kernel_cache.check_file(str(directory), name, what):
            build()
            kernel_cache.record_file(str(directory), name)
        return ctypes.CDLL(str(directory / name))


def open_checked(load: Callable[[], ctypes.CDLL], abi_symbol: str, abi_version: int, *,
                 logger: ForwardkitLogger, kernel: str, isa: str,
                 fallback: str) -> ctypes.CDLL | None:
    """``load()``'s library when its ``abi_symbol()`` returns ``abi_version``, else None with one
    warning on the caller's ``logger``: ``Native <kernel> off (...); <fallback>`` (the same line
    for every build when there is no compiler, else naming ``isa`` and the error)."""
    try:
        lib = load()
        version = getattr(lib, abi_symbol)
        version.restype = ctypes.c_int
        if version() != abi_version:
            raise RuntimeError(f"ABI version {version()} != {abi_version}")
    except NoCompiler as exc:
        logger.warning_once("Native %s off (%s, no verified build cached); %s", kernel, str(exc),
                            fallback)
        return None
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning_once("Native %s %s off (%s); %s", isa, kernel, exc, fallback)
        return None
    return lib
