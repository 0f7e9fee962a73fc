"""Where the native few-row linear is built and what is loaded from there: a private directory
under the cache root, checked before use, and a SHA-256 manifest that every ``.so`` must match
before it is handed to ``dlopen`` (see ``kernels/cpu/native_linear.py``)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import stat
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from forwardkit.compilation import kernel_cache
from forwardkit.compilation.cache import native_kernel_dir
from forwardkit.compilation.counters import compilation_counter
from forwardkit.kernels.cpu import native_build, native_linear

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(
    not any(native_linear.isa_supported(isa, BF16) for isa in ("avx512", "avx2")),
    reason="the CPU has neither AVX-512-BF16 nor AVX2+FMA (the native kernel's instructions)")


@pytest.fixture
def root(monkeypatch, tmp_path):
    """A fresh cache root for this test; the kernel loader re-run under it, and again after."""
    cache_root = tmp_path / "cache"
    monkeypatch.setenv("FORWARDKIT_CACHE_ROOT", str(cache_root))
    native_linear.cache_clear()
    yield cache_root
    native_linear.cache_clear()


def _manifest(directory: Path) -> dict:
    path = directory / kernel_cache.MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


def _entry(data: bytes) -> list:
    return [hashlib.sha256(data).hexdigest(), len(data)]


@pytest.fixture
def loads(monkeypatch):
    """The bytes of every native build handed to ``dlopen``. A file that does not match its
    manifest entry is refused here (never loaded: a truncated library can crash the process),
    so a missing check fails the test instead."""
    seen: list[bytes] = []
    real = ctypes.CDLL

    def spy(name, *args, **kwargs):
        path = Path(name)
        if path.suffix == ".so" and path.parent.name == "native":
            data = path.read_bytes()
            if _manifest(path.parent).get(path.name) != _entry(data):
                raise AssertionError(f"{path} handed to dlopen without a matching manifest entry")
            seen.append(data)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(native_linear.ctypes, "CDLL", spy)
    return seen


def _built(root: Path) -> Path:
    (path,) = (root / "native").glob("linear_few_rows*.so")
    return path


def _put(path: Path, data: bytes) -> None:
    """Write ``path`` as a new file: this process has the old one mapped (loaded), and writing
    that in place would change the running code under it."""
    tmp = path.with_name(".test-" + path.name)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _products_match(dtype: torch.dtype = BF16) -> None:
    """1- and 2-row products through the public entry point against F.linear."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 70, generator=gen).to(dtype)
    b = torch.randn(24, generator=gen).to(dtype)
    for rows in (1, 2):
        x = torch.randn(rows, 70, generator=gen).to(dtype)
        out = native_linear.linear_rows(x, w, b)
        assert out is not None
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()),
                                   rtol=2e-2, atol=2e-2)


def _warnings(records) -> list[str]:
    return [r.getMessage() for r in records if r.levelname == "WARNING"]


def test_build_is_recorded_in_a_private_directory(root, loads):
    assert native_linear.available()
    so = _built(root)
    assert stat.S_IMODE(os.stat(root / "native").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    data = so.read_bytes()
    assert _manifest(root / "native") == {so.name: _entry(data)}
    assert loads == [data]
    _products_match()


def _damaged_build_is_rebuilt(root, loads, records, damage, reason: str) -> None:
    assert native_linear.available()
    so = _built(root)
    bad = damage(so.read_bytes())
    _put(so, bad)
    native_linear.cache_clear()
    loads.clear()
    errors = compilation_counter.num_cache_errors
    assert native_linear.available()  # rebuilt, then loaded
    assert _built(root) == so and so.read_bytes() != bad
    assert loads == [so.read_bytes()]
    assert compilation_counter.num_cache_errors == errors + 1
    said = _warnings(records)
    assert len(said) == 1 and str(so) in said[0] and reason in said[0], said
    _products_match()


def test_tampered_build_is_rebuilt_not_loaded(root, loads, fk_log_records):
    # the last bytes are section headers, which dlopen ignores: such a file would load and run
    _damaged_build_is_rebuilt(root, loads, fk_log_records,
                              lambda data: data[:-16] + bytes(b ^ 0xFF for b in data[-16:]),
                              "failed its checksum")


def test_truncated_build_is_rebuilt(root, loads, fk_log_records):
    _damaged_build_is_rebuilt(root, loads, fk_log_records, lambda data: data[: len(data) // 2],
                              "failed its checksum")


def test_build_missing_from_manifest_is_rebuilt(root, loads, fk_log_records):
    assert native_linear.available()
    so = _built(root)
    (root / "native" / kernel_cache.MANIFEST).write_text("{}")  # e.g. left by an older version
    native_linear.cache_clear()
    loads.clear()
    errors = compilation_counter.num_cache_errors
    assert native_linear.available()
    assert loads == [so.read_bytes()]
    assert _manifest(root / "native") == {so.name: _entry(so.read_bytes())}
    assert compilation_counter.num_cache_errors == errors + 1
    said = _warnings(fk_log_records)
    assert len(said) == 1 and str(so) in said[0] and "not in the manifest" in said[0], said


@pytest.mark.parametrize(("where", "mode"), [("native", 0o770), ("native", 0o777), ("root", 0o757)],
                         ids=["group-writable", "world-writable", "world-writable-root"])
def test_writable_build_directory_turns_the_kernel_off(root, loads, fk_log_records, where, mode,
                                                       assert_linear_falls_back):
    assert native_linear.available()  # a good build is there: it must not be loaded either
    unsafe = root / "native" if where == "native" else root
    os.chmod(unsafe, mode)
    try:
        native_linear.cache_clear()
        loads.clear()
        for dtype in (BF16, torch.float32):
            assert not native_linear.available(dtype)
        assert loads == []
        said = _warnings(fk_log_records)
        assert len(said) == 1 and repr(str(unsafe)) in said[0] and oct(mode) in said[0], said
        assert_linear_falls_back(7)
    finally:
        os.chmod(unsafe, 0o700)


def test_verified_build_loads_without_a_compiler(root, loads, monkeypatch):
    assert native_linear.available()
    so = _built(root)
    good, stamp = so.read_bytes(), so.stat().st_mtime_ns
    monkeypatch.setattr(native_build.shutil, "which", lambda *args, **kwargs: None)  # no $CC now
    native_linear.cache_clear()
    loads.clear()
    assert native_linear.available()
    assert so.stat().st_mtime_ns == stamp and loads == [good]
    _products_match()
    # ... but a damaged one is removed, not loaded, and the kernel is off
    _put(so, good[: len(good) // 2])
    native_linear.cache_clear()
    loads.clear()
    assert not native_linear.available()
    assert loads == [] and not so.exists()


def test_concurrent_builders_compile_once(root, loads, monkeypatch):
    """Two builders at once (threads here: each takes the manifest's flock on its own open file,
    which excludes the other as another process's would): one compiles, the other loads its
    verified build."""
    isa = next(i for i in ("avx512", "avx2") if native_linear.isa_supported(i, BF16))
    directory = Path(native_kernel_dir())
    compiles = []
    real = native_linear.KERNEL.compile

    def counting(*args):
        compiles.append(args)
        real(*args)

    monkeypatch.setattr(native_linear.KERNEL, "compile", counting)
    loaded_before = len(loads)
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def build() -> None:
        try:
            start.wait()
            native_linear.KERNEL.load(directory, isa)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == [] and len(compiles) == 1
    so = next(directory.glob(f"{native_linear.KERNEL.source_of(isa).stem}-*.so"))
    assert _manifest(directory) == {so.name: _entry(so.read_bytes())}
    assert len(loads) == loaded_before + 2
