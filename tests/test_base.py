"""The base layer: environment variables, logger, platform injection."""

from __future__ import annotations

import pytest

from forwardkit import envs, platforms
from forwardkit.logger import init_logger


def test_env_defaults_and_parsing(monkeypatch):
    monkeypatch.delenv("FORWARDKIT_LOG_BATCHSIZE_INTERVAL", raising=False)
    assert envs.FORWARDKIT_LOG_BATCHSIZE_INTERVAL == -1.0
    monkeypatch.setenv("FORWARDKIT_LOG_BATCHSIZE_INTERVAL", "2.5")
    assert envs.FORWARDKIT_LOG_BATCHSIZE_INTERVAL == 2.5
    monkeypatch.setenv("FORWARDKIT_LOG_BATCHSIZE_INTERVAL", "soon")
    with pytest.raises(ValueError, match="FORWARDKIT_LOG_BATCHSIZE_INTERVAL='soon'"):
        _ = envs.FORWARDKIT_LOG_BATCHSIZE_INTERVAL


def test_env_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv("FORWARDKIT_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert envs.FORWARDKIT_CACHE_ROOT == str(tmp_path / "forwardkit")
    monkeypatch.setenv("FORWARDKIT_CACHE_ROOT", str(tmp_path / "x"))
    assert envs.FORWARDKIT_CACHE_ROOT == str(tmp_path / "x")


def test_env_bool_and_choice(monkeypatch):
    monkeypatch.setenv("FORWARDKIT_DISABLE_COMPILE_CACHE", "1")
    assert envs.FORWARDKIT_DISABLE_COMPILE_CACHE is True
    monkeypatch.setenv("FORWARDKIT_DISABLE_COMPILE_CACHE", "maybe")
    with pytest.raises(ValueError, match="not a boolean"):
        _ = envs.FORWARDKIT_DISABLE_COMPILE_CACHE
    monkeypatch.setenv("FORWARDKIT_COMPILE_CACHE_SAVE_FORMAT", "zip")
    with pytest.raises(ValueError, match=r"Valid options: \['binary', 'unpacked'\]"):
        _ = envs.FORWARDKIT_COMPILE_CACHE_SAVE_FORMAT


def test_unknown_env_attribute():
    with pytest.raises(AttributeError):
        _ = envs.FORWARDKIT_NOT_A_VARIABLE


def test_logger_once(fk_log_records):
    logger = init_logger("forwardkit.test_once")
    logger.info_once("only once %d", 7)
    logger.info_once("only once %d", 7)
    logger.info_once("only once %d", 8)
    messages = [r.getMessage() for r in fk_log_records if r.name == "forwardkit.test_once"]
    assert messages == ["only once 7", "only once 8"]


def test_platform_injection():
    with platforms.use_platform("cuda"):
        assert platforms.current_platform.supports_static_graph()
        assert platforms.current_platform.is_cuda_alike()
        with platforms.use_platform("cpu"):
            assert platforms.current_platform.is_cpu()
            assert platforms.current_platform.synchronize is None
        assert platforms.current_platform.device_type == "cuda"
    with pytest.raises(ValueError, match="unknown platform 'tpu'"):
        platforms.platform_by_name("tpu")


def test_global_graph_pool_is_shared():
    class FakeGpu(platforms.Platform):
        made = 0

        def graph_pool_handle(self):
            FakeGpu.made += 1
            return object()

    a, b = FakeGpu(), FakeGpu()
    assert a.get_global_graph_pool() is b.get_global_graph_pool()
    assert FakeGpu.made == 1


def test_cpu_capabilities_is_the_one_probe():
    """The CPU is probed once (platforms.cpu_capabilities); the dtype choice, the router and
    the native kernels read that object."""
    import torch

    from forwardkit.config import builder
    from forwardkit.kernels.cpu import native_linear, router
    from forwardkit.platforms import cpu_capabilities

    caps = cpu_capabilities()
    assert cpu_capabilities() is caps  # probed once
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            first = next((line for line in f if line.startswith("flags")), "flags:")
    except OSError:
        first = "flags:"
    assert caps.flags == frozenset(first.split(":", 1)[1].split())
    native = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert caps.native_bf16 == native == builder.cpu_has_native_bf16()
    assert router.prepack_supported(torch.bfloat16) == native
    assert native_linear.cpu_flags() is caps.flags
    assert native_linear.cpu_has_avx512_bf16() == caps.avx512_bf16 == ("avx512_bf16" in caps.flags)
