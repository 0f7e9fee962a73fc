"""``forwardkit generate -tp 2``: started alone (the driver spawns its TP worker) and under
torchrun (two processes, one replica): the same tokens as tp=1, printed once, computed by two
processes that each built a runner holding about half of the weights (a probe loaded through
``sitecustomize`` records every runner a process builds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forwardkit.distributed.launch import find_free_port

pytestmark = pytest.mark.distributed

ARGS = ["generate", "--prompt-token-ids", "1,2,3", "--prompt-token-ids", "7,8", "--max-tokens",
        "5", "--enforce-eager", "--output", "ids"]


# Loaded by every Python process of the run (the CLI, its TP worker, torchrun's ranks): after
# forwardkit.engine.tp is imported, its build_runner is wrapped to write one JSON line per
# runner built: the process id and the bytes of weights the runner holds.
PROBE = """
import importlib.abc, importlib.util, json, os, sys

class _Probe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "forwardkit.engine.tp":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            build = module.build_runner

            def build_runner(engine_config):
                runner = build(engine_config)
                held = sum(p.nbytes for p in runner.module.parameters())
                with open(os.environ["FK_RUNNER_PROBE"], "a") as f:
                    f.write(json.dumps({"pid": os.getpid(), "bytes": held}) + "\\n")
                return runner

            module.build_runner = build_runner

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Probe())
"""


def _run(tmp_path: Path, prefix: list[str], extra: list[str]) -> tuple[list[str], list[dict]]:
    """The printed completions and one record per runner any process of the run built."""
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir(exist_ok=True)
    (probe_dir / "sitecustomize.py").write_text(PROBE)
    records = tmp_path / f"runners-{len(list(tmp_path.glob('runners-*')))}.jsonl"
    env = {**os.environ, "FK_RUNNER_PROBE": str(records),
           "PYTHONPATH": os.pathsep.join([str(probe_dir), *filter(None, [
               os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, *prefix, "-m", "forwardkit.cli", *ARGS, *extra],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = [json.loads(line) for line in records.read_text().splitlines()]
    return proc.stdout.split(), built


def test_generate_tp2_alone_and_under_torchrun_prints_the_tp1_tokens_once(tmp_path):
    one, (whole,) = _run(tmp_path, [], [])  # tp=1: one process built one runner
    assert len(one) == 2 and all(len(line.split(",")) == 5 for line in one)
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(find_free_port())]
    for prefix in ([], torchrun):  # alone (the driver spawns its worker), under torchrun
        out, built = _run(tmp_path, prefix, ["-tp", "2"])
        assert out == one  # the same tokens, printed once (TP rank 1 prints nothing)
        # two processes, each with its own runner holding its share: about half of the
        # weights (norm scales are replicated), never the whole model
        assert len(built) == 2 and built[0]["pid"] != built[1]["pid"], built
        for rank in built:
            assert whole["bytes"] / 2 <= rank["bytes"] < 0.6 * whole["bytes"], (rank, whole)
