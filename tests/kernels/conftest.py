"""Fixtures for the CPU kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def assert_linear_falls_back():
    """``check(seed)``: with the native kernel off, 1- and 2-row float32 products of a routed
    weight through the op's kernel (router bound) decline the kernel and equal ``F.linear``."""
    import torch
    import torch.nn.functional as F

    from forwardkit.kernels.cpu import native_linear, router

    def check(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(24, 70, generator=gen)
        b = torch.randn(24, generator=gen)
        routes = router.CpuLinearRouter(timing=False)
        routes.route(w)
        with router.bind(routes):
            for rows in (1, 2):
                x = torch.randn(rows, 70, generator=gen)
                assert native_linear.linear_rows(x, w, b) is None
                # another kernel than MKL's may serve it: the same products summed in another order
                torch.testing.assert_close(router.linear(x, w, b), F.linear(x, w, b),
                                           rtol=1e-5, atol=1e-5)

    return check
