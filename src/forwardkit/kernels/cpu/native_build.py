"""Building, verifying and loading forwardkit's native CPU kernels (``csrc/*.c``).

:class:`NativeKernel` is one kernel: its C source, its ISA builds (:class:`Isa`: compiler
flags and the CPU flags each needs, tried best first), its ABI check, and the process-wide
caches of its build directory, loaded libraries and the kernel's own per-build entry points.
:mod:`~forwardkit.kernels.cpu.native_linear`, :mod:`~forwardkit.kernels.cpu.native_attention`
and :mod:`~forwardkit.kernels.cpu.native_quant` each instantiate one and keep only what is
theirs (entry points, self-checks, the call). The rules:

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
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, ParamSpec, TypeVar

from forwardkit.compilation import kernel_cache
from forwardkit.compilation.cache import CacheDirError, native_kernel_dir
from forwardkit.logger import ForwardkitLogger
from forwardkit.platforms import cpu_capabilities

__all__ = ["COMMON_FLAGS", "Isa", "KernelCalls", "NativeKernel", "NoCompiler", "build_dir",
           "build_inputs", "compile_library", "compiler", "kernel_calls", "library_name",
           "load_library", "open_checked"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")

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


class Isa(NamedTuple):
    """One build of a native kernel: its compiler flags, the CPU flags it needs to run, and its
    own source where the builds of a kernel differ in source (None: the kernel's)."""

    flags: tuple[str, ...]
    needs: frozenset[str]
    source: Path | None = None


class NativeKernel:
    """One native CPU kernel: built per ISA with the system compiler into the checked
    ``native/`` directory, loaded only after its manifest entry matches, ABI-checked, and the
    first build (in :attr:`isas` order) that this CPU runs and the kernel's own entry-point
    loader accepts serves (:meth:`first`). Every cache (build directory, loaded libraries, and
    the functions the kernel module wraps with :meth:`cached`) is dropped by
    :meth:`cache_clear`. The kernel reads no switch: whether it is used is the custom op of the
    layers that call it (``config/custom_ops.py``).

    ``name`` names it in log lines ("linear", "decode attention", ...); ``fallback`` says what
    serves when it is off; ``flags`` are added to every build's (after :data:`COMMON_FLAGS`);
    ``cpu_flags`` gives the CPU's feature flags (default ``platforms.cpu_capabilities().flags``;
    a kernel module passes its own seam so tests can emulate another CPU).
    """

    def __init__(self, *, name: str, source: Path, isas: dict[str, Isa], abi_symbol: str,
                 abi_version: int, logger: ForwardkitLogger, fallback: str,
                 flags: Sequence[str] = (),
                 cpu_flags: Callable[[], frozenset[str]] | None = None) -> None:
        self.name, self.source, self.isas = name, source, isas
        self.abi_symbol, self.abi_version = abi_symbol, abi_version
        self.logger, self.fallback, self.extra_flags = logger, fallback, tuple(flags)
        self.cpu_flags = cpu_flags or (lambda: cpu_capabilities().flags)
        self._clears: list[Callable[[], None]] = []
        self.library = self.cached(self._open)
        self.build_dir = self.cached(self._build_dir)

    # -- builds ------------------------------------------------------------------------------
    def isa_supported(self, isa: str) -> bool:
        """Whether this CPU has the instructions build ``isa`` uses (KeyError: no such build)."""
        return self.isas[isa].needs <= self.cpu_flags()

    def candidate_builds(self) -> list[str]:
        """The builds this CPU could run, best first (cheap: no compiling)."""
        return [isa for isa in self.isas if self.isa_supported(isa)]

    def source_of(self, isa: str) -> Path:
        """The C source build ``isa`` compiles."""
        return self.isas[isa].source or self.source

    def flags(self, isa: str) -> list[str]:
        """The compiler flags of build ``isa``."""
        return [*COMMON_FLAGS, *self.extra_flags, *self.isas[isa].flags]

    def library_name(self, isa: str) -> str:
        """The file name of build ``isa`` (:func:`library_name`: a change to the source, what it
        includes, the compiler or the flags is another file)."""
        return library_name(self.source_of(isa), self.flags(isa))

    def compile(self, directory: Path, isa: str, name: str) -> None:
        """Compile build ``isa`` into ``directory/name`` (whole or not at all)."""
        compile_library(directory, self.source_of(isa), self.flags(isa), name)

    def compile_only(self, directory: Path, isa: str) -> Path:
        """Compile build ``isa`` into ``directory`` without loading it (a CPU without the ISA
        can still check that it compiles: CI does, for every build); returns the file."""
        name = self.library_name(isa)
        self.compile(directory, isa, name)
        return directory / name

    def load(self, directory: Path, isa: str) -> ctypes.CDLL:
        """Build ``isa`` from ``directory`` loaded (:func:`load_library`: the existing file if
        it matches the manifest, else compiled and recorded first, under the manifest's lock)."""
        name = self.library_name(isa)
        return load_library(directory, name, f"native {self.name} build",
                            lambda: self.compile(directory, isa, name))

    def _build_dir(self) -> Path | None:
        return build_dir(self.logger, f"Native {self.name} off for this process ({self.fallback})")

    def _open(self, isa: str) -> ctypes.CDLL | None:
        """Build ``isa`` loaded and ABI-checked, or None (instructions missing, no usable build
        directory, build or ABI error: one warning)."""
        if not self.isa_supported(isa):
            return None
        directory = self.build_dir()
        if directory is None:
            return None
        return open_checked(lambda: self.load(directory, isa), self.abi_symbol, self.abi_version,
                            logger=self.logger, kernel=self.name, isa=isa, fallback=self.fallback)

    # -- which build serves ------------------------------------------------------------------
    def first(self, entry: Callable[[str], _T | None]) -> tuple[str, _T] | None:
        """``(isa, entry(isa))`` for the first build in :attr:`isas` order that this CPU runs
        and for which ``entry`` (the kernel's loader and self-check of one build) gives
        something; None when none does. Callers cache the answer (:meth:`cached`)."""
        for isa in self.isas:
            if self.isa_supported(isa):
                found = entry(isa)
                if found is not None:
                    return isa, found
        return None

    # -- caches ------------------------------------------------------------------------------
    def cached(self, fn: Callable[_P, _R]) -> Callable[_P, _R]:
        """``fn`` memoised for the process (:func:`functools.cache`), its cache dropped by
        :meth:`cache_clear`."""
        memo = functools.cache(fn)
        self._clears.append(memo.cache_clear)
        return memo  # type: ignore[return-value]  # functools.cache keeps the signature

    def cache_clear(self) -> None:
        """Forget every loaded build and cached lookup of this kernel (the next call loads or
        rebuilds: tests that change ``FORWARDKIT_CACHE_ROOT`` or ``CC``)."""
        for clear in self._clears:
            clear()
