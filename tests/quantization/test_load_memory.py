"""Quantize-on-load never holds the model at full precision: the peak resident set of a process
loading a bf16 checkpoint with ``quantization="q4_0"`` stays below the process's resident set
before the load plus the checkpoint's bf16 weights plus one decoder layer's. The same
measurement of a plain bf16 load sees the whole checkpoint (so the instrument is not blind).

The checkpoint (about 59 MB of bf16) is written here with ``safetensors``; each load runs in a
fresh interpreter that reports its resident set before loading (after a model of the same
config was built on the meta device and the quantizer ran on a few values, so the imports and
one-time set-up a load triggers are in the baseline, not in the load) and its peak (``VmHWM``
of ``/proc/self/status``; ``ru_maxrss`` would carry the launching test process's peak over the
exec) after."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

HIDDEN, INTER, LAYERS, VOCAB, HEADS, KV_HEADS = 512, 1536, 8, 4096, 8, 4

CHILD = r"""
import gc, json, sys
import torch
from forwardkit.config.builder import build_engine_config
from forwardkit.config.engine import set_current_engine_config
from forwardkit.models import get_model_class
from forwardkit.models.loader import load_model


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def resident() -> int:
    return status("VmRSS")


quantization = None if sys.argv[2] == "none" else sys.argv[2]


def config():
    return build_engine_config(sys.argv[1], quantization=quantization, dtype="bfloat16",
                               enforce_eager=True)


# the baseline: the code a load runs imported and set up (a model built on the meta device:
# no weight memory; the quantizer run once on a few values), nothing read yet
warm = config()
with set_current_engine_config(warm), torch.device("meta"):
    get_model_class(warm.require_model_config().architectures)(warm)
if quantization is not None:
    from forwardkit.quantization.formats import quantize
    quantize(torch.ones(64, 64, dtype=torch.bfloat16), quantization)
cfg = config()
gc.collect()
before = resident()
model = load_model(cfg)
# VmHWM: this address space's peak. Not ru_maxrss, which Linux sets at exec to at least the
# launching process's peak (the parent's, when the child is started by vfork + exec)
peak = status("VmHWM")
held = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"before": before, "peak": peak, "held": held}))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, int, int]:
    """``(directory, bf16 bytes of every tensor, bf16 bytes of one decoder layer)``."""
    path: Path = tmp_path_factory.mktemp("rss_llama")
    head_dim = HIDDEN // HEADS
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones() -> torch.Tensor:
        return torch.ones(HIDDEN, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "lm_head.weight": rand(VOCAB, HIDDEN),
               "model.norm.weight": ones()}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": rand(INTER, HIDDEN), p + "mlp.up_proj.weight": rand(INTER, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTER),
            p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones()})
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    layer = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.startswith("model.layers.0."))
    return str(path), total, layer


def _load_in_child(directory: str, quantization: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", CHILD, directory, quantization], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_quantize_on_load_peak_rss_below_bf16_weights_plus_one_layer(checkpoint):
    directory, bf16, layer = checkpoint
    got = _load_in_child(directory, "q4_0")
    assert got["held"] < 0.35 * bf16  # the model did load quantized
    bound = got["before"] + bf16 + layer
    assert got["peak"] < bound, (
        f"peak RSS {got['peak'] / 1e6:.1f} MB >= {bound / 1e6:.1f} MB (before the load "
        f"{got['before'] / 1e6:.1f} MB + bf16 weights {bf16 / 1e6:.1f} MB + one layer {layer / 1e6:.1f} MB)")


def test_the_measurement_sees_a_full_precision_load(checkpoint):
    """A bf16 load holds every weight: its peak is at least the checkpoint above the start."""
    directory, bf16, _ = checkpoint
    got = _load_in_child(directory, "none")
    assert got["held"] == bf16
    assert got["peak"] >= got["before"] + bf16
