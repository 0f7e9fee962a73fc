"""Fixtures for layer tests: a fresh current engine config per test."""

from __future__ import annotations

import pytest


@pytest.fixture
def engine_config():
    """A default EngineConfig installed as the current config (layers register into it)."""
    from forwardkit.config.engine import EngineConfig, set_current_engine_config

    config = EngineConfig()
    with set_current_engine_config(config):
        yield config


@pytest.fixture
def assert_linear_falls_back():
    """``check(seed)``: with the native kernel off, 1- and 2-row float32 products through the
    routed ``cpu_gemm.linear`` decline the kernel and equal ``F.linear``."""
    import torch
    import torch.nn.functional as F

    from forwardkit.layers import cpu_gemm, native_linear

    def check(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(24, 70, generator=gen)
        b = torch.randn(24, generator=gen)
        cpu_gemm.register_weight(w)
        try:
            for rows in (1, 2):
                x = torch.randn(rows, 70, generator=gen)
                assert native_linear.linear_rows(x, w, b) is None
                # another kernel than MKL's may serve it: the same products summed in another order
                torch.testing.assert_close(cpu_gemm.linear(x, w, b), F.linear(x, w, b),
                                           rtol=1e-5, atol=1e-5)
        finally:
            cpu_gemm.unpack_weight(w)

    return check
