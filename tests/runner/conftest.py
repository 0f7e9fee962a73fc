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

    from forwardkit.runner import model_runner

    monkeypatch.setattr(model_runner, "GraphBackend", RecordingGraphs)
    monkeypatch.setattr(model_runner.ModelRunner, "_graphs_supported", lambda self: True)
    return RecordingGraphs
