"""Bad input that used to fail with the wrong kind of error (RecursionError, a raw
FileNotFoundError, TypeError/KeyError from deep inside the model) is a ValueError naming the
field, the value and what is accepted."""

from __future__ import annotations

import json
import os

import pytest

from forwardkit.compilation.cache import CacheDirError, CompileCache, prepare_compile_cache
from forwardkit.config import CompilationConfig, build_engine_config
from forwardkit.config.engine import EngineConfig
from forwardkit.config.model import ModelConfig
from forwardkit.config.model_shapes import model_shape_config


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# --------------------------------------------------------------------- deeply nested arguments
@pytest.mark.parametrize("name", ["platform", "model_shape", "arg_names"])
def test_deeply_nested_argument_names_the_argument(name):
    with pytest.raises(ValueError, match=rf"^{name} must be .*got \[\[\[\[\.\.\.\]\]\]\] \(list\)") as info:
        build_engine_config(**{name: _nested(1200)})
    assert "\n" not in str(info.value)


def test_deeply_nested_platform_in_engine_config_names_it():
    with pytest.raises(ValueError, match=r"platform must be a Platform, 'cuda' or 'cpu', got \[\[\["):
        EngineConfig(platform=_nested(1200))


# --------------------------------------------------------------------- compile cache directory
def _bad_dirs(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    return {"root is a file": str(a_file), "parent is a file": str(a_file / "cache")}


@pytest.mark.parametrize("case", ["root is a file", "parent is a file"])
def test_unusable_cache_dir_is_a_field_named_error(tmp_path, case):
    cc = CompilationConfig(mode=3, cache_dir=_bad_dirs(tmp_path)[case])
    with pytest.raises(CacheDirError, match=r"^compilation_config\.cache_dir='.*a-file.*' cannot "
                                            r"hold the compile cache: .*; accepted: a directory"):
        prepare_compile_cache(cc)


def test_unusable_cache_root_env_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("FORWARDKIT_CACHE_ROOT", _bad_dirs(tmp_path)["parent is a file"])
    with pytest.raises(CacheDirError, match=r"^FORWARDKIT_CACHE_ROOT='"):
        prepare_compile_cache(CompilationConfig(mode=3))


def test_compile_cache_itself_names_the_setting(tmp_path):
    """The backend's own cache construction (used without a model runner) names it too."""
    root = _bad_dirs(tmp_path)["parent is a file"]
    with pytest.raises(CacheDirError, match=r"^compilation_config\.cache_dir="):
        CompileCache(root, os.path.join(root, "x"), source="compilation_config.cache_dir")


def test_cache_is_not_prepared_when_nothing_uses_it(tmp_path):
    bad = _bad_dirs(tmp_path)["parent is a file"]
    assert prepare_compile_cache(CompilationConfig(mode=3, backend="eager", cache_dir=bad)) is None
    assert prepare_compile_cache(CompilationConfig(mode=0, cache_dir=bad)) is None


def test_usable_cache_dir_is_created_private(tmp_path):
    root = tmp_path / "new" / "cache"
    assert prepare_compile_cache(CompilationConfig(mode=3, cache_dir=str(root))) == str(root)
    assert root.is_dir() and (root.stat().st_mode & 0o077) == 0


def test_llm_fails_before_loading_the_model(tmp_path, monkeypatch):
    """LLM(compilation_config={"mode": 3, "cache_dir": <unusable>}) raised a raw
    FileNotFoundError at the first compile; now a CacheDirError before the weights load."""
    from forwardkit.engine.llm import LLM
    from forwardkit.models import loader

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the cache directory was checked")

    monkeypatch.setattr(loader, "load_model", no_load)
    bad = _bad_dirs(tmp_path)["parent is a file"]
    with pytest.raises(CacheDirError, match=r"compilation_config\.cache_dir="):
        LLM(compilation_config={"mode": 3, "cache_dir": bad}, platform="cpu")


# --------------------------------------------------------------------- a checkpoint's config.json
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def _checkpoint_config(tmp_path, **changes) -> str:
    config = {**model_shape_config("default"), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(("changes", "message"), [
    ({"rope_scaling": "abc"}, r"'rope_scaling' in .*config\.json must be an object .* got 'abc' \(str\)"),
    ({"rope_scaling": [1, 2]}, r"'rope_scaling' in .*must be an object"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
     r"'rope_scaling\.rope_type' in .*must be one of \['default', 'linear', 'llama3'\], got 'yarn'"),
    ({"rope_scaling": {"type": 5}}, r"'rope_scaling\.rope_type' .* got 5"),
    ({"rope_scaling": {"rope_type": "linear"}}, r"'rope_scaling\.factor' .*; it is missing"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "x"}}, r"'rope_scaling\.factor' .* got 'x'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, r"'rope_scaling\.factor' .*> 0"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": "a"}}, r"'rope_scaling\.low_freq_factor'"),
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 32.5}},
     r"'rope_scaling\.original_max_position_embeddings' .* a positive integer"),
    ({"rope_parameters": "x"}, r"'rope_parameters' in .*must be an object"),
    ({"rope_parameters": {"rope_type": "linear", "factor": None}}, r"'rope_parameters\.factor'"),
    ({"rope_parameters": {"rope_theta": "big"}}, r"'rope_parameters\.rope_theta' .* > 0"),
    ({"eos_token_id": "x"}, r"'eos_token_id' in .*config\.json must be a token id .* got 'x' \(str\)"),
    ({"eos_token_id": -1}, r"'eos_token_id' .* got -1"),
    ({"eos_token_id": 1.5}, r"'eos_token_id' .* got 1\.5 \(float\)"),
    ({"eos_token_id": True}, r"'eos_token_id' .* got True \(bool\)"),
    ({"eos_token_id": [1, "a"]}, r"'eos_token_id' .* got \[1, 'a'\] \(list\)"),
    ({"eos_token_id": {"a": 1}}, r"'eos_token_id' .* \(dict\)"),
])
def test_bad_checkpoint_values_name_the_key(tmp_path, changes, message):
    path = _checkpoint_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError, match=message) as info:  # the LLM(...) / CLI path
        build_engine_config(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("changes", [
    {"rope_scaling": None}, {"rope_scaling": {"rope_type": "default"}},
    {"rope_scaling": {"type": "linear", "factor": 2}}, {"rope_scaling": LLAMA3},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
    {"eos_token_id": None}, {"eos_token_id": 2}, {"eos_token_id": [2, 3]},
])
def test_good_checkpoint_values_are_accepted(tmp_path, changes):
    ModelConfig.from_pretrained(_checkpoint_config(tmp_path, **changes))
