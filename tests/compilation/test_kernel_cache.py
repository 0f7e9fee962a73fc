"""Inductor's kernel files under ``<root>/inductor_cache/`` are checksummed like forwardkit's own
artifacts: a truncated compiled kernel is removed and rebuilt (logged once) instead of crashing
the next start (``dlopen`` of a truncated ``.so`` dies with SIGBUS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from forwardkit.compilation.counters import compilation_counter
from forwardkit.compilation.kernel_cache import MANIFEST, record_kernel_cache, verify_kernel_cache

WORKER = os.path.join(os.path.dirname(__file__), "cache_worker.py")


def _run(root: str, size: str) -> tuple[dict, str]:
    env = {**os.environ, "FORWARDKIT_CACHE_ROOT": root}
    env.pop("FORWARDKIT_DISABLE_COMPILE_CACHE", None)
    out = subprocess.run([sys.executable, WORKER, size, "1201"], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_corrupt_kernel_file_is_removed_with_its_siblings(tmp_path):
    d = tmp_path / "inductor_cache"
    (d / "ab").mkdir(parents=True)
    (d / "ab" / "kern.main.so").write_bytes(b"\x7fELF" + b"x" * 100)
    (d / "ab" / "kern.main.cpp").write_text("int main() {}")
    (d / "ab" / "other.py").write_text("X = 1\n")
    assert record_kernel_cache(str(d)) == 3
    assert verify_kernel_cache(str(d), force=True) == []  # intact: nothing removed
    os.truncate(d / "ab" / "kern.main.so", 10)
    with compilation_counter.expect(num_cache_errors=1):
        assert verify_kernel_cache(str(d), force=True) == [os.path.join("ab", "kern.main.so")]
    assert sorted(os.listdir(d / "ab")) == ["other.py"]
    manifest = json.loads((d / MANIFEST).read_text())
    assert list(manifest) == [os.path.join("ab", "other.py")]
    (d / "ab" / "new.py").write_text("Y = 2\n")  # first seen: trusted and recorded
    assert verify_kernel_cache(str(d), force=True) == [] and record_kernel_cache(str(d)) == 1


@pytest.mark.slow
def test_truncated_compiled_kernel_recompiles_with_the_same_output(tmp_path):
    root = str(tmp_path / "cache")
    os.mkdir(root, 0o700)
    first, _ = _run(root, "5")
    kernels = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(root, "inductor_cache"))
               for f in fs if f.endswith(".so")]
    assert kernels, "Inductor compiled no C++ kernel"
    victim = sorted(kernels)[0]
    os.truncate(victim, os.path.getsize(victim) // 3)
    second, log = _run(root, "5")
    assert second["max_err"] == first["max_err"] and second["max_err"] < 1e-5
    assert second["counters"]["num_cache_errors"] == 1, second["counters"]
    assert log.count("failed its checksum") == 1
    assert os.path.getsize(victim) > 0  # rebuilt
