"""Resolution reads device facts from the engine config's own platform, passed explicitly:
no process-wide platform swap (``use_platform``) while an engine config is built."""

from __future__ import annotations

import pytest

from forwardkit import platforms
from forwardkit.config.builder import build_engine_config
from forwardkit.config.compilation import CompilationConfig, PassConfig
from forwardkit.config.engine import EngineConfig
from forwardkit.platforms import CpuPlatform, CudaPlatform

COMBO = {"combo_kernels": True, "benchmark_combo_kernel": True}


@pytest.fixture
def no_swap():
    """Any change of the process-wide platform during the test body fails the test."""
    def refuse(platform):
        raise AssertionError(f"the process-wide platform was swapped to {platform!r}")
    original = platforms.set_current_platform
    platforms.set_current_platform = refuse
    try:
        yield
    finally:  # before the platform fixtures restore theirs
        platforms.set_current_platform = original


@pytest.mark.parametrize("build", [
    lambda cc, p: EngineConfig(compilation_config=cc, platform=p),
    lambda cc, p: build_engine_config(compilation_config=cc, platform=p),
])
def test_a_cuda_config_resolves_on_a_cpu_process(cpu_platform, no_swap, build):
    cfg = build({"pass_config": {"enable_qk_norm_rope_fusion": True}}, CudaPlatform(device_capability=90))
    cc = cfg.compilation_config
    assert COMBO.items() <= cc.inductor_compile_config.items()  # CUDA defaults
    assert cc.pass_config.enable_qk_norm_rope_fusion is True  # kept: checked for CUDA
    assert platforms.current_platform._get() is cpu_platform


@pytest.mark.parametrize("build", [
    lambda cc, p: EngineConfig(compilation_config=cc, platform=p),
    lambda cc, p: build_engine_config(compilation_config=cc, platform=p),
])
def test_a_cpu_config_resolves_on_a_cuda_process(cuda_platform, no_swap, build):
    cfg = build('{"pass_config": {"enable_qk_norm_rope_fusion": true}}', CpuPlatform())
    cc = cfg.compilation_config
    assert not COMBO.keys() & cc.inductor_compile_config.keys()
    assert cc.pass_config.enable_qk_norm_rope_fusion is False  # cleared: checked for CPU
    assert platforms.current_platform._get() is cuda_platform


def test_the_platform_argument_of_the_configs(cpu_platform):
    cuda = CudaPlatform(device_capability=90)
    assert COMBO.items() <= CompilationConfig(platform=cuda).inductor_compile_config.items()
    assert COMBO.items() <= CompilationConfig.from_cli("3", platform=cuda).inductor_compile_config.items()
    assert "platform" not in CompilationConfig(platform=cuda).to_dict()  # not a field
    assert PassConfig(enable_qk_norm_rope_fusion=True, platform=cuda).enable_qk_norm_rope_fusion
    assert PassConfig().flashinfer_max_size(8) is None  # the CPU process
    assert PassConfig().flashinfer_max_size(8, cuda) == 524288  # the given platform's table
    assert CompilationConfig().inductor_compile_config.keys() == {"enable_auto_functionalized_v2"}
