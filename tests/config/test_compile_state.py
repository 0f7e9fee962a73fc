"""Run-time compile state lives in ``CompileRuntimeState`` (config/compile_state.py), not in the
resolved ``CompilationConfig``; vLLM's names on the config forward to it."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import pytest

from forwardkit.config.compilation import CompilationConfig
from forwardkit.config.compile_state import RUNTIME_STATE_NAMES, CompileRuntimeState
from forwardkit.config.engine import EngineConfig, get_layers_from_engine_config
from forwardkit.config.frozen import FreezableConfig, FrozenConfigError, is_frozen, thawed_copy

VLLM_RUNTIME_NAMES = {"local_cache_dir", "enabled_custom_ops", "disabled_custom_ops",
                      "traced_files", "compilation_time", "static_forward_context"}


def test_the_config_has_no_runtime_fields_and_no_frozen_exemptions():
    names = {f.name for f in dataclasses.fields(CompilationConfig)}
    assert not names & VLLM_RUNTIME_NAMES
    assert "bs_to_padded_graph_size" in names  # a resolution result, still a field
    assert set(RUNTIME_STATE_NAMES) == VLLM_RUNTIME_NAMES
    assert not hasattr(FreezableConfig, "RUNTIME_FIELDS")


@pytest.mark.parametrize("name, value", [
    ("local_cache_dir", "/tmp/rank_0"), ("enabled_custom_ops", Counter(rms_norm=2)),
    ("disabled_custom_ops", Counter(silu_and_mul=1)), ("traced_files", {"m.py"}),
    ("compilation_time", 2.5), ("static_forward_context", {"l.attn": 1}),
])
def test_each_vllm_name_reads_and_writes_the_state_on_a_resolved_config(name, value):
    cfg = EngineConfig(platform="cpu")
    cc = cfg.compilation_config
    assert is_frozen(cc)
    before = dict(vars(cc))
    setattr(cc, name, value)  # vLLM code writes these on the live config
    assert getattr(cc.compile_state, name) == value and getattr(cc, name) == value
    assert dict(vars(cc)) == before
    with pytest.raises(FrozenConfigError):
        delattr(cc, name)


def test_fields_of_a_resolved_config_stay_read_only():
    cc = EngineConfig(platform="cpu").compilation_config
    with pytest.raises(FrozenConfigError, match="CompilationConfig.bs_to_padded_graph_size"):
        cc.bs_to_padded_graph_size = [0, 1]
    with pytest.raises(FrozenConfigError, match="CompilationConfig.mode"):
        cc.mode = 0


def test_each_config_gets_its_own_state():
    a, b = CompilationConfig(), CompilationConfig()
    assert isinstance(a.compile_state, CompileRuntimeState)
    assert a.compile_state is not b.compile_state
    a.static_forward_context["x"] = 1
    a.enabled_custom_ops["rms_norm"] += 1
    a.compilation_time = 1.0
    replaced = dataclasses.replace(a, backend="eager")
    assert replaced.compile_state is not a.compile_state
    assert replaced.static_forward_context == {} and not replaced.enabled_custom_ops
    assert replaced.compilation_time == 0.0
    assert b.static_forward_context == {}


def test_a_new_resolution_of_a_resolved_config_starts_with_fresh_state():
    first = EngineConfig(platform="cpu")
    first.compilation_config.static_forward_context["layer"] = 1
    first.compilation_config.traced_files.add("a.py")
    again = EngineConfig(compilation_config=first.compilation_config, platform="cpu")
    assert again.compilation_config is not first.compilation_config
    assert again.compilation_config.static_forward_context == {}
    assert again.compilation_config.traced_files == set()
    assert first.compilation_config.static_forward_context == {"layer": 1}  # unchanged
    copied = thawed_copy(first.compilation_config)
    assert copied.compile_state is not first.compilation_config.compile_state


def test_state_is_not_configuration():
    c = CompilationConfig()
    base_hash, base_dict, base_repr = c.compute_hash(), c.to_dict(), repr(c)
    c.static_forward_context["l"] = object()
    c.enabled_custom_ops["rms_norm"] += 1
    c.traced_files.add("a.py")
    c.compilation_time = 3.0
    assert (c.compute_hash(), c.to_dict(), repr(c)) == (base_hash, base_dict, base_repr)
    c.local_cache_dir = "/z"  # vLLM prints this one (last), nothing else of the state
    assert repr(c) == base_repr.replace("'local_cache_dir': None", "'local_cache_dir': '/z'")
    with pytest.raises(ValueError, match="Unexpected keyword argument"):
        CompilationConfig(static_forward_context={})


def test_a_failed_resolution_keeps_the_state_object():
    cc = CompilationConfig(compile_ranges_split_points=[0])
    state = cc.compile_state
    with pytest.raises(ValueError, match="Invalid compile range split point: 0"):
        EngineConfig(compilation_config=cc, platform="cpu")
    assert cc.compile_state is state
    assert copy.copy(cc).compile_state is state  # a plain copy shares it, like vLLM's fields


def test_layers_are_found_in_the_state():
    cfg = EngineConfig(platform="cpu")
    cfg.compilation_config.compile_state.static_forward_context.update({"a": 1, "b": "x"})
    assert get_layers_from_engine_config(cfg, int) == {"a": 1}
