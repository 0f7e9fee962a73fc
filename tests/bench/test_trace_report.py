"""Bench traces and report arithmetic (no model runs here)."""

from __future__ import annotations

import json
import math

import pytest

from forwardkit.bench.report import BenchReport, ContenderResult, percentile
from forwardkit.bench.trace import BUILTIN_TRACES, Step, load_trace, make_trace


@pytest.mark.parametrize("name", BUILTIN_TRACES)
def test_builtin_traces_respect_budget_and_are_deterministic(name):
    trace = make_trace(name, 64, seed=3, max_tokens=256)
    assert len(trace) == 64
    assert all(1 <= s.num_tokens <= 256 for s in trace)
    assert all(len(s.query_lens) == len(s.context_lens) for s in trace)
    assert trace == make_trace(name, 64, seed=3, max_tokens=256)
    decodes = sum(s.is_decode for s in trace)
    if name == "decode-heavy":
        assert decodes >= 48
    elif name == "prefill-heavy":
        assert decodes <= 24


def test_unknown_trace_name():
    with pytest.raises(ValueError, match="unknown trace 'bursty'"):
        make_trace("bursty", 4)


def test_json_trace(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([3, 100, {"query_lens": [5, 1], "context_lens": [0, 9]}]))
    steps = load_trace(str(path), num_steps=0)
    assert steps[0] == Step((1, 1, 1), (128, 128, 128))
    assert steps[1] == Step((100,), (0,))
    assert steps[2] == Step((5, 1), (0, 9))


@pytest.mark.parametrize(
    "content, match",
    [
        ("[0]", "step 0 has 0 tokens"),
        ('["x"]', "expected a token count"),
        ('[{"query_lens": []}]', "must have 'query_lens'"),
        ("{}", "non-empty JSON list"),
        ("[1,", "not valid JSON"),
        ("[4096]", "above --max-num-batched-tokens 512"),
    ],
)
def test_json_trace_errors(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_trace(str(path), num_steps=0, max_tokens=512)


def test_missing_trace_file():
    with pytest.raises(ValueError, match="neither a built-in trace"):
        load_trace("/nonexistent/trace.json", 4)


def test_percentile():
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0], 100) == 2.0
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    assert math.isnan(percentile([], 50))


def test_report_figures_are_consistent(tmp_path):
    eager = ContenderResult("eager", startup_s=0.5, step_ms=[4.0, 6.0, 5.0], step_tokens=[1, 8, 64],
                            padded_tokens=[1, 8, 64])
    fast = ContenderResult("forwardkit", startup_s=9.0, step_ms=[2.0, 3.0, 2.5], step_tokens=[1, 8, 64],
                           padded_tokens=[1, 8, 80])
    report = BenchReport({"eager": eager, "forwardkit": fast}, "cpu", "abc", "decode-heavy")
    data = report.to_json()
    fk = data["contenders"]["forwardkit"]
    assert fk["median_step_ms"] == 2.5
    assert fk["speedup_vs_eager"] == pytest.approx(5.0 / 2.5)
    assert fk["tokens_per_s"] == pytest.approx(73 / 7.5e-3)
    assert fk["padded_fraction"] == pytest.approx(16 / 89)
    assert data["contenders"]["eager"]["speedup_vs_eager"] == 1.0
    table = report.format_table()
    assert "forwardkit" in table and "2.00x" in table
    out = tmp_path / "r.json"
    report.write_json(str(out))
    assert json.loads(out.read_text())["trace"] == "decode-heavy"
