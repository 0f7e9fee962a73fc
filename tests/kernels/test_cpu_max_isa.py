"""``FORWARDKIT_CPU_MAX_ISA``: the one CPU capability object reports a CPU capped at an
instruction set (a stand-in for an AVX2 server on an AVX-512 machine), and every native
kernel's build choice and the native-bf16 answer follow it."""

from __future__ import annotations

import pytest
import torch

from forwardkit import platforms
from forwardkit.kernels.cpu import native_attention, native_linear, native_quant
from forwardkit.platforms import CpuCapabilities, cap_capabilities

FULL = CpuCapabilities(frozenset({"sse4_2", "ssse3", "avx", "avx2", "fma", "f16c", "avx512f",
                                  "avx512bw", "avx512_bf16", "avx512_vnni", "amx_tile",
                                  "amx_bf16", "bmi2"}), "a CPU", True)


def test_avx2_cap_hides_avx512_amx_and_native_bf16():
    capped = cap_capabilities(FULL, "avx2")
    assert capped.flags == {"sse4_2", "ssse3", "avx", "avx2", "fma", "f16c", "bmi2"}
    assert not capped.native_bf16 and not capped.amx and not capped.avx512_bf16
    assert cap_capabilities(FULL, "native") is FULL


def test_avx512_cap_hides_only_amx():
    capped = cap_capabilities(FULL, "avx512")
    assert capped.flags == FULL.flags - {"amx_tile", "amx_bf16"}
    assert not capped.amx and capped.avx512_bf16 and capped.native_bf16  # AVX-512-BF16 stays
    no_bf16 = CpuCapabilities(FULL.flags - {"avx512_bf16"}, "a CPU", True)
    assert not cap_capabilities(no_bf16, "avx512").native_bf16  # it came from AMX


def test_generic_cap_hides_every_vector_extension():
    assert cap_capabilities(FULL, "generic").flags == {"bmi2"}


def _clear() -> None:
    platforms.cpu_capabilities.cache_clear()
    for kernel in (native_linear, native_attention, native_quant):
        kernel.cache_clear()


@pytest.fixture
def capped(monkeypatch):
    def cap(isa: str) -> None:
        monkeypatch.setenv("FORWARDKIT_CPU_MAX_ISA", isa)
        _clear()

    yield cap
    monkeypatch.undo()
    _clear()


def test_the_kernels_choose_builds_within_the_cap(capped):
    capped("avx2")
    assert "avx512f" not in platforms.cpu_capabilities().flags
    for isa in (native_quant.kernel_isa(), native_attention.kernel_isa(),
                native_linear.kernel_isa(torch.float32)):
        assert isa in ("avx2", "generic", None), isa  # never an AVX-512 build
    capped("avx512")
    assert native_quant.kernel_isa() != "amx"  # the AMX build needs the flags the cap hides
    capped("generic")
    assert native_quant.kernel_isa() in ("generic", None)
    assert native_attention.kernel_isa() in ("generic", None)


def test_a_bad_cap_is_named(capped):
    capped("avx9")
    with pytest.raises(ValueError, match=r"'avx9' for FORWARDKIT_CPU_MAX_ISA.*'native', 'avx512', 'avx2', 'generic'"):
        platforms.cpu_capabilities()
