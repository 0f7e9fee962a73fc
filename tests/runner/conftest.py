"""Fixtures of the runner tests: the recording CUDA-graph stand-in (tests/cudagraph/recording.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "cudagraph"))


@pytest.fixture
def recording_graphs(monkeypatch):
    """Runners built in the test capture and replay through ``RecordingGraphs`` on CPU."""
    from recording import RecordingGraphs

    from forwardkit.platforms import Platform
    from forwardkit.runner import model_runner

    monkeypatch.setattr(model_runner, "GraphBackend", RecordingGraphs)
    # every platform "can capture" (the engine config's served graph mode reads this)
    monkeypatch.setattr(Platform, "can_capture_graphs", lambda self: True)
    return RecordingGraphs
