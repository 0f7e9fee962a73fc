"""Loader: safetensors (single and sharded), clear errors, registry, the default model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from forwardkit.models import get_model_class, supported_architectures
from forwardkit.models.loader import load_model
from forwardkit.models.weights import WeightLoadError

from .conftest import make_engine_config  # noqa: TID252


def _copy_with(src: str, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(dst)


def _load(model_dir: str, **kwargs):
    return load_model(make_engine_config(model_dir, **kwargs))


def test_missing_tensor_is_named(llama_dir, tmp_path):
    d = _copy_with(llama_dir, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensors: model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        _load(d)


def test_wrong_shape_is_named(llama_dir, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)

    d = _copy_with(llama_dir, tmp_path / "m", edit)
    with pytest.raises(WeightLoadError, match=r"wrong shape: model\.layers\.0\.mlp\.up_proj\.weight \(expected shape \(96, 64\), got \(3, 3\)\)"):
        _load(d)


def test_unexpected_tensor_is_named_and_rotary_buffers_ignored(llama_dir, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["model.layers.0.extra.weight"] = torch.ones(2)

    d = _copy_with(llama_dir, tmp_path / "m", edit)
    with pytest.raises(WeightLoadError) as info:
        _load(d)
    assert info.value.unexpected == ["model.layers.0.extra.weight"]
    assert str(tmp_path / "m") in str(info.value)


def test_unknown_architecture(llama_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"\['GPT2LMHeadModel'\] are not supported; supported architectures: \['LlamaForCausalLM'"):
        _load(str(d))
    with pytest.raises(ValueError, match="MixtralForCausalLM"):
        get_model_class(None)
    assert "MixtralForCausalLM" in supported_architectures()


def test_pickle_only_checkpoint_is_refused(llama_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(Path(llama_dir) / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ValueError, match=r"pickle-format weights \['pytorch_model.bin'\]; forwardkit requires safetensors"):
        _load(str(d))
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors weight files"):
        _load(str(d))


def test_sharded_checkpoint_loads_the_same(llama_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a, b = _load(llama_dir), _load(str(tmp_path / "sharded"))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_dtype_override(llama_dir):
    model = load_model(make_engine_config(llama_dir, dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_default_model_is_seeded_and_runs():
    from forwardkit.config.engine import EngineConfig
    from forwardkit.config.model import ModelConfig
    from forwardkit.forward_context import set_forward_context
    from forwardkit.layers.attention import build_attention_metadata
    from forwardkit.layers.kv_cache import bind_kv_cache
    from forwardkit.models.default import default_hf_config

    cfg = default_hf_config()
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (256, 4, 4096)
    configs = [EngineConfig(model_config=ModelConfig(hf_config=cfg), compilation_config={"mode": 0})
               for _ in range(2)]
    models = [load_model(c) for c in configs]
    assert type(models[0]).__name__ == "LlamaForCausalLM"
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters()))
    ctx = configs[0].compilation_config.static_forward_context
    assert "model.layers.3.self_attn.attn" in ctx
    bind_kv_cache(ctx, 8, 16, torch.float32, "cpu")
    md = build_attention_metadata([5], [5], [[2]], 8, 16, "cpu")
    with torch.no_grad(), set_forward_context({n: md for n in ctx}, configs[0]):
        hidden = models[0](torch.arange(8), torch.arange(8))
    logits = models[0].compute_logits(hidden[:5])
    assert logits.shape == (5, 4096) and logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupt_safetensors_names_the_file(llama_dir, tmp_path, damage):
    d = tmp_path / "m"
    shutil.copytree(llama_dir, d)
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:8] + b"{not json" + data[17:])
    with pytest.raises(ValueError, match=r"cannot read safetensors file .*model\.safetensors.*truncated or corrupt"):
        _load(str(d))


def test_wrong_typed_config_json_value_is_named(llama_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] = str(cfg["hidden_size"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'hidden_size' in .*config\.json must be a positive integer, got '64' \(str\)"):
        _load(str(d))


def test_an_engine_config_without_a_model_config_is_refused_clearly():
    """``EngineConfig()`` (vLLM-compatible) may lack a model config; building a model from it
    names the fix. The builder always sets one (the built-in model)."""
    from forwardkit.config.builder import build_engine_config
    from forwardkit.config.engine import EngineConfig
    from forwardkit.runner import ModelRunner

    bare = EngineConfig(compilation_config={"mode": 0})
    for build in (load_model, ModelRunner):
        with pytest.raises(ValueError, match="has no model_config; build it with .*build_engine_config"):
            build(bare)
    assert build_engine_config(platform="cpu").model_config.architectures == ["LlamaForCausalLM"]


def test_safetensors_are_read_not_mapped_with_the_values_safetensors_gives(tmp_path):
    """The loader reads each tensor into its own memory and gets the values, dtypes and shapes
    ``safetensors`` itself gives, in name order (that a load's resident set does not hold the
    file is measured by ``tests/quantization/test_load_memory.py``)."""
    from safetensors import safe_open

    from forwardkit.models.loader import iterate_safetensors

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "b.bf16": torch.randn(33, 7, generator=gen).bfloat16(),
        "a.f32": torch.randn(5, generator=gen),
        "c.f16": torch.randn(2, 3, 4, generator=gen).half(),
        "d.i64": torch.arange(-3, 9),
        "e.bool": torch.tensor([True, False, True]),
        "f.scalar": torch.tensor(2.5),
        "g.empty": torch.empty(0, 4),
    }
    path = str(tmp_path / "t.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    got = list(iterate_safetensors([path]))
    assert [name for name, _ in got] == sorted(tensors)
    with safe_open(path, framework="pt") as f:
        for name, tensor in got:
            want = f.get_tensor(name)
            assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
            assert torch.equal(tensor, want), name
