"""Remember Inductor's CPU vector-ISA probe between processes.

Before Inductor builds or loads a C++ kernel it asks which vector ISAs (AVX2, AVX-512, ...)
work here: ``torch._inductor.cpu_vec_isa.valid_vec_isa_list()`` dry-compiles a small test
program per ISA and per optional feature (VNNI, BF16, AMX) and dlopens each in a fresh Python
child. That costs seconds per process, and on a warm compile-cache start it was the largest
single cost (the kernels themselves are already built). The picked ISA and its features are
part of every kernel's cache key, so a later process must reach exactly the same answers.

:func:`prime_vec_isa_list` runs Inductor's own ISA selection once, up front, with every
``check_build`` probe answered from a record an earlier process wrote under the compile-cache
root (:func:`record_vec_isa_list` records each probe's inputs and answer while Inductor really
probes). The record is used only when its key matches this host exactly (torch version,
Python, machine, CPU feature flags, C++ compiler and version, library path), and every probe
asked must have been recorded with exactly the same ISA, flags and test code; otherwise the
priming is undone and Inductor probes as usual. So the outcome is always the one real probes
gave on this host with this toolchain. Nothing is done on non-x86 machines or when the user
set ``cpp.vec_isa_ok``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from torch._inductor.cpu_vec_isa import VecISA

__all__ = ["cpu_codegen_key", "prime_vec_isa_list", "record_vec_isa_list", "vec_isa_record_path"]

logger = init_logger(__name__)

_FILE = "vec_isa.json"
_STATE_ATTRS = ("_arch_flags", "_is_avx512_bf16_supported", "_is_amx_fp16_supported")


class _Unrecorded(Exception):
    """A probe the record has no answer for: give up priming."""


def vec_isa_record_path(root: str) -> str:
    """Where the probe record for the cache root ``root`` is kept."""
    return os.path.join(root, "torch_compile_cache", _FILE)


def _applicable() -> bool:
    from torch._inductor import config

    return (
        sys.platform == "linux"
        and platform.machine() == "x86_64"
        and not config.is_fbcode()
        and config.cpp.vec_isa_ok is None
    )


def _host_key() -> dict[str, object]:
    """Everything the probe answers depend on (cheap: no compiles, one ``cxx -v``)."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

    cxx = get_cpp_compiler()
    return {
        "torch": torch.__version__,
        "python": sys.executable,
        "machine": platform.machine(),
        "cpu_flags": cpu_vec_isa.x86_isa_checker(),
        "cpu_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "cpu_amx_fp16": bool(torch.cpu._is_amx_fp16_supported()),
        "cxx": cxx,
        "cxx_version": get_compiler_version_info(cxx),
        "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
    }


def cpu_codegen_key() -> dict[str, object]:
    """What decides the vector ISA Inductor writes a CPU kernel's C++ for, for the compile
    caches' keys: the host and toolchain (:func:`_host_key`), PyTorch's CPU capability (which
    ``ATEN_CPU_CAPABILITY`` can lower: Inductor then picks AVX2 on an AVX-512 CPU) and
    ``cpp.simdlen``. A saved artifact holds the kernels' C++ source, which is compiled again
    where it is loaded for the ISA picked there; source written for 8-lane vectors and built for
    16 reads and writes past its buffers, so an artifact is never shared across these."""
    from torch._inductor import config

    return {**_host_key(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "simdlen": config.cpp.simdlen}


def _probe_id(isa: VecISA, code: str) -> str:
    """Identify one ``check_build(code)`` call: the ISA, its current flags and the test code."""
    text = "\0".join((type(isa).__name__, str(isa), str(isa.build_arch_flags()), code))
    return hashlib.sha256(text.encode()).hexdigest()


def _computed() -> bool:
    """Whether Inductor's list is known in this process (True if it is not the cached function
    this module expects, so nothing is primed or recorded then)."""
    from torch._inductor import cpu_vec_isa

    info = getattr(cpu_vec_isa.valid_vec_isa_list, "cache_info", None)
    return info is None or info().currsize > 0


@contextlib.contextmanager
def _check_build_replaced(fn: Callable[[VecISA, str], bool]) -> Iterator[None]:
    from torch._inductor import cpu_vec_isa

    original = cpu_vec_isa.VecISA.check_build
    cpu_vec_isa.VecISA.check_build = fn  # type: ignore[method-assign,assignment]  # patching a method on the class
    try:
        yield
    finally:
        cpu_vec_isa.VecISA.check_build = original  # type: ignore[method-assign]


def _snapshot() -> list[tuple[VecISA, dict[str, object]]]:
    from torch._inductor import cpu_vec_isa

    return [
        (isa, {a: isa.__dict__[a] for a in _STATE_ATTRS if a in isa.__dict__})
        for isa in cpu_vec_isa.supported_vec_isa_list
    ]


def _restore(snapshot: list[tuple[VecISA, dict[str, object]]]) -> None:
    """Undo a half-done priming: instance state, and every cached ISA answer."""
    from torch._inductor import cpu_vec_isa

    for isa, state in snapshot:
        for a in _STATE_ATTRS:
            if a in state:
                setattr(isa, a, state[a])
            else:
                isa.__dict__.pop(a, None)
    for cls in (cpu_vec_isa.VecAVX512, cpu_vec_isa.VecAVX512VNNI, cpu_vec_isa.VecAMX):
        clear = getattr(cls.__dict__.get("__bool__"), "cache_clear", None)
        if clear is not None:
            clear()
    clear = getattr(cpu_vec_isa.VecISA.__dict__.get("_VecISA__bool__impl"), "cache_clear", None)
    if clear is not None:
        clear()
    cpu_vec_isa.valid_vec_isa_list.cache_clear()


def prime_vec_isa_list(root: str) -> str:
    """Settle Inductor's ISA list now: from the record under ``root`` when it applies, else by
    really probing (and recording the answers for the next process).

    Returns ``"computed"`` (already known in this process, or not applicable here),
    ``"primed"`` (answered from the record, no probes run) or ``"probed"``.
    """
    if _computed() or not _applicable():
        return "computed"
    from torch._inductor import cpu_vec_isa

    path = vec_isa_record_path(root)
    answers: dict[str, bool] | None = None
    host = _host_key()
    try:
        with open(path) as f:
            record = json.load(f)
        if record["key"] == host and isinstance(record["answers"], dict):
            answers = {str(k): bool(v) for k, v in record["answers"].items()}
        else:
            logger.debug("vector-ISA record %s is for another host or toolchain", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning_once("ignoring unreadable vector-ISA record %s (%s)", path, str(e))
    if answers is not None:
        snapshot = _snapshot()

        def replay(isa: VecISA, code: str) -> bool:
            found = answers.get(_probe_id(isa, code))
            if found is None:
                raise _Unrecorded(str(isa))
            return found

        try:
            with _check_build_replaced(replay):
                valid = cpu_vec_isa.valid_vec_isa_list()
            logger.debug("vector ISAs %s from %s (no probes)", [str(i) for i in valid], path)
            return "primed"
        except Exception as e:  # _Unrecorded, or anything else: undo, then really probe
            logger.debug("vector-ISA record %s not usable (%s: %s); probing", path,
                         type(e).__name__, e)
            _restore(snapshot)
    record_vec_isa_list(root, host)
    return "probed"


def record_vec_isa_list(root: str, host: dict[str, object] | None = None) -> None:
    """Run Inductor's real ISA probes (if not done yet in this process) and record every probe's
    answer under ``root``, atomically. Only answers seen while probing are recorded, so call it
    before anything else computes the list."""
    if _computed() or not _applicable():
        return
    from torch._inductor import cpu_vec_isa

    original = cpu_vec_isa.VecISA.check_build
    answers: dict[str, bool] = {}

    def recording(isa: VecISA, code: str) -> bool:
        probe = _probe_id(isa, code)
        answers[probe] = result = bool(original(isa, code))
        return result

    with _check_build_replaced(recording):
        cpu_vec_isa.valid_vec_isa_list()
    record = {"key": host or _host_key(), "answers": answers}
    path = vec_isa_record_path(root)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-isa-")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache only costs the probes next time
        logger.warning_once("could not record the vector-ISA probes at %s: %s", path, str(e))
