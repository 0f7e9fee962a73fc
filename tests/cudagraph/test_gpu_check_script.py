"""``scripts/gpu_check.sh --dry-run``: the prepared GPU check runs its steps on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def test_script_parses():
    assert subprocess.run(["bash", "-n", SCRIPT], check=False).returncode == 0


@pytest.mark.slow
def test_dry_run_prints_one_summary_table(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, MODEL_SHAPE="llama-3.2-1b")
    out = subprocess.run(
        ["bash", SCRIPT, "--dry-run", "--skip-tests", "--steps", "2", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    summary = out.stdout[out.stdout.index("gpu_check (dry run, CPU)"):].splitlines()
    contenders = [line[18:52].strip() for line in summary[3:] if line.startswith("built-in")]
    assert contenders == ["eager", "torch.compile(reduce-overhead)", "forwardkit PIECEWISE",
                          "forwardkit FULL_DECODE_ONLY", "forwardkit FULL_AND_PIECEWISE"]
    # the real-shape row is skipped with a reason (no --model-shape, or too big for a CPU dry run)
    assert any(line.startswith("note: llama-3.2-1b: skipped") for line in summary)
    # each bench run left its JSON, with the per-step graph modes (NONE on the CPU)
    data = json.loads((tmp_path / "built-in-PIECEWISE.json").read_text())
    assert data["contenders"]["forwardkit"]["graph_modes"] == {"NONE": 2}
