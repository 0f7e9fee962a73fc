"""``forwardkit bench -tp N``: the step trace on N tensor-parallel ranks, and the generation
benchmark's tp=N contender beside tp=1 (per-rank weight bytes, decode tokens/s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed


def _cli(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "forwardkit.cli", *argv], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_step_trace_bench_on_two_tensor_parallel_ranks(tmp_path):
    out = tmp_path / "tp.json"
    proc = _cli(tmp_path, "bench", "-tp", "2", "--no-progress", "--steps", "4", "--warmup-steps",
                "1", "--contenders", "eager", "--json", str(out))
    data = json.loads(out.read_text())
    assert data["trace"] == "decode-heavy (rank 0 of 2)" and list(data["contenders"]) == ["eager"]
    assert data["contenders"]["eager"]["median_step_ms"] > 0
    assert "2 TP ranks (figures of rank 0)" in proc.stdout
    assert proc.stdout.count("forwardkit bench:") == 1  # only rank 0 reports
    assert "spawning 2 local ranks (1 data-parallel x 2 tensor-parallel" in proc.stderr


def test_generation_bench_reports_weights_per_rank_beside_tp1(tmp_path):
    out = tmp_path / "gen.json"
    proc = _cli(tmp_path, "bench", "--generation", "--quick", "--no-progress", "-tp", "2",
                "--contenders", "forwardkit", "--enforce-eager", "--batch-sizes", "1",
                "--new-tokens", "2", "--repeats", "1", "--json", str(out))
    data = json.loads(out.read_text())
    one, two = data["contenders"]["forwardkit"], data["contenders"]["forwardkit tp=2"]
    assert len(one["weight_bytes_per_rank"]) == 1 and len(two["weight_bytes_per_rank"]) == 2
    full = one["weight_bytes_per_rank"][0]
    # each rank holds its half of every sharded weight; norms are replicated (a few KB)
    for rank_bytes in two["weight_bytes_per_rank"]:
        assert 0.5 * full <= rank_bytes <= 0.52 * full
    assert two["decode_tok_s"]["1"] > 0
    assert "forwardkit tp=2 vs forwardkit (tp=1): weights per rank 0.5" in proc.stdout
