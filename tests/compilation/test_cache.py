"""Compile cache: round trips, every fault recompiles instead of crashing, concurrency, permissions."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys

import pytest

from forwardkit.compilation.cache import CompileCache, UnsafeCacheDirError, cache_enabled
from forwardkit.compilation.counters import compilation_counter


def _write(data: bytes):
    def saver(path: str) -> None:
        with open(path, "wb") as f:
            f.write(data)

    return saver


def _put(path: str, data: str | bytes) -> None:
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def _json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def cache(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    return CompileCache(str(root), str(root / "torch_compile_cache" / "abc" / "rank_0_0" / "backbone"))


def test_round_trip_counts_a_hit(cache):
    assert cache.load("a", _read) is None
    cache.save("a", _write(b"artifact-a"))
    with compilation_counter.expect(num_cache_hits=1, num_cache_errors=0):
        assert cache.load("a", _read) == b"artifact-a"
    index = _json(os.path.join(cache.local_dir, "index.json"))
    assert index["entries"]["a"]["path"] == "a"  # relative: the tree can move


@pytest.mark.parametrize("fault", ["truncate", "flip", "delete", "unloadable"])
def test_faults_are_detected_and_recompiled(cache, fault, caplog):
    cache.save("a", _write(b"0123456789" * 10))
    path = os.path.join(cache.local_dir, "a")
    loader = _read
    if fault == "truncate":
        os.truncate(path, 37)
    elif fault == "flip":
        data = bytearray(_read(path))
        data[5] ^= 0xFF
        _put(path, bytes(data))
    elif fault == "delete":
        os.remove(path)
    else:
        def loader(p):
            raise RuntimeError("torch key mismatch")

    with compilation_counter.expect(num_cache_errors=1, num_cache_misses=1, num_cache_hits=0):
        assert cache.load("a", loader) is None
    cache.save("a", _write(b"fresh"))  # what the compiler does next
    assert cache.load("a", _read) == b"fresh"


def test_moved_tree_still_loads_and_moved_entry_recompiles(cache, tmp_path):
    cache.save("a", _write(b"A"))
    cache.save("b", _write(b"B"))
    new_root = tmp_path / "moved"
    shutil.move(cache.root, new_root)
    local = os.path.join(new_root, os.path.relpath(cache.local_dir, cache.root))
    moved = CompileCache(str(new_root), local)
    assert moved.load("a", _read) == b"A"
    os.rename(os.path.join(local, "b"), os.path.join(local, "b.elsewhere"))
    with compilation_counter.expect(num_cache_errors=1):
        assert moved.load("b", _read) is None


def test_unpacked_directories_are_checksummed(tmp_path):
    root = tmp_path / "r"
    root.mkdir(mode=0o700)
    c = CompileCache(str(root), str(root / "x"), "unpacked")

    def saver(path):
        os.makedirs(os.path.join(path, "fxgraph"))
        _put(os.path.join(path, "fxgraph", "g.py"), "print(1)")

    c.save("d", saver)
    assert c.load("d", lambda p: sorted(os.listdir(p))) == ["fxgraph"]
    _put(os.path.join(c.local_dir, "d", "fxgraph", "g.py"), "print(2)")
    assert c.load("d", lambda p: "loaded") is None
    with pytest.raises(ValueError, match="'zip'"):
        CompileCache(str(root), str(root / "y"), "zip")


def test_group_writable_dir_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeCacheDirError, match="writable by other users|another user could write"):
        CompileCache(str(root), str(root / "sub"))
    os.chmod(root, 0o700)
    leaf = root / "sub"
    leaf.mkdir(mode=0o700)
    os.chmod(leaf, 0o775)
    with pytest.raises(UnsafeCacheDirError, match="chmod go-w"):
        CompileCache(str(root), str(leaf))


def test_disable_env(monkeypatch):
    assert cache_enabled()
    monkeypatch.setenv("FORWARDKIT_DISABLE_COMPILE_CACHE", "1")
    assert not cache_enabled()
    monkeypatch.setenv("FORWARDKIT_DISABLE_COMPILE_CACHE", "0")
    assert not cache_enabled({"force_disable_caches": True})


_HAMMER_ROUNDS = 30
# Every value either writer stores; a load (under the shared lock) sees one of them whole.
_WRITTEN = {tag * (1000 + i) for tag in (b"x", b"y") for i in range(_HAMMER_ROUNDS)}


def _hammer(root: str, local: str, tag: bytes, barrier) -> None:
    c = CompileCache(root, local)
    barrier.wait()
    for i in range(_HAMMER_ROUNDS):
        c.save("shared", _write(tag * (1000 + i)))
        data = c.load("shared", _read)  # an AssertionError makes the exit code non-zero
        assert data in _WRITTEN, f"loaded {None if data is None else data[:8] + b'...'!r}"


def test_concurrent_writers_leave_one_consistent_entry(cache):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_hammer, args=(cache.root, cache.local_dir, t, barrier)) for t in (b"x", b"y")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with compilation_counter.expect(num_cache_errors=0, num_cache_hits=1):
        data = cache.load("shared", _read)
    assert data in (b"x" * 1029, b"y" * 1029)
    assert not [f for f in os.listdir(cache.local_dir) if f.startswith(".tmp-")]


# ---------------------------------------------------------------- real Inductor artifacts
WORKER = os.path.join(os.path.dirname(__file__), "cache_worker.py")


def _piece_env() -> dict[str, str]:
    """The environment with AOT precompile off: these tests count piece artifacts only (the AOT
    entry, another cache entry, has its own tests in test_aot.py)."""
    return {**os.environ, "FORWARDKIT_USE_AOT_COMPILE": "0"}


def _run(*args: str, env=None) -> dict:
    out = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True,
                         timeout=600, env=env or _piece_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_second_process_loads_without_compiling_and_survives_corruption():
    first = _run("5", "1001")
    assert first["max_err"] < 1e-5
    second = _run("6", "1001")
    c = second["counters"]
    assert c["num_inductor_compiles"] == 0 and c["num_cache_hits"] == 2, c
    assert second["max_err"] < 1e-5
    # corrupt one artifact: detected, recompiled, right answer
    local = second["local_cache_dir"]
    index = _json(os.path.join(local, "index.json"))["entries"]
    victim = os.path.join(local, sorted(index)[0])
    os.truncate(victim, os.path.getsize(victim) // 2)
    third = _run("7", "1001")
    c = third["counters"]
    assert c["num_cache_errors"] == 1 and c["num_inductor_compiles"] == 1 and c["num_cache_hits"] == 1, c
    assert third["max_err"] < 1e-5


@pytest.mark.slow
def test_two_processes_on_a_cold_cache_both_succeed():
    procs = [subprocess.Popen([sys.executable, WORKER, str(n), "1002"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_piece_env()) for n in (5, 6)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["max_err"] < 1e-5 for r in results)
    after = _run("9", "1002")
    c = after["counters"]
    assert c["num_inductor_compiles"] == 0 and c["num_cache_hits"] == 2 and c["num_cache_errors"] == 0, c


def test_disabling_cpu_linear_changes_the_cache_key(tmp_path):
    """Whether linear layers call ``forwardkit::linear`` is decided by ``custom_ops`` (the
    ``cpu_linear`` op) and changes the traced graph, so it must change the key under which
    compiled pieces are stored: ``custom_ops`` is a hash factor of the compilation config."""
    from forwardkit.compilation.backend import ForwardkitBackend
    from forwardkit.config.engine import EngineConfig

    def key_dir(custom_ops: list[str]) -> str:
        config = EngineConfig(compilation_config={"mode": 3, "custom_ops": custom_ops})
        backend = ForwardkitBackend(config)
        return CompileCache.key_dir(str(tmp_path), backend._cache_factors())

    on, off = key_dir([]), key_dir(["-cpu_linear"])
    assert on != off
    assert key_dir([]) == on  # the key is stable otherwise


def test_the_cpu_vector_isa_inductor_writes_for_changes_the_cache_keys(tmp_path, monkeypatch):
    """A saved piece holds its kernels' C++ source, compiled again where it is loaded for the
    vector ISA Inductor picks there. ``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 CPU makes
    Inductor write 8-lane code; built for 16 lanes that source wrote past its buffers (a
    ``double free or corruption`` abort, seen on an AVX2 stand-in's artifact loaded by a plain
    run). So PyTorch's CPU capability is a factor of the piece cache's key and of the AOT
    entry's."""
    import torch

    from forwardkit.compilation.aot import AotEntry
    from forwardkit.compilation.backend import ForwardkitBackend
    from forwardkit.config.engine import EngineConfig

    monkeypatch.setenv("FORWARDKIT_CACHE_ROOT", str(tmp_path))
    config = EngineConfig(compilation_config={"mode": 3})

    def keys() -> tuple[str, str]:
        piece = CompileCache.key_dir(str(tmp_path), ForwardkitBackend(config)._cache_factors())
        module = torch.nn.Linear(2, 2)
        entry = AotEntry(module, module.forward, config, "backbone", "fingerprint")
        return piece, entry.cache.local_dir

    native = keys()
    assert keys() == native  # stable otherwise
    lowered = "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "DEFAULT"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: lowered)
    other = keys()
    assert other[0] != native[0] and other[1] != native[1]


class _DiskFull:
    """A text file whose write stores the first half of the text, then fails (ENOSPC)."""

    def __init__(self, f) -> None:
        self._f = f

    def write(self, text: str) -> int:
        self._f.write(text[: len(text) // 2])
        self._f.flush()
        raise OSError(28, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_index_write_that_fails_midway_leaves_the_previous_index_whole(cache, monkeypatch):
    """The index is written to a temporary file and renamed over the old one: a write that
    fails half-way (disk full, a killed process) leaves the previous index intact and no
    stray temporary file. Written in place, the index would be half a JSON document."""
    import builtins

    import forwardkit.compilation.cache as cache_mod

    cache.save("a", _write(b"artifact-a"))
    index_path = os.path.join(cache.local_dir, "index.json")
    before = _read(index_path)
    real_open, real_fdopen = builtins.open, os.fdopen

    def failing_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return _DiskFull(f) if "w" in mode and "b" not in mode else f

    def failing_fdopen(fd, mode="r", *args, **kwargs):
        f = real_fdopen(fd, mode, *args, **kwargs)
        return _DiskFull(f) if "w" in mode and "b" not in mode else f

    monkeypatch.setattr(cache_mod, "open", failing_open, raising=False)
    monkeypatch.setattr(os, "fdopen", failing_fdopen)
    with pytest.raises(OSError, match="No space left"):
        cache.save("b", _write(b"artifact-b"))
    monkeypatch.undo()
    assert _read(index_path) == before
    assert [n for n in os.listdir(cache.local_dir) if n.startswith(".tmp-")] == []
    with compilation_counter.expect(num_cache_errors=0):
        assert cache.load("a", _read) == b"artifact-a"
        assert cache.load("b", _read) is None  # renamed into place but never indexed


def test_index_is_replaced_not_rewritten(cache):
    """A reader that opened the index before a save keeps reading the whole old index (the save
    renames a new file over it instead of truncating the one being read)."""
    cache.save("a", _write(b"artifact-a"))
    index_path = os.path.join(cache.local_dir, "index.json")
    with open(index_path) as held:
        cache.save("b", _write(b"artifact-b"))
        assert set(json.load(held)["entries"]) == {"a"}
    assert set(_json(index_path)["entries"]) == {"a", "b"}
