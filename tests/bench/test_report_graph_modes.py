"""The bench's graph-mode column: steps per CUDA-graph runtime mode, in the table and JSON."""

from __future__ import annotations

from forwardkit.bench.report import BenchReport, ContenderResult


def test_graph_modes_column_and_json():
    fk = ContenderResult("forwardkit", startup_s=1.0, step_ms=[1.0, 2.0, 3.0, 4.0],
                         step_tokens=[1, 2, 40, 3], padded_tokens=[1, 2, 40, 4],
                         step_modes=["FULL", "FULL", "NONE", "PIECEWISE"])
    eager = ContenderResult("eager", startup_s=1.0, step_ms=[2.0], step_tokens=[1], padded_tokens=[1])
    report = BenchReport({"eager": eager, "forwardkit": fk}, "cuda", "abc", "mixed")
    assert fk.graph_modes == {"FULL": 2, "NONE": 1, "PIECEWISE": 1}
    data = report.to_json()["contenders"]
    assert data["forwardkit"]["graph_modes"] == {"FULL": 2, "NONE": 1, "PIECEWISE": 1}
    assert data["eager"]["graph_modes"] == {}
    lines = report.format_table().splitlines()
    assert lines[0].endswith("graph modes (steps)")
    assert lines[2].endswith("  -")  # eager: no modes recorded
    assert lines[3].endswith("FULL 2/NONE 1/PIECEWISE 1")
