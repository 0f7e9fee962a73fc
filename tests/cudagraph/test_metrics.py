"""CUDA-graph usage metrics table (vLLM's CUDAGraphLogging format)."""

from __future__ import annotations

import dataclasses

import pytest

from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.cudagraph.metrics import CUDAGraphLogging, CUDAGraphStat

EXPECTED_TABLE = """**CUDAGraph Config Settings:**

- Mode: FULL_AND_PIECEWISE
- Capture sizes: [1, 2, 4, 8]

**CUDAGraph Stats:**

| Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | Count |
|-----------------|---------------|--------------|--------------|-------|
| 3               | 4             | 1            | FULL         | 3     |
| 7               | 8             | 1            | PIECEWISE    | 1     |
| 600             | 600           | 0            | NONE         | 1     |
"""


def observed() -> CUDAGraphLogging:
    log = CUDAGraphLogging(CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4, 8])
    for stat in [(3, 4, 1, "FULL"), (3, 4, 1, "FULL"), (7, 8, 1, "PIECEWISE"), (600, 600, 0, "NONE"), (3, 4, 1, "FULL")]:
        log.observe(CUDAGraphStat(*stat))
    return log


def test_metric_table_exact():
    assert observed().generate_metric_table() == EXPECTED_TABLE


def test_log_emits_table_once_and_resets():
    log, seen = observed(), []
    log.log(seen.append)
    assert seen == [EXPECTED_TABLE]
    log.log(seen.append)
    assert len(seen) == 1 and log.stats == []


def test_wide_cells_widen_columns_and_empty_sizes():
    log = CUDAGraphLogging("NONE", None)
    log.observe(CUDAGraphStat(123456789012345678, 123456789012345678, 0, "NONE"))
    table = log.generate_metric_table()
    assert "- Capture sizes: []" in table
    assert "| 123456789012345678 | 123456789012345678 | 0            | NONE         | 1     |" in table
    assert "|--------------------|--------------------|" in table


def test_stat_is_frozen_and_hashable():
    stat = CUDAGraphStat(3, 4, 1, "FULL")
    assert hash(stat) == hash(CUDAGraphStat(3, 4, 1, "FULL"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        stat.num_paddings = 2  # type: ignore[misc]


def test_observe_rejects_other_types():
    with pytest.raises(TypeError, match="expects a CUDAGraphStat, got tuple"):
        CUDAGraphLogging(CUDAGraphMode.FULL, [1]).observe((3, 4, 1, "FULL"))
