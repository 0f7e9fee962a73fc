"""On-disk compile cache: atomic, locked, checksummed artifacts per rank.

Layout (``root`` = ``cache_dir`` or ``FORWARDKIT_CACHE_ROOT``, default ``~/.cache/forwardkit``)::

    <root>/torch_compile_cache/<hash10>/rank_<r>_<dp>/<prefix>/
        index.json                     # name -> {path (relative), sha256, size, format, torch}
        .lock                          # fcntl lock taken around every read-modify-write
        cache_key_factors.json         # what went into <hash10>, for humans
        <artifact name>                # binary: one file; unpacked: a directory
    <root>/inductor_cache/cpu_<isa>/   # Inductor's own cache (C++ kernels), kept with ours,
                                       # checksummed too (see compilation/kernel_cache.py); one
                                       # per PyTorch CPU capability (inductor_cache_subdir)
    <root>/native/                     # the native CPU kernels' shared libraries
                                       # (kernels/cpu/native_linear.py), checksummed the same way

``<hash10>`` covers the engine config hash, the torch version, the traced source files, the
compiler identity and what decides the vector ISA Inductor writes CPU kernels for
(``vec_isa.cpu_codegen_key``). Unlike the reference, a user-supplied ``cache_dir`` is also keyed by that
hash (a stale cache is never loaded after a code or config change), paths in the index are
relative (a moved cache tree still loads), every entry is verified against its checksum, and
any unreadable entry is logged once and recompiled instead of crashing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch

from forwardkit import envs
from forwardkit.compilation.counters import compilation_counter
from forwardkit.compilation.kernel_cache import record_kernel_cache, verify_kernel_cache
from forwardkit.logger import init_logger

__all__ = [
    "CacheDirError",
    "CompileCache",
    "UnsafeCacheDirError",
    "cache_enabled",
    "check_private_dir",
    "code_hash",
    "compile_cache_root",
    "inductor_cache_dir",
    "native_kernel_dir",
    "prepare_compile_cache",
]

logger = init_logger(__name__)

SaveFormat = Literal["binary", "unpacked"]
SAVE_FORMATS: tuple[SaveFormat, ...] = ("binary", "unpacked")


class UnsafeCacheDirError(PermissionError):
    """The cache directory could be written by another user; artifacts are code, so it is refused."""


class CacheDirError(ValueError):
    """The compile-cache directory cannot be created or written; the message names the setting
    it came from (``compilation_config.cache_dir`` or ``FORWARDKIT_CACHE_ROOT``)."""


def compile_cache_root(cache_dir: str | None) -> tuple[str, str]:
    """``(absolute cache root, the setting that chose it)``: ``compilation_config.cache_dir``
    when set, else ``FORWARDKIT_CACHE_ROOT`` (default ``~/.cache/forwardkit``)."""
    if cache_dir:
        return os.path.abspath(os.path.expanduser(cache_dir)), "compilation_config.cache_dir"
    return os.path.abspath(os.path.expanduser(envs.FORWARDKIT_CACHE_ROOT)), "FORWARDKIT_CACHE_ROOT"


def prepare_compile_cache(compilation_config: Any) -> str | None:
    """Create and check the compile-cache root before anything is built, so a bad
    ``cache_dir`` fails at start-up with the setting's name (:class:`CacheDirError`, or
    :class:`UnsafeCacheDirError` for a directory others can write). Returns the root, or None
    when this config compiles without the cache (not mode 3, the ``eager`` backend, or the
    cache switched off)."""
    cc = compilation_config
    if int(cc.mode or 0) != 3 or cc.backend == "eager":
        return None
    if not cache_enabled(dict(cc.inductor_compile_config)):
        return None
    root, source = compile_cache_root(cc.cache_dir)
    _make_private_dirs(root, root, source)
    return root


def cache_enabled(inductor_config: dict[str, Any] | None = None) -> bool:
    """False when FORWARDKIT_DISABLE_COMPILE_CACHE=1 or Inductor caches are force-disabled."""
    if envs.FORWARDKIT_DISABLE_COMPILE_CACHE:
        return False
    if torch._inductor.config.force_disable_caches:
        return False
    return not (inductor_config or {}).get("force_disable_caches", False)


_COMPILE_CACHE_REMEDY = ("point FORWARDKIT_CACHE_ROOT / compilation_config.cache_dir at a private "
                         "directory, or set FORWARDKIT_DISABLE_COMPILE_CACHE=1")


def check_private_dir(path: str, remedy: str = _COMPILE_CACHE_REMEDY) -> None:
    """Raise :class:`UnsafeCacheDirError` unless ``path`` is owned by us and not group/other-writable.
    ``remedy`` ends the message: the settings that lead elsewhere for this directory's user."""
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheDirError(
            f"refusing to use compile cache directory {path!r} (mode {oct(stat.S_IMODE(st.st_mode))}, "
            f"owner uid {st.st_uid}): another user could write to it, and cached artifacts are "
            f"executable code. Run `chmod go-w {path}` (as its owner), or {remedy}."
        )


def _cache_dir_error(source: str, root: str, path: str, exc: OSError) -> CacheDirError:
    reason = exc.strerror or type(exc).__name__
    return CacheDirError(
        f"{source}={root!r} cannot hold the compile cache: creating {path!r} failed ({reason}); "
        f"accepted: a directory this user can create and write (it is made with mode 0700), "
        f"or FORWARDKIT_DISABLE_COMPILE_CACHE=1 to compile without the cache"
    )


def _make_private_dirs(root: str, leaf: str, source: str = "cache root",
                       remedy: str = _COMPILE_CACHE_REMEDY) -> None:
    """Create ``leaf`` below ``root`` level by level (mode 0o700), checking each level first
    (:func:`check_private_dir`, whose message ends with ``remedy``). A level that cannot be
    created is a :class:`CacheDirError` naming ``source``."""
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except OSError as e:
        raise _cache_dir_error(source, root, root, e) from e
    if not os.path.isdir(root):
        raise _cache_dir_error(source, root, root, NotADirectoryError(20, "Not a directory"))
    check_private_dir(root, remedy)
    rel = os.path.relpath(leaf, root)
    path = root
    for part in [] if rel == "." else rel.split(os.sep):
        path = os.path.join(path, part)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise _cache_dir_error(source, root, path, e) from e
        check_private_dir(path, remedy)


def native_kernel_dir() -> str:
    """``<root>/native`` (``root`` from :func:`compile_cache_root` without a ``cache_dir``, i.e.
    ``FORWARDKIT_CACHE_ROOT``): where ``kernels/cpu/native_linear.py`` builds its shared libraries.
    Created owner-only and checked level by level like the compile cache's directories:
    :class:`UnsafeCacheDirError` when another user could write to it or to the root,
    :class:`CacheDirError` when it cannot be created. The kernels are process-wide, built
    outside any engine config, so a per-engine ``compilation_config.cache_dir`` does not move
    them."""
    root, source = compile_cache_root(None)
    leaf = os.path.join(root, "native")
    _make_private_dirs(root, leaf, source, remedy="point FORWARDKIT_CACHE_ROOT at a private "
                       "directory, or turn the native kernels' custom ops off "
                       "(compilation_config.custom_ops '-cpu_linear', '-cpu_attention')")
    return leaf


def code_hash(files: Iterable[str]) -> str:
    """SHA-256 over the sorted traced source files (name and content; generated names only by name)."""
    h = hashlib.sha256()
    for path in sorted(set(files)):
        h.update(path.encode() + b"\n")
        if path.startswith("<") or not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                h.update(f.read())
        except OSError as e:  # unreadable: hash the name only
            logger.warning_once("cannot read traced file %s for the cache key: %s", path, e)
    return h.hexdigest()


def inductor_cache_subdir() -> str:
    """The directory under ``<root>/inductor_cache/`` for this process's PyTorch CPU capability
    (``cpu_avx512``, ``cpu_avx2``, ...). Inductor writes a CPU kernel's C++ for the vector ISA
    that capability picks, and its FX-graph cache keeps that source without the ISA in its key:
    loaded under another capability (``ATEN_CPU_CAPABILITY=avx2`` in one run, not in the next)
    the source is built for wider vectors than it was written for and writes past its buffers.
    One directory per capability keeps them apart."""
    import torch

    return "cpu_" + str(torch.backends.cpu.get_cpu_capability()).lower()


@contextlib.contextmanager
def inductor_cache_dir(path: str | None) -> Iterator[None]:
    """Point Inductor's own cache (kernels, FX graphs) at ``path`` for the duration of the block."""
    if path is None:
        yield
        return
    os.makedirs(path, mode=0o700, exist_ok=True)
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def _checksum(path: str) -> tuple[str, int]:
    """SHA-256 and byte size of a file, or of a directory's files (names + contents, sorted)."""
    h = hashlib.sha256()
    size = 0
    if os.path.isdir(path):
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                h.update(os.path.relpath(full, path).encode() + b"\0")
                with open(full, "rb") as f:
                    data = f.read()
                h.update(data)
                size += len(data)
    else:
        with open(path, "rb") as f:
            data = f.read()
        h.update(data)
        size = len(data)
    return h.hexdigest(), size


class CompileCache:
    """Artifacts of one model (one backend) under its rank-local directory."""

    INDEX = "index.json"

    def __init__(self, root: str, local_dir: str, save_format: str = "binary",
                 source: str = "cache root") -> None:
        if save_format not in SAVE_FORMATS:
            raise ValueError(
                f"compile_cache_save_format={save_format!r} is not supported; use one of {SAVE_FORMATS}"
            )
        self.root, self.local_dir = root, local_dir
        self.save_format: SaveFormat = "unpacked" if save_format == "unpacked" else "binary"
        _make_private_dirs(root, local_dir, source)
        self.inductor_dir = os.path.join(root, "inductor_cache", inductor_cache_subdir())
        _make_private_dirs(root, self.inductor_dir, source)
        verify_kernel_cache(self.inductor_dir)  # Inductor's kernels get the same checksum rule
        self._lock_path = os.path.join(local_dir, ".lock")

    @staticmethod
    def key_dir(root: str, factors: dict[str, Any]) -> str:
        """``<root>/torch_compile_cache/<first 10 hex of sha256(factors)>``."""
        digest = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:10]
        return os.path.join(root, "torch_compile_cache", digest)

    @contextlib.contextmanager
    def locked(self, exclusive: bool = True) -> Iterator[None]:
        """Hold the directory's fcntl lock (exclusive for writers, shared for readers)."""
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _read_index(self) -> dict[str, dict[str, Any]]:
        path = os.path.join(self.local_dir, self.INDEX)
        if not os.path.exists(path):
            return {}
        try:
            with open(path) as f:
                data = json.load(f)
            entries = data["entries"]
            if not isinstance(entries, dict):
                raise TypeError("entries is not an object")
            return entries
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._fault(f"index {path} is unreadable ({e}); starting a new one")
            return {}

    def _write_atomic(self, path: str, text: str) -> None:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:  # a failed write leaves the old file and no stray temporary
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def write_metadata(self, name: str, text: str) -> None:
        """Write a human-readable file (key factors, graph dump) atomically, once."""
        path = os.path.join(self.local_dir, name)
        if not os.path.exists(path):
            self._write_atomic(path, text)

    def _fault(self, message: str) -> None:
        compilation_counter.num_cache_errors += 1
        logger.warning_once("compile cache: %s", message)

    def lookup(self, name: str) -> str | None:
        """Absolute path of a verified entry ``name``, or None (missing or corrupt: logged once).

        Callers hold the lock (shared is enough).
        """
        entry = self._read_index().get(name)
        if entry is None:
            return None
        path = os.path.join(self.local_dir, entry.get("path", name))
        if not os.path.exists(path):
            self._fault(f"entry {name} is listed but {path} is missing; recompiling")
            return None
        try:
            digest, size = _checksum(path)
        except OSError as e:
            self._fault(f"entry {name} cannot be read ({e}); recompiling")
            return None
        if digest != entry.get("sha256") or size != entry.get("size"):
            self._fault(f"entry {name} failed its checksum (truncated or corrupt); recompiling")
            return None
        if entry.get("format") != self.save_format or entry.get("torch") != torch.__version__:
            return None
        return path

    def load(self, name: str, loader: Any) -> Any | None:
        """``loader(path)`` on a verified entry; None (and a logged fault) if anything fails."""
        # The shared lock keeps a concurrent writer from swapping the entry mid-load.
        with self.locked(exclusive=False):
            path = self.lookup(name)
            if path is None:
                compilation_counter.num_cache_misses += 1
                return None
            try:
                with inductor_cache_dir(self.inductor_dir):
                    result = loader(path)
            except Exception as e:  # an unloadable artifact is a cache miss, never a crash
                self._fault(f"entry {name} could not be loaded ({type(e).__name__}: {e}); recompiling")
                compilation_counter.num_cache_misses += 1
                return None
        compilation_counter.num_cache_hits += 1
        self._record_kernels()
        return result

    def _record_kernels(self) -> None:
        try:
            record_kernel_cache(self.inductor_dir)
        except OSError as e:  # only the next start's check is weaker
            logger.warning_once("Inductor kernel cache: could not record checksums (%s)", e)

    def save(self, name: str, saver: Any) -> None:
        """``saver(tmp_path)`` writes the artifact; it is renamed into place and indexed atomically."""
        tmp = tempfile.mkdtemp(dir=self.local_dir, prefix=".tmp-")
        try:
            staged = os.path.join(tmp, name)
            saver(staged)
            digest, size = _checksum(staged)
            final = os.path.join(self.local_dir, name)
            with self.locked(exclusive=True):
                if os.path.isdir(final) and not os.path.islink(final):
                    shutil.rmtree(final)
                os.replace(staged, final)
                index = self._read_index()
                index[name] = {
                    "path": name,
                    "sha256": digest,
                    "size": size,
                    "format": self.save_format,
                    "torch": torch.__version__,
                }
                self._write_atomic(
                    os.path.join(self.local_dir, self.INDEX),
                    json.dumps({"version": 1, "entries": index}, indent=2, sort_keys=True),
                )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        compilation_counter.num_compiled_artifacts_saved += 1
        compilation_counter.num_cache_entries_updated += 1
        self._record_kernels()
