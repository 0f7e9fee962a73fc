"""Resolved configs are read-only (``config/frozen.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from forwardkit.config.builder import build_engine_config
from forwardkit.config.compilation import CompilationConfig
from forwardkit.config.engine import EngineConfig
from forwardkit.config.frozen import FrozenConfigError, is_frozen, unfrozen


@pytest.fixture
def cfg() -> EngineConfig:
    return build_engine_config(platform="cpu", max_num_seqs=4)


@pytest.mark.parametrize("path, value", [
    ("optimization_level", 0),
    ("platform", "cpu"),
    ("scheduler_config.max_num_seqs", 8),
    ("cache_config.num_gpu_blocks", 10),
    ("model_config.enforce_eager", True),
    ("parallel_config.data_parallel_rank", 1),
    ("compilation_config.cudagraph_mode", "FULL"),
    ("compilation_config.pass_config.fuse_rms_norm", False),
])
def test_writing_a_field_of_a_resolved_engine_config_raises(cfg, path, value):
    *parents, name = path.split(".")
    owner = cfg
    for part in parents:
        owner = getattr(owner, part)
    before = getattr(owner, name)
    cls = type(owner).__name__
    with pytest.raises(FrozenConfigError, match=rf"^cannot set {cls}\.{name}: the config is resolved "
                                                r"and read-only; build a new config instead"):
        setattr(owner, name, value)
    with pytest.raises(AttributeError, match=rf"cannot delete {cls}\.{name}"):
        delattr(owner, name)
    assert getattr(owner, name) == before


def test_runtime_state_is_written_through_the_vllm_names_into_the_state_object(cfg):
    cc = cfg.compilation_config
    fields_before = dict(vars(cc))
    hash_before = cc.compute_hash()
    cc.compilation_time = 1.5
    cc.local_cache_dir = "/tmp/x"
    cc.traced_files = {"a.py"}
    cc.static_forward_context["layer"] = layer = object()
    state = cc.compile_state
    assert (state.compilation_time, state.local_cache_dir, state.traced_files) == (1.5, "/tmp/x", {"a.py"})
    assert state.static_forward_context == {"layer": layer}
    assert vars(cc) == fields_before  # nothing of the config itself changed
    assert cc.compute_hash() == hash_before


def test_configs_are_mutable_until_resolved():
    cc = CompilationConfig()
    cc.mode = 3  # on its own, as in vLLM
    assert not is_frozen(cc)
    cfg = EngineConfig(compilation_config=cc, platform="cpu")
    assert cfg.compilation_config is cc and is_frozen(cc) and is_frozen(cfg)


def test_a_resolved_sub_config_given_to_a_new_engine_config_is_copied(cfg):
    cc = cfg.compilation_config
    before = cc.to_dict()
    again = EngineConfig(model_config=cfg.model_config, compilation_config=cc, platform="cpu")
    assert again.compilation_config is not cc and again.model_config is not cfg.model_config
    assert again.compilation_config.to_dict() == before == cc.to_dict()
    assert is_frozen(cc) and is_frozen(again.compilation_config)


def test_new_configs_come_from_replace(cfg):
    bigger = dataclasses.replace(cfg, cache_config=dataclasses.replace(cfg.cache_config,
                                                                       num_gpu_blocks=12))
    assert bigger.cache_config.num_gpu_blocks == 12 and cfg.cache_config.num_gpu_blocks is None
    assert bigger.compilation_config.to_dict() == cfg.compilation_config.to_dict()
    assert is_frozen(bigger.cache_config)


def test_unfrozen_lifts_the_guard_for_a_block_only(cfg):
    with unfrozen(cfg):
        cfg.scheduler_config.max_num_seqs = 2
    assert cfg.scheduler_config.max_num_seqs == 2
    with pytest.raises(FrozenConfigError):
        cfg.scheduler_config.max_num_seqs = 3


def test_the_runner_keeps_its_kv_block_count_itself():
    from forwardkit.runner import ModelRunner

    cfg = build_engine_config(platform="cpu", enforce_eager=True, max_num_seqs=2, max_model_len=64)
    runner = ModelRunner(cfg)
    assert runner.num_blocks > 0 and cfg.cache_config.num_gpu_blocks is None
