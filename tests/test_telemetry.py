"""Batch-size telemetry of set_forward_context: recording, interval logging, stats."""

from __future__ import annotations

import logging
from collections import defaultdict
from types import SimpleNamespace as NS

import pytest

import forwardkit.forward_context as fc
from forwardkit import telemetry
from forwardkit.config.engine import EngineConfig
from forwardkit.platforms import CpuPlatform, use_platform

CFG = EngineConfig()


class FakeClock:
    """A perf_counter that only moves when the test says so."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def tracked(monkeypatch, cpu_platform):
    """Telemetry on (interval 10 s), a fresh sample store, a fake clock at 1000 s, captured log."""
    clock = FakeClock(1000.0)
    monkeypatch.setattr(fc, "time", NS(perf_counter=clock))
    monkeypatch.setattr(fc, "track_batchsize", True)
    monkeypatch.setattr(fc, "batchsize_logging_interval", 10.0)
    monkeypatch.setattr(fc, "last_logging_time", 0)
    monkeypatch.setattr(fc, "batchsize_forward_time", defaultdict(list))
    handler = ListHandler()
    log = logging.getLogger("forwardkit.forward_context")
    log.addHandler(handler)
    yield clock, handler.messages
    log.removeHandler(handler)


def run_step(clock: FakeClock, n: int | None, gap_s: float, duration_ms: float,
             attn_metadata: object = None) -> None:
    clock.now += gap_s
    md = {} if attn_metadata is None else attn_metadata
    with fc.set_forward_context(md, CFG, num_tokens=n):
        clock.now += duration_ms / 1000


# (n, gap s, duration ms, last_logging_time after, logged?)
STEPS = [
    (8, 0, 2, 1000.002, False),
    (8, 1, 4, 1000.002, False),
    (16, 1, 10, 1000.002, False),
    (8, 1, 3, 1000.002, False),
    (16, 1, 12, 1000.002, False),
    (4, 1, 1, 1000.002, False),
    (8, 9, 5, 1014.037, True),
    (16, 0.5, 11, 1014.037, False),
    (4, 0.5, 2, 1014.037, False),
]


def test_log_interval_sequence(tracked):
    clock, messages = tracked
    for i, (n, gap, dur, last_after, logged) in enumerate(STEPS):
        before = len(messages)
        run_step(clock, n, gap, dur)
        assert fc.last_logging_time == pytest.approx(last_after), f"row {i + 1}"
        assert (len(messages) > before) is logged, f"row {i + 1}"
    assert len(messages) == 1
    assert messages[0].startswith(
        "Batchsize forward time stats (batchsize, count, median_time(ms)): "
        "[(8, 4, 3.5), (16, 2, 11.0)]"
    )
    assert messages[0].endswith("p99_time(ms): [(8, 4.97), (16, 11.98)]")
    store = fc.batchsize_forward_time
    assert list(store) == [8, 16, 4]
    expected = {8: [2, 4, 3, 5], 16: [10, 12, 11], 4: [1, 2]}
    for size, times in expected.items():
        assert store[size] == pytest.approx(times)


def test_untracked_cases(tracked):
    clock, _ = tracked
    clock.now += 1
    with fc.set_forward_context(None, CFG, num_tokens=8):  # profile run: not timed
        clock.now += 0.003
    assert dict(fc.batchsize_forward_time) == {}
    run_step(clock, None, 1, 7)  # metadata without num_tokens: key None
    assert fc.batchsize_forward_time[None] == pytest.approx([7])


def test_tracking_off_records_nothing(tracked, monkeypatch):
    clock, messages = tracked
    monkeypatch.setattr(fc, "track_batchsize", False)
    for _ in range(3):
        run_step(clock, 8, 20, 1)
    assert dict(fc.batchsize_forward_time) == {}
    assert messages == []
    assert fc.get_batchsize_stats() == {}


def test_stats_api_and_reset(tracked):
    clock, _ = tracked
    for dur in (1, 2, 3, 4, 100):
        run_step(clock, 32, 0.1, dur)
    run_step(clock, 64, 0.1, 9)
    stats = fc.get_batchsize_stats()
    assert set(stats) == {32, 64}
    s32 = stats[32]
    assert s32["count"] == 5
    assert s32["median_ms"] == pytest.approx(3)
    assert s32["mean_ms"] == pytest.approx(22)
    assert s32["p99_ms"] == pytest.approx(4 + 96 * 0.96)  # linear interpolation at 0.99 * 4
    assert stats[64] == pytest.approx({"count": 1, "median_ms": 9, "p99_ms": 9, "mean_ms": 9})
    fc.reset_batchsize_stats()
    assert fc.get_batchsize_stats() == {}


def test_exception_still_records_and_restores(tracked):
    clock, _ = tracked
    with pytest.raises(RuntimeError), fc.set_forward_context({}, CFG, num_tokens=2):
        clock.now += 0.004
        raise RuntimeError("model failed")
    assert fc.batchsize_forward_time[2] == pytest.approx([4])
    assert not fc.is_forward_context_available()


def test_platform_synchronize_called_before_reading_clock(tracked):
    clock, _ = tracked
    calls: list[float] = []

    class SyncPlatform(CpuPlatform):
        @property
        def synchronize(self):
            def sync() -> None:
                calls.append(clock.now)
                clock.now += 0.001  # device work finishing counts toward the step
            return sync

    with use_platform(SyncPlatform()):
        run_step(clock, 8, 1, 2)
    assert len(calls) == 1
    assert fc.batchsize_forward_time[8] == pytest.approx([3])


def test_nested_tracked_contexts_time_themselves(tracked):
    clock, _ = tracked
    with fc.set_forward_context({}, CFG, num_tokens=100):
        clock.now += 0.001
        run_step(clock, 1, 0, 2)
        clock.now += 0.001
    assert fc.batchsize_forward_time[1] == pytest.approx([2])
    assert fc.batchsize_forward_time[100] == pytest.approx([4])


@pytest.mark.parametrize(
    ("samples", "q", "expected"),
    [([2, 4, 3, 5], 0.5, 3.5), ([10, 12, 11], 0.5, 11), ([1], 0.99, 1), ([0, 100], 0.99, 99)],
)
def test_quantile_matches_linear_interpolation(samples, q, expected):
    assert telemetry.quantile(samples, q) == pytest.approx(expected)


def test_quantile_errors_and_summary_skip_single_samples():
    with pytest.raises(ValueError, match="empty"):
        telemetry.quantile([], 0.5)
    with pytest.raises(ValueError, match="q must be"):
        telemetry.quantile([1.0], 1.5)
    assert telemetry.format_summary({4: [1.0]}) is None
    line = telemetry.format_summary({4: [1.0], 8: [1.0, 2.0], 2: [1.0, 1.0, 1.0]})
    assert line.startswith(telemetry.LOG_PREFIX + "[(2, 3, 1.0), (8, 2, 1.5)]")


def test_env_var_drives_module_defaults():
    """FORWARDKIT_LOG_BATCHSIZE_INTERVAL is read once at import (fresh module per value)."""
    import os
    import subprocess
    import sys

    code = """
import importlib, os, sys
for value in ("2.5", "0", None):
    os.environ.pop("FORWARDKIT_LOG_BATCHSIZE_INTERVAL", None)
    if value is not None:
        os.environ["FORWARDKIT_LOG_BATCHSIZE_INTERVAL"] = value
    sys.modules.pop("forwardkit.forward_context", None)
    fc = importlib.import_module("forwardkit.forward_context")
    print(fc.track_batchsize, fc.batchsize_logging_interval)
"""
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True,
                         text=True, timeout=120, check=True).stdout.splitlines()
    assert out == ["True 2.5", "True 0.0", "False -1.0"]
