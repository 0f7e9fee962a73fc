"""``forwardkit bench`` fits the model and says what it uses: the trace stays within the
model's positions and ``--max-model-len``, ``--help`` shows the defaults used, errors name the
flag to change, flags a mode would ignore are refused, and the bandwidth probe runs once with
``--quick`` (or not at all)."""

from __future__ import annotations

import json

import pytest
import torch

from forwardkit.bench.trace import make_trace
from forwardkit.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> str:
    """A tiny Llama with max_position_embeddings=128 (below the trace's usual contexts)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("short"))
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("name", ["decode-heavy", "prefill-heavy", "mixed"])
def test_trace_stays_within_max_len(name):
    for limit in (2, 64, 128, 300):
        steps = make_trace(name, 200, seed=3, max_tokens=512, max_len=limit)
        assert max(q + c for s in steps for q, c in zip(s.query_lens, s.context_lens)) <= limit
    assert make_trace(name, 40, seed=3) == make_trace(name, 40, seed=3, max_len=None)


@pytest.mark.parametrize("extra", [(), ("--max-model-len", "64")])
def test_quick_bench_on_a_short_model(capsys, short_model, tmp_path, extra):
    out = tmp_path / "b.json"
    code, _, err = _run(capsys, "bench", "--quick", "--model", short_model, "--contenders", "eager",
                        "--no-progress", "--json", str(out), *extra)
    assert code == 0, err
    assert "index out of range" not in err
    data = json.loads(out.read_text())
    assert data["contenders"]


def test_file_trace_beyond_the_model_names_the_flag(capsys, short_model, tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps([{"query_lens": [1], "context_lens": [200]}]))
    code, _, err = _run(capsys, "bench", "--model", short_model, "--trace", str(trace),
                        "--contenders", "eager", "--no-progress")
    assert code == 2 and "beyond the model's max_model_len 128" in err and "--max-model-len" in err


def test_help_shows_the_defaults_used(capsys):
    code, out, _ = _run(capsys, "bench", "--help")
    flat = " ".join(out.split())
    assert "most tokens per step (default 512; with --generation the engine's 2048" in flat
    assert "most requests per step (default 64; with --generation the largest --batch-sizes" in flat
    steps = make_trace("prefill-heavy", 100, max_tokens=512)
    assert max(s.num_tokens for s in steps) == 512


def test_too_big_file_step_names_the_flag(capsys, tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps([600]))
    code, _, err = _run(capsys, "bench", "--trace", str(trace), "--no-progress")
    assert code == 2 and "--max-num-batched-tokens 512" in err


@pytest.mark.parametrize(("argv", "match"), [
    (("--profile",), "--profile needs --generation"),
    (("--batch-sizes", "1,2"), "--batch-sizes needs --generation"),
    (("--prompt-len", "8"), "--prompt-len needs --generation"),
    (("--generation", "--steps", "4"), "--steps is a step-trace flag"),
])
def test_flags_a_mode_ignores_are_refused(capsys, argv, match):
    code, _, err = _run(capsys, "bench", *argv)
    assert code == 2 and match in err


def test_steps_with_a_file_trace_is_refused(capsys, tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text("[4, 8]")
    code, _, err = _run(capsys, "bench", "--trace", str(trace), "--steps", "3")
    assert code == 2 and "--steps sets the length of a built-in trace" in err


def test_prompt_len_beyond_the_model_names_prompt_len(capsys, short_model):
    code, _, err = _run(capsys, "bench", "--generation", "--model", short_model, "--prompt-len",
                        "500", "--contenders", "eager", "--no-progress")
    assert code == 2 and "--prompt-len" in err and "max_position_embeddings (128)" in err
    assert "max_model_len (505)" not in err
    code, _, err = _run(capsys, "bench", "--generation", "--model", short_model, "--prompt-len",
                        "60", "--max-model-len", "32", "--contenders", "eager", "--no-progress")
    assert code == 2 and "do not fit --max-model-len 32" in err


@pytest.mark.parametrize(("argv", "measures", "probes"), [
    (("--quick",), 1, 0),                                   # measured once
    (("--quick", "--bandwidth-probe", "off"), 0, 0),        # skipped
    (("--quick", "--bandwidth-probe", "per-run"), 1, 1),    # one probe object, re-run per run
    (("--batch-sizes", "1", "--repeats", "1", "--prompt-len", "4"), 1, 0),  # once without --quick
])
def test_bandwidth_probe_once_per_bench_and_skippable(capsys, monkeypatch, tmp_path, short_model,
                                                      argv, measures, probes):
    from forwardkit.bench import generation as gen

    calls = {"measure": 0, "probe": 0}

    def measure(*args, **kwargs):
        calls["measure"] += 1
        return 20e9

    class Probe:
        def __init__(self, gib: float = 1.0) -> None:
            calls["probe"] += 1

        def probe(self, repeats: int = 2) -> float:
            return 20e9

    monkeypatch.setattr(gen, "measure_stream_bandwidth", measure)
    monkeypatch.setattr(gen, "StreamProbe", Probe)
    out = tmp_path / "g.json"
    if "--quick" not in argv:
        argv = (*argv, "--model", short_model)
    code, printed, err = _run(capsys, "bench", "--generation", *argv, "--contenders", "eager",
                              "--no-progress", "--new-tokens", "2", "--json", str(out))
    assert code == 0, err
    assert (calls["measure"], calls["probe"]) == (measures, probes)
    data = json.loads(out.read_text())
    assert (data["stream_gb_s"] is None) == (measures == 0)
    assert ("BW use" in printed) == (measures == 1)


def test_generation_takes_the_engines_token_budget_so_a_batch_prefills_in_one_step():
    """--generation leaves max_num_batched_tokens to the engine (2048): 16 prompts of 64 tokens
    prefill in one step, as llama.cpp takes them in one pass, not in two 512-token steps that
    leave half the batch a step behind for all its decode. A budget given is kept; one below
    the largest batch is an error naming both flags. The step trace keeps 64 / 512."""
    import argparse

    from forwardkit.bench.generation_cli import _engine_config, _settings
    from forwardkit.commands import bench
    from forwardkit.config.model_shapes import model_shape_config

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        bench.register(parser.add_subparsers())
        return parser.parse_args(["bench", *argv])

    hf = model_shape_config("default")
    args = parse("--generation", "--batch-sizes", "1,16", "--prompt-len", "64")
    sched = _engine_config("forwardkit", args, hf, _settings(args)).scheduler_config
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (16, 2048)
    args = parse("--generation", "--batch-sizes", "16", "--max-num-batched-tokens", "256")
    assert _engine_config("forwardkit", args, hf, _settings(args)).scheduler_config.max_num_batched_tokens == 256
    args = parse("--generation", "--batch-sizes", "16", "--max-num-batched-tokens", "8")
    with pytest.raises(ValueError, match="--max-num-batched-tokens 8 is below the largest --batch-sizes 16"):
        _engine_config("forwardkit", args, hf, _settings(args))
    steps = make_trace("prefill-heavy", 100, max_tokens=bench.TRACE_BATCH_LIMITS[1])
    assert max(s.num_tokens for s in steps) == 512 == bench.TRACE_BATCH_LIMITS[1]
