"""``forwardkit config``: printed output, --json, one-line errors, and the console script."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from forwardkit.cli import main
from forwardkit.commands.config import padding_runs

S256 = [1, 2, 4, *range(8, 257, 8)]


def test_text_output_cuda_o3(capsys):
    assert main(["config", "--platform", "cuda", "-O3"]) == 0
    out = capsys.readouterr().out
    lines = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out.splitlines())
    assert lines["optimization level"] == "O3"
    assert lines["platform"] == "cuda"
    assert lines["mode"] == "VLLM_COMPILE (3)"
    assert lines["cudagraph mode"] == "FULL_AND_PIECEWISE"
    assert lines["capture sizes"] == str(S256)
    assert lines["max capture size"] == "256"
    assert lines["padding"].startswith("1->1, 2->2, 3-4->4, 5-8->8, 9-16->16, 17-24->24")
    assert lines["padding"].endswith("249-256->256")
    assert lines["compile ranges"] == "(1, 2048)"
    assert "forwardkit::unified_attention" in lines["splitting ops"]
    assert lines["custom ops"] == "['none']"
    assert len(lines["hash"]) == 10


def test_json_output(capsys):
    assert main(["config", "--platform", "cuda", "--max-num-seqs", "4", "-O.cudagraph_mode=FULL", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cudagraph_mode"] == "FULL" and info["mode"] == "VLLM_COMPILE"
    assert info["cudagraph_capture_sizes"] == [1, 2, 4, 8]
    assert info["padding"] == [[1, 1, 1], [2, 2, 2], [3, 4, 4], [5, 8, 8]]
    assert info["compile_ranges"] == [[1, 2048]]
    assert info["optimization_level"] == "O2" and info["platform"] == "cuda"
    assert info["compilation_config"]["cudagraph_mode"] == "FULL"


def test_cpu_and_eager(capsys):
    assert main(["config", "--platform", "cpu", "--enforce-eager"]) == 0
    out = capsys.readouterr().out
    assert "O0" in out and "none (no CUDA graphs)" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["config", "-cc", "{bad"], "not valid JSON"),
        (["config", "-O.nope=1"], "unknown compilation-config key 'nope'"),
        (["config", "-O9"], "invalid optimization level"),
        (["config", "--platform", "cuda", "-O.max_cudagraph_capture_size=0"], "Maximum cudagraph size"),
        # Used to hang building a 1e8-entry padding table.
        (["config", "--platform", "cuda", "--max-num-batched-tokens", "100000000",
          "-O.max_cudagraph_capture_size=100000000"], "max_cudagraph_capture_size must be <= 65536"),
        (["config", "-O.compile_sizes=[0]"], "compile_sizes entries must be sizes >= 1"),
        (["config", "-cc.pass_config.fi_allreduce_fusion_max_size_mb", "Infinity", "-tp", "2",
          "--platform", "cuda"], "fi_allreduce_fusion_max_size_mb must be a finite number"),
        (["config", "-O.compile_sizes=" + "[" * 5000 + "]" * 5000], "nested"),
    ],
)
def test_bad_values_one_line(argv, needle, capsys):
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_bad_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["config", "--no-such-flag"])
    assert info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--data-parallel-size",
                 "--enforce-eager", "--block-size", "--platform", "--optimization-level", "--compilation-config",
                 "--json"):
        assert flag in out


def test_padding_runs():
    assert padding_runs(None) == []
    assert padding_runs([0, 1, 2, 4, 4, 8, 8, 8, 8]) == [(1, 1, 1), (2, 2, 2), (3, 4, 4), (5, 8, 8)]


def test_console_script():
    exe = shutil.which("forwardkit")
    cmd = [exe] if exe else [sys.executable, "-m", "forwardkit.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORWARDKIT_DP_")}
    ok = subprocess.run([*cmd, "config", "--platform", "cuda", "-O", "1", "--json"], capture_output=True,
                        text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    info = json.loads(ok.stdout)
    assert info["cudagraph_mode"] == "PIECEWISE" and info["optimization_level"] == "O1"
    bad = subprocess.run([*cmd, "config", "-cc", "{bad"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode != 0
    assert len(bad.stderr.strip().splitlines()) == 1 and "not valid JSON" in bad.stderr


def test_huge_token_budget_keeps_per_size_structures_small(capsys):
    assert main(["config", "--platform", "cuda", "--max-num-batched-tokens", "100000000",
                 "-O.max_cudagraph_capture_size=65536", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["max_cudagraph_capture_size"] == 65536 and info["padding"][-1] == [65521, 65536, 65536]


@pytest.mark.parametrize("eager", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_printed_hash_is_the_engine_hash_after_the_model_is_built(capsys, eager):
    from forwardkit.engine import LLM

    flags = ["--enforce-eager"] if eager else []  # not eager: O2, mode 3, compiled at start-up
    assert main(["config", "--platform", "cpu", *flags, "--max-num-seqs", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["hash"]
    llm = LLM(enforce_eager=eager, max_num_seqs=2, platform="cpu")
    llm.generate(prompt_token_ids=[[1, 2, 3]], use_tqdm=False)
    cc = llm.engine_config.compilation_config
    assert cc.enabled_custom_ops or cc.disabled_custom_ops  # counters were filled
    assert llm.engine_config.compute_hash() == printed
