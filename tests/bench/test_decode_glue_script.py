"""benchmarks/decode_glue.py: a decode step's glue timed with the native linear, a no-op and a
copy of the weights in its place."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from forwardkit.kernels.cpu import native_linear

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "decode_glue.py"


@pytest.mark.skipif(not native_linear.available(), reason="needs the native bf16 linear kernel "
                    "(a CPU with AVX2 + FMA or AVX-512 and a C compiler)")
def test_times_every_setting_per_batch():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shape", "default", "--batches", "1", "2",
                           "--context", "8", "--rounds", "1"], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [(r[0], r[1]) for r in rows] == [(b, s) for b in ("1", "2")
                                            for s in ("kernel", "no-op", "memmove")]
    for r in rows:
        step, inside, rest = map(float, r[2:5])
        assert step > 0 and inside >= 0 and rest > 0
    # every product of a step went through the substituted function, in every setting
    for b in ("1", "2"):
        served = {int(r[5]) for r in rows if r[0] == b}
        assert len(served) == 1 and served.pop() > 0


def test_bad_counts_are_refused_with_the_values():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--batches", "1", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--batches must be >= 1, got 1 0" in proc.stderr
