"""``LoRAConfig`` and the LoRA engine arguments: vLLM's values and checks."""

from __future__ import annotations

import pytest

from forwardkit.config.builder import build_engine_config
from forwardkit.config.lora import LORA_RANKS, LoRAConfig


def test_defaults_as_vllm():
    cfg = LoRAConfig()
    assert (cfg.max_lora_rank, cfg.max_loras, cfg.max_cpu_loras) == (16, 1, 1)
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3  # None = max_loras
    assert LORA_RANKS == (1, 8, 16, 32, 64, 128, 256, 320, 512)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_lora_rank": 7}, r"max_lora_rank=7 is invalid; expected one of 1, 8, 16"),
    ({"max_loras": 0}, r"max_loras=0 is invalid"),
    ({"max_loras": 3, "max_cpu_loras": 2}, r"max_cpu_loras=2 must be >= max_loras=3"),
    ({"lora_dtype": "int8"}, r"lora_dtype='int8' is invalid"),
])
def test_bad_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_engine_config(platform="cpu", enable_lora=True, **kwargs)


def test_engine_config_carries_it_and_hashes_it():
    off = build_engine_config(platform="cpu")
    on = build_engine_config(platform="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)
    assert off.lora_config is None
    assert on.lora_config == LoRAConfig(max_lora_rank=8, max_loras=2)
    assert on.compute_hash() != off.compute_hash()


def test_slot_arguments_need_enable_lora():
    with pytest.raises(ValueError, match=r"^max_loras=4 needs enable_lora=True"):
        build_engine_config(platform="cpu", max_loras=4)
    # vLLM's defaults change nothing and pass
    assert build_engine_config(platform="cpu", max_loras=1, max_lora_rank=16).lora_config is None


def test_fully_sharded_loras_refused_by_name():
    with pytest.raises(ValueError, match=r"^fully_sharded_loras=True is not supported"):
        build_engine_config(platform="cpu", enable_lora=True, fully_sharded_loras=True)
