"""benchmarks/llm_startup.py: fresh-process start-up of LLM, with its figures as JSON per run."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "llm_startup.py"


def test_child_reports_each_phase_of_a_start():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--child", "--model-shape", "default",
                           "--prompt-len", "4"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(figures) == {"import_s", "llm_s", "first_token_s", "total_s"}
    assert all(v > 0 for v in figures.values())
    parts = figures["import_s"] + figures["llm_s"] + figures["first_token_s"]
    assert abs(parts - figures["total_s"]) < 1e-6


def test_bad_counts_are_refused_with_the_values():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--repeat", "0"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--repeat must be >= 1, got 64 and 0" in proc.stderr
