"""``forwardkit bench`` end to end on the built-in model, and its error paths."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest

from forwardkit.cli import main

KEYS = {"median_step_ms", "p99_step_ms", "tokens_per_s", "speedup_vs_eager", "startup_s",
        "recompiles", "padded_fraction"}


def _check_report(data: dict, contenders: list[str]) -> None:
    assert set(data) >= {"contenders", "platform", "config_hash", "trace"}
    assert data["platform"] == "cpu"
    assert list(data["contenders"]) == contenders
    eager = data["contenders"].get("eager")
    for name, figures in data["contenders"].items():
        assert set(figures) >= KEYS, name
        assert figures["median_step_ms"] > 0 and figures["p99_step_ms"] >= figures["median_step_ms"]
        assert figures["tokens_per_s"] > 0 and figures["startup_s"] > 0
        assert 0.0 <= figures["padded_fraction"] < 1.0
        if eager is not None:
            ratio = eager["median_step_ms"] / figures["median_step_ms"]
            assert figures["speedup_vs_eager"] == pytest.approx(ratio)
    if "forwardkit" in data["contenders"]:
        assert data["contenders"]["forwardkit"]["recompiles"] == 0


@pytest.mark.slow
def test_bench_quick_json_and_plot(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--quick", "--no-progress", "--json", str(out)]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(tmp_path / "bench.png")]
    except ImportError:
        pass
    assert main(argv) == 0
    data = json.loads(out.read_text())
    _check_report(data, ["eager", "torch.compile", "forwardkit"])
    assert data["trace"] == "decode-heavy"
    printed = capsys.readouterr().out
    assert "vs eager" in printed and "forward time by padded batch size (forwardkit" in printed
    if "--plot" in argv:
        assert (tmp_path / "bench.png").stat().st_size > 1000


@pytest.mark.distributed
def test_bench_two_dp_ranks(tmp_path):
    out = tmp_path / "dp.json"
    assert main(["bench", "--quick", "--no-progress", "-dp", "2", "--steps", "6",
                 "--warmup-steps", "1", "--contenders", "eager,forwardkit", "-O.mode=0",
                 "--trace", "mixed", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    _check_report(data, ["eager", "forwardkit"])
    assert data["trace"] == "mixed (rank 0 of 2)"


@pytest.mark.distributed
def test_bench_dbo_contender_on_two_dp_ranks(tmp_path, capsys):
    trace = tmp_path / "trace.json"  # the same steps on both ranks, all above the thresholds
    trace.write_text(json.dumps([16, 24, {"query_lens": [1] * 8 + [24], "context_lens": [30] * 9}]))
    out = tmp_path / "dbo.json"
    assert main(["bench", "--no-progress", "-dp", "2", "--warmup-steps", "0", "-O.mode=0",
                 "--contenders", "forwardkit,forwardkit+dbo", "--trace", str(trace),
                 "--dbo-decode-token-threshold", "8", "--dbo-prefill-token-threshold", "16",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    _check_report(data, ["forwardkit", "forwardkit+dbo"])
    plain, dbo = data["contenders"]["forwardkit"], data["contenders"]["forwardkit+dbo"]
    assert (plain["ubatched_steps"], dbo["ubatched_steps"]) == (0, 3)
    assert plain["mean_comm_wait_ms"] > 0 and dbo["mean_comm_wait_ms"] > 0
    assert "communication left exposed" in capsys.readouterr().out


def test_bench_json_trace_file(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([1, 8, {"query_lens": [40, 1], "context_lens": [0, 30]}]))
    out = tmp_path / "r.json"
    assert main(["bench", "--no-progress", "--trace", str(trace), "--contenders", "eager",
                 "--warmup-steps", "0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    _check_report(data, ["eager"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
        (["bench", "-cc", "{not json"], "--compilation-config is not valid JSON"),
        (["bench", "--model", "/nonexistent/model/dir"], "/nonexistent/model/dir"),
        (["bench", "--contenders", "eager,fast"], "unknown contender"),
        (["bench", "--trace", "bursty"], "neither a built-in trace"),
        (["bench", "--steps", "0"], "--steps must be >= 1"),
        (["bench", "--model-shape", "llama-9b"], "unknown model shape 'llama-9b'; accepted: ["),
        (["bench", "--model-shape", "default", "--model", "x"], "give --model or --model-shape, not both"),
        (["bench", "--contenders", "transformers"], "--contenders transformers needs --generation"),
        (["bench", "--contenders", "forwardkit+dbo"], "forwardkit+dbo needs the step trace on data-parallel"),
        (["bench", "--generation", "--batch-sizes", "0,4"], "expected comma-separated positive"),
        (["bench", "--generation", "--new-tokens", "0"], "--new-tokens must be >= 1"),
        (["bench", "-dp", "2", "--model-shape", "llama-3.2-1b"], "has no experts (try mixtral-small)"),
    ],
)
def test_bench_errors_are_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "forwardkit.cli", *argv], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line]
    assert len(lines) == 1, proc.stderr
    assert message in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.distributed
def test_bench_under_torchrun(tmp_path):
    from forwardkit.distributed.launch import find_free_port

    out = tmp_path / "torchrun.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(find_free_port()), "-m", "forwardkit.cli", "bench", "--no-progress", "-dp", "2",
         "--steps", "4", "--warmup-steps", "1", "--contenders", "eager", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    _check_report(data, ["eager"])
    assert data["trace"] == "decode-heavy (rank 0 of 2)"
    assert proc.stdout.count("forwardkit bench:") == 1  # only rank 0 reports


GEN_KEYS = {"startup_s", "ttft_ms", "prefill_tok_s", "decode_tok_s", "bandwidth_use", "weight_bytes_per_rank",
            "decode_speedup_vs_transformers"}


@pytest.mark.slow
def test_bench_generation_quick_json(tmp_path, capsys):
    """End-to-end generation on the built-in model: every contender, stable JSON keys."""
    out = tmp_path / "gen.json"
    assert main(["bench", "--generation", "--quick", "--no-progress", "--new-tokens", "3",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) >= {"model", "dtype", "batch_sizes", "prompt_len", "new_tokens", "stream_gb_s",
                         "weight_bytes_per_step", "machine", "contenders"}
    assert data["batch_sizes"] == [1, 4] and data["new_tokens"] == 3 and data["stream_gb_s"] > 0
    per_run = data["stream_gb_s_per_run"]  # re-measured before every timed run
    assert set(per_run) == {"min", "median", "max"} and 0 < per_run["min"] <= per_run["median"] <= per_run["max"]
    from forwardkit.bench.llamacpp import llamacpp_available

    expected = ["eager", "torch.compile", "forwardkit", "transformers"]
    assert list(data["contenders"]) == expected + (["llama.cpp"] if llamacpp_available() else [])
    for name, c in data["contenders"].items():
        assert set(c) == GEN_KEYS, name
        assert set(c["decode_tok_s"]) == {"1", "4"} and min(c["decode_tok_s"].values()) > 0
        # real timings: only their sign is machine-independent (the arithmetic from timings to
        # figures is checked with injected timings in test_generation_figures_from_timings)
        assert c["bandwidth_use"]["1"] > 0 and c["ttft_ms"] > 0 and c["startup_s"] > 0
    ref = data["contenders"]["transformers"]["decode_tok_s"]
    fk = data["contenders"]["forwardkit"]
    assert fk["decode_speedup_vs_transformers"]["4"] == pytest.approx(fk["decode_tok_s"]["4"] / ref["4"])
    printed = capsys.readouterr().out
    assert "BW use" in printed and "vs transformers" in printed and "streaming bandwidth" in printed


def test_generation_figures_from_timings(tmp_path, monkeypatch, capsys):
    """The report's figures from injected timings and bandwidths (no real timing, so the
    check holds on any machine): decode tokens/s, time to first token, prefill tokens/s and
    bandwidth use = weight bytes per step * new tokens / decode time / bandwidth."""
    from forwardkit.bench import generation as gen

    stream, roof, first = 25e9, 20e9, 0.05
    decode = {1: 0.3, 4: 0.6}  # seconds for the new tokens, per batch size

    class FixedProbe:
        def __init__(self, gib: float = 1.0) -> None:
            pass

        def probe(self, repeats: int = 2) -> float:
            return roof

    def fixed_timing(fn, prompts, new_tokens, tries=3):
        out = fn(prompts, 1 + new_tokens)  # the generation itself still runs
        assert all(len(o) == 1 + new_tokens for o in out)
        return first, first + decode[len(prompts)]

    monkeypatch.setattr(gen, "measure_stream_bandwidth", lambda *a, **k: stream)
    monkeypatch.setattr(gen, "StreamProbe", FixedProbe)
    monkeypatch.setattr(gen, "time_generation", fixed_timing)
    from forwardkit.bench import generation_cli

    build = generation_cli._build

    def fell_back(*args, **kwargs):  # as the llama.cpp contender after a probe crash
        fn, obj = build(*args, **kwargs)
        obj.extra_buffers_off = "a child process running it with them died by SIGSEGV"
        time.sleep(3.0)  # the probe's child, which is not the contender's start-up
        obj.probe_seconds = 3.0
        return fn, obj

    monkeypatch.setattr(generation_cli, "_build", fell_back)
    out = tmp_path / "gen.json"
    assert main(["bench", "--generation", "--quick", "--no-progress", "--new-tokens", "3",
                 "--contenders", "eager", "--bandwidth-probe", "per-run", "--dtype", "bfloat16",
                 "--json", str(out)]) == 0
    note = ("without its extra buffer types (AMX tiles, repacked rows): a child process running "
            "it with them died by SIGSEGV")
    printed = capsys.readouterr().out
    assert f"eager: {note}" in printed  # the fallback shows under the table
    assert "vs transformers" not in printed  # no such column without that contender
    data = json.loads(out.read_text())
    assert data["dtype"] == "bfloat16"  # named, not "bfloat16/float16" by its width
    assert data["contenders"]["eager"]["note"] == note
    assert 0 < data["contenders"]["eager"]["startup_s"] < 3.0  # the probe's seconds left out
    assert data["stream_gb_s"] == pytest.approx(25.0)
    assert data["stream_gb_s_per_run"] == pytest.approx({"min": 20.0, "median": 20.0, "max": 20.0})
    c = data["contenders"]["eager"]
    for b in ("1", "4"):
        seconds = decode[int(b)]
        assert c["decode_tok_s"][b] == pytest.approx(int(b) * 3 / seconds)
        assert c["bandwidth_use"][b] == pytest.approx(
            data["weight_bytes_per_step"][b] * 3 / seconds / roof)
    assert c["ttft_ms"] == pytest.approx(first * 1e3)
    assert c["prefill_tok_s"] == pytest.approx(4 * data["prompt_len"] / first)


@pytest.mark.slow
def test_bench_model_shape_runs_a_real_architecture(tmp_path):
    """--model-shape builds the named architecture (the small built-in MoE here, a few steps);
    the baselines run with every op native."""
    from forwardkit.bench.contenders import engine_config_for

    out = tmp_path / "shape.json"
    assert main(["bench", "--model-shape", "default-moe", "--no-progress", "--steps", "3",
                 "--warmup-steps", "0", "--contenders", "eager,forwardkit", "-O.mode=0",
                 "--json", str(out)]) == 0
    _check_report(json.loads(out.read_text()), ["eager", "forwardkit"])
    ns = argparse.Namespace(model=None, dtype=None, max_model_len=None, max_num_seqs=None,
                            max_num_batched_tokens=None, enable_chunked_prefill=None,
                            enforce_eager=False, compilation_config="3", engine_O=["3"],
                            block_size=None, platform="cpu", data_parallel_size=None)
    eager = engine_config_for("eager", ns, None, 8).compilation_config
    assert eager.mode == 0 and eager.custom_ops == ["none", "-cpu_linear", "-cpu_attention"]
    assert not eager.is_custom_op_enabled("cpu_linear")  # plain F.linear, as a user's model
    assert not eager.is_custom_op_enabled("cpu_attention")  # attention by torch ops, too
