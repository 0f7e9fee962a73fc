"""Integrity of Inductor's own kernel cache under ``<root>/inductor_cache/``.

Inductor writes generated sources and compiled kernels (``*.cpp``, ``*.so``, ``*.py``) there
and reuses any file that exists by name; a truncated ``.so`` is loaded with ``dlopen`` and
crashes the process (SIGBUS) before Python can catch anything. So the same rule as for
forwardkit's own artifacts applies: every file is checksummed.

``<root>/inductor_cache/.forwardkit_manifest.json`` maps each file (relative path) to its
SHA-256 and size. :func:`verify_kernel_cache` (once per process and directory, before the first
load or compile) removes every file whose content no longer matches, together with the files
of the same kernel (same name stem, e.g. its ``.cpp`` next to the ``.so``), so Inductor
rebuilds them; each removal is logged once and counted in ``num_cache_errors``.
:func:`record_kernel_cache` adds new files after a compile or load. A file seen for the first
time is trusted and recorded (another rank sharing the root may have just written it).
Both run under an exclusive ``fcntl`` lock on the directory.

The same manifest (file name ``MANIFEST``, entries ``{relative path: [sha256, size]}``) guards
files a caller builds itself, one at a time, in a directory of its own (the native kernels'
``<root>/native/``): under :func:`manifest_lock`, :func:`check_file` before a file is used and
:func:`record_file` after it is written. There a file the manifest does not list is not
trusted: only the caller writes that directory, so an unlisted file is removed and rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator

from forwardkit.compilation.counters import compilation_counter
from forwardkit.logger import init_logger

__all__ = ["MANIFEST", "check_file", "manifest_lock", "record_file", "record_kernel_cache",
           "verify_kernel_cache"]

logger = init_logger(__name__)

MANIFEST = ".forwardkit_manifest.json"
_LOCK = ".forwardkit_manifest.lock"
_verified: set[str] = set()
_mutex = threading.Lock()


@contextlib.contextmanager
def manifest_lock(directory: str) -> Iterator[None]:
    """Hold the exclusive ``fcntl`` lock of ``directory``'s manifest (blocks other processes and
    other threads; not re-entrant)."""
    fd = os.open(os.path.join(directory, _LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _files(directory: str) -> Iterator[str]:
    """Relative paths of the regular files Inductor keeps (our own and lock/temp files left out)."""
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        for name in sorted(filenames):
            if name.startswith(".") or name.endswith((".lock", ".tmp")):
                continue
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                yield os.path.relpath(full, directory)


def _digest(path: str) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def _read(directory: str) -> dict[str, list]:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            data = json.load(f)
        return {k: v for k, v in data.items() if isinstance(v, list) and len(v) == 2}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, AttributeError) as e:
        logger.warning_once("Inductor kernel cache: manifest %s unreadable (%s); starting a new one", path, e)
        return {}


def _write(directory: str, manifest: dict[str, list]) -> None:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-manifest-")
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, sort_keys=True)
    os.replace(tmp, os.path.join(directory, MANIFEST))


def _remove_kernel(directory: str, rel: str, manifest: dict[str, list]) -> None:
    """Remove ``rel`` and the files next to it with the same stem (the same kernel)."""
    folder, name = os.path.split(rel)
    stem = name.split(".")[0]
    for other in os.listdir(os.path.join(directory, folder)):
        if other.split(".")[0] == stem:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.remove(os.path.join(directory, folder, other))
            manifest.pop(os.path.join(folder, other), None)


def check_file(directory: str, rel: str, what: str) -> bool:
    """Whether ``rel`` (a regular file under ``directory``) matches its manifest entry, SHA-256
    and size. A file that does not match, that the manifest does not list, or that is not a
    regular file is removed (logged once with ``what``, counted in ``num_cache_errors``) so the
    caller rebuilds it; False then, and when there is no file. The caller holds
    :func:`manifest_lock`."""
    full = os.path.join(directory, rel)
    if not os.path.lexists(full):
        return False
    manifest = _read(directory)
    expected = manifest.get(rel)
    actual = None
    if os.path.isfile(full) and not os.path.islink(full):
        with contextlib.suppress(OSError):
            actual = list(_digest(full))
    if expected is not None and actual == expected:
        return True
    os.remove(full)
    if manifest.pop(rel, None) is not None:
        _write(directory, manifest)
    compilation_counter.num_cache_errors += 1
    reason = ("is not in the manifest" if expected is None
              else "failed its checksum (truncated or corrupt)")
    logger.warning_once("%s: %s %s; removed it so it is rebuilt", what, full, reason)
    return False


def record_file(directory: str, rel: str) -> None:
    """Record ``rel``'s SHA-256 and size in ``directory``'s manifest (written atomically) after
    the caller wrote the file. The caller holds :func:`manifest_lock`."""
    manifest = _read(directory)
    manifest[rel] = list(_digest(os.path.join(directory, rel)))
    _write(directory, manifest)


def verify_kernel_cache(directory: str, force: bool = False) -> list[str]:
    """Remove kernel files whose checksum no longer matches the manifest (once per process and
    directory unless ``force``); returns the removed paths. Never raises for a bad file."""
    directory = os.path.abspath(directory)
    with _mutex:
        if directory in _verified and not force:
            return []
        _verified.add(directory)
    if not os.path.isdir(directory):
        return []
    removed: list[str] = []
    with manifest_lock(directory):
        manifest = _read(directory)
        for rel in list(_files(directory)):
            expected = manifest.get(rel)
            full = os.path.join(directory, rel)
            if expected is None or not os.path.exists(full):
                continue
            try:
                actual = list(_digest(full))
            except OSError:
                actual = None
            if actual != expected:
                _remove_kernel(directory, rel, manifest)
                removed.append(rel)
        manifest = {rel: v for rel, v in manifest.items() if os.path.exists(os.path.join(directory, rel))}
        _write(directory, manifest)
    for rel in removed:
        compilation_counter.num_cache_errors += 1
        logger.warning_once("Inductor kernel cache: %s failed its checksum (truncated or corrupt); "
                            "removed it so the kernel is recompiled", os.path.join(directory, rel))
    return removed


def record_kernel_cache(directory: str) -> int:
    """Add every file not yet in the manifest (after a compile or load); returns how many."""
    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        return 0
    added = 0
    with manifest_lock(directory):
        manifest = _read(directory)
        for rel in _files(directory):
            if rel in manifest:
                continue
            try:
                manifest[rel] = list(_digest(os.path.join(directory, rel)))
            except OSError:
                continue
            added += 1
        if added:
            _write(directory, manifest)
    return added
