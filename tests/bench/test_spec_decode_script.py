"""benchmarks/spec_decode.py in draft-model mode: the draft checkpoint it writes from the
target's own weights makes draft = target accept every draft (the upper bound it reports)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "spec_decode.py"
QUICK = ["--model-shape", "default", "-k", "3", "--new-tokens", "12", "--repeats", "1",
         "--enforce-eager", "--context", "16"]


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(SCRIPT.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("repetitive", "random"):
            rows[cells[0]] = cells
    return rows


def test_draft_equal_to_target_accepts_every_draft():
    proc = _run(*QUICK, "--method", "draft_model")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    assert set(rows) == {"repetitive", "random"}
    for cells in rows.values():
        assert cells[4] == "100%"  # acceptance
        assert float(cells[5]) > 2.0  # tokens emitted per verification (k = 3, cut at the end)
        assert float(cells[6]) > 0  # proposal ms per verify step: the draft's steps
    assert "draft_model, draft default with 4 layers, k=3" in proc.stdout


def test_a_cut_draft_runs_and_bad_layers_are_refused():
    proc = _run(*QUICK, "--method", "draft_model", "--draft-layers", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    assert set(rows) == {"repetitive", "random"}
    assert all(0 <= float(cells[4].rstrip("%")) <= 100 for cells in rows.values())
    assert "draft default with 1 layers" in proc.stdout
    bad = _run(*QUICK, "--method", "draft_model", "--draft-layers", "9")
    assert bad.returncode != 0 and "--draft-layers must be in 1..4 for default, got 9" in bad.stderr
