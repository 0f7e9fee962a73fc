"""Time ``update_weights`` for a full weight set of a Llama-3.2-1B-shaped model on the CPU.

Shape: hidden 2048, 16 layers, 32 heads, 8 KV heads, head_dim 64, intermediate 8192, vocab
128256, tied embeddings, bfloat16 (about 1.24 B parameters, 2.5 GB). The forwardkit model is
built directly from the config with uninitialised weights (no checkpoint, no download), and a
full set of Hugging Face-named tensors of the same shapes is drawn at random. Each repeat runs
the whole ``update_weights`` path an ``LLM`` runs: name mapping, the all-or-nothing dry run,
then the in-place copies into the merged ``qkv_proj`` / ``gate_up_proj`` parameters.

Usage: ``python benchmarks/update_weights.py [--repeats 3] [--source-dtype bfloat16|float32]
[--layers 16] [--packed | --no-route]``; prints the median seconds and the per-repeat times, and the floor: plain
``copy_`` of the same tensors into preallocated buffers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from forwardkit.config.builder import build_engine_config
from forwardkit.config.engine import set_current_engine_config
from forwardkit.engine.weight_update import update_model_weights
from forwardkit.kernels.cpu.router import CpuLinearRouter, attach_router
from forwardkit.layers.linear import linear_op_weights
from forwardkit.models.llama import LlamaForCausalLM


def llama_1b_config(layers: int = 16) -> dict[str, Any]:
    """Llama-3.2-1B's shape as an HF ``config.json`` dict."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": layers,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    }


def hf_weight_set(cfg: dict[str, Any], dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """A full Hugging Face-named weight set of random values (as a trainer would hand over)."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02).to(dtype)

    out = [("model.embed_tokens.weight", rand(cfg["vocab_size"], h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [
            (p + "self_attn.q_proj.weight", rand(q, h)), (p + "self_attn.k_proj.weight", rand(kv, h)),
            (p + "self_attn.v_proj.weight", rand(kv, h)), (p + "self_attn.o_proj.weight", rand(h, q)),
            (p + "mlp.gate_proj.weight", rand(i, h)), (p + "mlp.up_proj.weight", rand(i, h)),
            (p + "mlp.down_proj.weight", rand(h, i)),
            (p + "input_layernorm.weight", torch.ones(h, dtype=dtype)),
            (p + "post_attention_layernorm.weight", torch.ones(h, dtype=dtype)),
        ]
    out.append(("model.norm.weight", torch.ones(h, dtype=dtype)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--source-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--no-route", action="store_true",
                        help="do not route the linear layers through forwardkit's CPU paths (as an "
                             "engine with custom_ops=['-cpu_linear'])")
    parser.add_argument("--packed", action="store_true",
                        help="give every linear weight its oneDNN-packed copy first, as an engine "
                             "has after its first batched decode step (an update re-derives them); "
                             "without it the weights are only registered, as after loading or "
                             "batch-1 decoding")
    args = parser.parse_args()
    hf = llama_1b_config(args.layers)
    cfg = build_engine_config(None, default_hf_config=hf, dtype="bfloat16", enforce_eager=True,
                              max_model_len=4096)
    with set_current_engine_config(cfg), torch.device("cpu"):
        model = LlamaForCausalLM(cfg).eval()
    packed = 0
    if not args.no_route:
        routes = CpuLinearRouter(timing=False)  # as load_model does: packed copies made at first use
        routed = linear_op_weights(model)
        routes.route_weights(routed)
        attach_router(model, routes)  # update_model_weights binds it for its writes
        if args.packed:
            for weight, _ in routed:
                if routes.is_routed(weight):
                    routes.pack(weight)
                    packed += 1
    params = sum(p.numel() for p in model.parameters())
    weights = hf_weight_set(hf, getattr(torch, args.source_dtype))
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    print(f"model: {params / 1e9:.3f} B parameters (bf16); update: {len(weights)} tensors, "
          f"{nbytes / 2**30:.2f} GiB of {args.source_dtype}; torch threads: {torch.get_num_threads()}; "
          f"{packed} packed linear weights re-derived per update")
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        info = update_model_weights(cfg, model, weights)
        times.append(time.perf_counter() - start)
    # The floor: the same bytes copied into preallocated buffers, no names, no checks.
    buffers = [torch.empty(t.shape, dtype=torch.bfloat16) for _, t in weights]
    for b, (_, t) in zip(buffers, weights):
        b.copy_(t)  # first touch of the buffers
    floor = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for b, (_, t) in zip(buffers, weights):
            b.copy_(t)
        floor.append(time.perf_counter() - start)
    emb = model.model.embed_tokens.weight
    assert torch.equal(emb, weights[0][1].to(emb.dtype)), "the update did not reach the model"
    assert model.lm_head.weight is emb  # tied: one copy serves both
    print(f"updated {info['num_parameters']} parameters; per repeat: "
          + ", ".join(f"{t:.3f}" for t in times) + " s")
    print(f"update_weights median: {statistics.median(times):.3f} s; plain copy_ of the same "
          f"tensors into preallocated buffers: {statistics.median(floor):.3f} s")


if __name__ == "__main__":
    main()
