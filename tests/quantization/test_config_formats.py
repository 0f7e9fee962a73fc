"""``forwardkit config`` shows the format of each weight, for ``--quantization`` and for a GGUF
file, decoder layers with the same formats grouped into one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from forwardkit.cli import main

from .conftest import TINY  # noqa: TID252


def _config_dir(path: Path, layers: int, tied: bool = False) -> str:
    """A config.json only (``forwardkit config`` reads no weights)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY,
           "num_hidden_layers": layers, "tie_word_embeddings": tied, "rope_theta": 10000.0,
           "torch_dtype": "bfloat16"}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _run(capsys, *argv: str) -> str:
    assert main(["config", *argv]) == 0
    return capsys.readouterr().out


def test_quantization_formats_per_layer_grouped(tmp_path, capsys):
    out = _run(capsys, "--model", _config_dir(tmp_path / "m", layers=16), "--quantization", "q4_0")
    lines = out.splitlines()
    weights = [ln for ln in lines if ln.startswith(("weights", "  layer"))]
    assert len(weights) == 2, weights  # 16 identical layers: one line, not one per weight
    assert weights[0].split(None, 1)[1] == (
        "quantized on load (q4_0): model.embed_tokens.weight q8_0; model.norm.weight float32; "
        "lm_head.weight q8_0")
    assert weights[1].split(None, 2)[1:] == [
        "0-15", "q4_0: self_attn.qkv_proj.weight, self_attn.o_proj.weight, mlp.gate_up_proj.weight, "
        "mlp.down_proj.weight; float32: input_layernorm.weight, post_attention_layernorm.weight"]
    assert "q4_0 projections, q8_0 token embedding and LM head" in out


def test_tied_head_is_shown_as_the_embedding_table(tmp_path, capsys):
    out = _run(capsys, "--model", _config_dir(tmp_path / "m", layers=2, tied=True), "--quantization",
               "q8_0", "--json")
    formats = json.loads(out)["weight_formats"]
    assert formats["outside_layers"]["lm_head.weight"] == "q8_0 (the table of model.embed_tokens.weight)"
    assert formats["layers"] == [{"layers": [0, 1], "formats": {
        "self_attn.qkv_proj.weight": "q8_0", "self_attn.o_proj.weight": "q8_0",
        "mlp.gate_up_proj.weight": "q8_0", "mlp.down_proj.weight": "q8_0",
        "input_layernorm.weight": "float32", "post_attention_layernorm.weight": "float32"}}]


def test_unquantized_model_prints_no_weight_rows(tmp_path, capsys):
    out = _run(capsys, "--model", _config_dir(tmp_path / "m", layers=2))
    assert not [ln for ln in out.splitlines() if ln.startswith(("weights", "  layer"))]


def test_gguf_file_formats_per_layer(tmp_path, capsys):
    gguf = pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    from .gguf_files import gguf_tensors, write_gguf  # noqa: TID252

    T = gguf.GGMLQuantizationType
    torch.manual_seed(0)
    cfg = {**TINY, "num_hidden_layers": 3, "tie_word_embeddings": False, "rope_theta": 10000.0}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    tensors = gguf_tensors(model.state_dict(), cfg, "llama")

    def type_of(name: str, a) -> object:
        if a.ndim != 2:
            return T.F32
        if name == "blk.2.attn_v.weight":
            return T.Q4_1
        return T.F16 if name == "token_embd.weight" else T.Q8_0

    path = write_gguf(str(tmp_path / "m.gguf"), "llama", cfg, tensors, type_of=type_of)
    out = json.loads(_run(capsys, "--model", path, "--json"))["weight_formats"]
    assert out["source"] == "GGUF file"
    assert out["outside_layers"]["token_embd.weight"] == "F16 as bfloat16"
    assert out["outside_layers"]["output.weight"] == "Q8_0"
    assert [g["layers"] for g in out["layers"]] == [[0, 1], [2, 2]]
    assert out["layers"][0]["formats"]["attn_v.weight"] == "Q8_0"
    assert out["layers"][1]["formats"]["attn_v.weight"] == "Q4_1"
    assert out["layers"][1]["formats"]["attn_norm.weight"] == "F32 as bfloat16"
    text = _run(capsys, "--model", path)
    assert "  layer 2" in text and "Q4_1: attn_v.weight" in text
    # nothing is quantized on load, yet the file's weights are quantized: not "none"
    assert "quantization        the GGUF file's tensor types (weights below)" in text
    # every matrix in blocks: on a CPU the model runs in float32, and its F32 norms stay F32
    blocks = write_gguf(str(tmp_path / "b.gguf"), "llama", cfg, tensors,
                        type_of=lambda name, a: T.F32 if a.ndim != 2 else T.Q8_0)
    out = json.loads(_run(capsys, "--model", blocks, "--json"))["weight_formats"]
    assert out["outside_layers"]["token_embd.weight"] == "Q8_0"
    assert out["layers"][0]["formats"]["attn_norm.weight"] == "F32 as float32"
    # tied (no output.weight): the head is the embedding's one table, packed or not
    tied_cfg = {**cfg, "tie_word_embeddings": True}
    tied_tensors = {k: v for k, v in tensors.items() if k != "output.weight"}
    for kind, held in ((T.Q8_0, "Q8_0"), (T.F16, "F16 as float32")):
        path = write_gguf(str(tmp_path / f"tied_{kind.name}.gguf"), "llama", tied_cfg, tied_tensors,
                          type_of=lambda name, a, kind=kind: (
                              T.F32 if a.ndim != 2 else kind if name == "token_embd.weight" else T.Q8_0))
        out = json.loads(_run(capsys, "--model", path, "--json", "--dtype", "float32"))["weight_formats"]
        assert out["outside_layers"]["output (tied)"] == f"the table of token_embd.weight ({held})"


def test_a_weight_the_load_would_refuse_is_marked(tmp_path, capsys):
    out = _run(capsys, "--model", _config_dir(tmp_path / "m", layers=2), "--quantization", "q4_0",
               "--json")
    # TINY's intermediate size 96 is whole blocks; 80 is not: the down projection's rows
    (tmp_path / "n").mkdir()
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "n" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 80}))
    assert json.loads(out)["weight_formats"]["layers"][0]["formats"]["mlp.down_proj.weight"] == "q4_0"
    out = _run(capsys, "--model", str(tmp_path / "n"), "--quantization", "q4_0", "--json")
    formats = json.loads(out)["weight_formats"]["layers"][0]["formats"]
    assert formats["mlp.down_proj.weight"] == "q4_0 refused (rows not whole 32-weight blocks)"
    assert formats["mlp.gate_up_proj.weight"] == "q4_0"


def test_quantized_moe_experts_are_shown_packed(tmp_path, capsys):
    """The experts of a quantized Mixtral are listed in the format the load packs them in."""
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **TINY,
           "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
           "tie_word_embeddings": False, "rope_theta": 10000.0, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = _run(capsys, "--model", str(tmp_path), "--quantization", "q4_0")
    layer_row = next(ln for ln in out.splitlines() if ln.startswith("  layers"))
    packed, _, rest = layer_row.split(None, 2)[2].partition(";")
    assert packed.startswith("q4_0:") and "mlp.experts.w13_weight" in packed
    assert "mlp.experts.w2_weight" in packed and "experts" not in rest
