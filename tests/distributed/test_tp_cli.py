"""``forwardkit generate -tp 2``: started alone (the driver spawns its TP worker) and under
torchrun (two processes, one replica): the same tokens as tp=1, printed once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from forwardkit.distributed.launch import find_free_port

pytestmark = pytest.mark.distributed

ARGS = ["generate", "--prompt-token-ids", "1,2,3", "--prompt-token-ids", "7,8", "--max-tokens",
        "5", "--enforce-eager", "--output", "ids"]


def _run(tmp_path, prefix: list[str], extra: list[str]) -> list[str]:
    proc = subprocess.run([sys.executable, *prefix, "-m", "forwardkit.cli", *ARGS, *extra],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def test_generate_tp2_alone_and_under_torchrun_prints_the_tp1_tokens_once(tmp_path):
    one = _run(tmp_path, [], [])
    assert len(one) == 2 and all(len(line.split(",")) == 5 for line in one)
    assert _run(tmp_path, [], ["-tp", "2"]) == one
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(find_free_port())]
    assert _run(tmp_path, torchrun, ["-tp", "2"]) == one  # TP rank 1 prints nothing
