"""Shared fixtures: a per-session compile cache, and restoring global state after each test."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from skip_policy import pytest_addoption, pytest_configure  # noqa: E402, F401  (--strict-skips)


@pytest.fixture(scope="session", autouse=True)
def _session_cache_root(tmp_path_factory: pytest.TempPathFactory):
    """One compile-cache root for the whole run, so compiled pieces are shared between tests."""
    if "FORWARDKIT_CACHE_ROOT" not in os.environ:
        root = tmp_path_factory.mktemp("forwardkit-cache")
        os.chmod(root, 0o700)
        os.environ["FORWARDKIT_CACHE_ROOT"] = str(root)
    yield os.environ["FORWARDKIT_CACHE_ROOT"]


# Variables that change how configs resolve; a developer's shell must not change test results.
_CONFIG_ENV = (
    "FORWARDKIT_DP_SIZE", "FORWARDKIT_DP_RANK", "FORWARDKIT_DP_RANK_LOCAL",
    "FORWARDKIT_DP_MASTER_IP", "FORWARDKIT_DP_MASTER_PORT", "FORWARDKIT_ALL2ALL_BACKEND",
    "FORWARDKIT_DEBUG_DUMP_PATH", "FORWARDKIT_ATTENTION_BACKEND",
)


@pytest.fixture(autouse=True)
def _clean_config_env(monkeypatch: pytest.MonkeyPatch):
    """Start every test without the environment variables that steer config resolution."""
    for name in _CONFIG_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _restore_platform():
    """Tests may swap ``current_platform``; put the real one back afterwards."""
    from forwardkit import platforms

    previous = object.__getattribute__(platforms.current_platform, "_active")
    yield
    platforms.set_current_platform(previous)


@pytest.fixture
def cuda_platform():
    """Emulate a CUDA platform (capability 90) on any machine, for config resolution tests."""
    from forwardkit.platforms import CudaPlatform, use_platform

    with use_platform(CudaPlatform(device_capability=90)) as platform:
        yield platform


@pytest.fixture
def cpu_platform():
    """Force the CPU platform."""
    from forwardkit.platforms import CpuPlatform, use_platform

    with use_platform(CpuPlatform()) as platform:
        yield platform


@pytest.fixture
def fk_log_records():
    """Log records of the ``forwardkit`` logger tree, seen by a handler attached to it directly
    (the tree does not propagate to the root logger, so ``caplog`` alone would miss them).
    The once-only log cache is cleared first so earlier tests do not hide messages."""
    import logging

    from forwardkit.logger import _log_once, init_logger

    init_logger("forwardkit")  # make sure the tree is configured before we attach
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    _log_once.cache_clear()
    handler = _Keep(level=logging.DEBUG)
    root = logging.getLogger("forwardkit")
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
