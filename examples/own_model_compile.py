"""Make your own ``nn.Module`` fast with forwardkit (CPU-friendly, well under a minute).

What this shows, in the order a newcomer needs it:

1. An *opaque custom op* for attention (``example::packed_causal_attention``). The compiled
   graph only sees ``op(q, k, v, out, layer_name)``: tensors and a string. Everything that
   changes from step to step (here: how the packed tokens split into sequences) is read at
   run time from the forward context, so nothing per-step is baked into the compiled code.
2. Layers that own such an op register themselves in
   ``engine_config.compilation_config.static_forward_context`` under a unique name; inside
   the op, ``get_forward_context().no_compile_layers[layer_name]`` finds the layer again.
3. One line, ``@support_torch_compile``, on the model class. The model is built under
   ``set_current_engine_config(EngineConfig(...))`` with mode 3 (VLLM_COMPILE): Dynamo traces
   it once with the token dimension dynamic, the graph is split at the attention op (listed in
   ``splitting_ops``) and each piece is compiled (Inductor by default).
4. Every call runs inside ``with set_forward_context(per_step_metadata, engine_config):``.

Run:  python examples/own_model_compile.py [--backend inductor|eager] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from forwardkit.compilation.counters import compilation_counter
from forwardkit.compilation.decorators import support_torch_compile
from forwardkit.config.compilation import CompilationConfig, CompilationMode
from forwardkit.config.engine import (
    EngineConfig,
    get_current_engine_config,
    set_current_engine_config,
)
from forwardkit.forward_context import get_forward_context, set_forward_context

ATTN_OP = "example::packed_causal_attention"
TOKEN_COUNTS = (1, 3, 17, 64)


# ---------------------------------------------------------------------------- per-step data
@dataclass
class StepMetadata:
    """What attention needs to know about one step: the tokens are packed sequences."""

    seq_lens: list[int]


def split_into_sequences(num_tokens: int) -> list[int]:
    """A deterministic packing of ``num_tokens`` tokens into up to three sequences."""
    lens, left = [], num_tokens
    for share in (0.5, 0.6):
        n = int(left * share)
        if n:
            lens.append(n)
            left -= n
    return [*lens, left] if left else lens


# ---------------------------------------------------------------------------- the opaque op
@torch.library.custom_op(ATTN_OP, mutates_args=("out",))
def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_name: str
) -> None:
    """Causal attention within each packed sequence, written into ``out`` ([T, heads*dim])."""
    ctx = get_forward_context()  # raises a clear error when no context is set
    layer = ctx.no_compile_layers[layer_name]  # the registered nn.Module (static_forward_context)
    seq_lens = ctx.attn_metadata[layer_name].seq_lens  # per-step data, never traced
    t, h, d = q.shape[0], layer.num_heads, layer.head_size
    qh, kh, vh = (x.view(t, h, d).transpose(0, 1) for x in (q, k, v))  # [heads, T, dim]
    start = 0
    for n in seq_lens:
        o = F.scaled_dot_product_attention(
            qh[:, start:start + n], kh[:, start:start + n], vh[:, start:start + n], is_causal=True
        )
        out[start:start + n] = o.transpose(0, 1).reshape(n, h * d)
        start += n


@packed_causal_attention.register_fake
def _(q, k, v, out, layer_name) -> None:
    # Tracing only needs shapes; the op writes into ``out`` and returns nothing.
    return None


# ---------------------------------------------------------------------------- the model
class PackedAttention(nn.Module):
    """Registers itself by name so the custom op can find it through the forward context."""

    def __init__(self, num_heads: int, head_size: int, prefix: str) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.layer_name = num_heads, head_size, prefix
        registry = get_current_engine_config().compilation_config.static_forward_context
        if prefix in registry:
            raise ValueError(f"Duplicate layer name: {prefix}")
        registry[prefix] = self

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        torch.ops.example.packed_causal_attention(q, k, v, out, self.layer_name)
        return out


class Block(nn.Module):
    """Pre-norm attention + MLP; everything but the attention op gets compiled."""

    def __init__(self, hidden: int, heads: int, prefix: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(hidden, eps=1e-6), nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.attn = PackedAttention(heads, hidden // heads, prefix=f"{prefix}.attn")
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.o_proj(self.attn(q, k, v))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


@support_torch_compile  # the one line; a no-op in mode 0 (NONE) or with enforce_eager
class TinyTransformer(nn.Module):
    """``forward(input_ids[T], positions[T]) -> hidden[T, H]`` over packed sequences.

    The decorator marks dim 0 of every ``torch.Tensor``-annotated argument dynamic, so one
    trace serves every token count.
    """

    def __init__(self, *, engine_config: EngineConfig, prefix: str = "",
                 vocab: int = 512, hidden: int = 128, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(1024, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, f"{prefix}layers.{i}") for i in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-6)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


# ---------------------------------------------------------------------------- running it
def build(mode: CompilationMode, backend: str, layers: int) -> tuple[TinyTransformer, EngineConfig]:
    """Build the model under its own engine config (each config has its own layer registry)."""
    cfg = EngineConfig(compilation_config=CompilationConfig(
        mode=mode,
        backend=backend,
        splitting_ops=[ATTN_OP],  # split here: the op runs eagerly between compiled pieces
    ))
    with set_current_engine_config(cfg):
        torch.manual_seed(0)  # same weights for the eager and the compiled copy
        model = TinyTransformer(engine_config=cfg, layers=layers).eval()
    return model, cfg


def step(model: TinyTransformer, cfg: EngineConfig, ids: torch.Tensor) -> torch.Tensor:
    """One forward over ``ids`` with its per-step metadata in the forward context."""
    seq_lens = split_into_sequences(ids.numel())
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    metadata = {name: StepMetadata(seq_lens) for name in cfg.compilation_config.static_forward_context}
    with set_forward_context(metadata, cfg, num_tokens=ids.numel()):
        return model(ids, positions)


def median_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time in ms of each ``fn()``, runs interleaved so load changes hit both."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    """Compare the compiled model with eager over several token counts; print the evidence."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["inductor", "eager"], default="inductor",
                        help="compiler for the pieces between attention ops (default inductor)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per token count")
    args = parser.parse_args(argv)

    eager, eager_cfg = build(CompilationMode.NONE, args.backend, args.layers)
    compiled, compiled_cfg = build(CompilationMode.VLLM_COMPILE, args.backend, args.layers)
    before = compilation_counter.clone()
    generator = torch.Generator().manual_seed(1)
    all_match = True
    with torch.no_grad():
        for n in TOKEN_COUNTS:
            ids = torch.randint(0, 512, (n,), generator=generator)
            start = time.perf_counter()
            out = step(compiled, compiled_cfg, ids)  # the first call traces and compiles
            first_s = time.perf_counter() - start
            ref = step(eager, eager_cfg, ids)
            err = (out - ref).abs().max().item()
            match = torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
            all_match &= match
            ms = median_ms({
                "eager": lambda: step(eager, eager_cfg, ids),  # noqa: B023
                "compiled": lambda: step(compiled, compiled_cfg, ids),  # noqa: B023
            }, args.repeats)
            print(f"tokens={n:3d} seqs={split_into_sequences(n)!s:13} max|diff|={err:.1e} "
                  f"match={match}  eager {ms['eager']:6.2f} ms  compiled {ms['compiled']:6.2f} ms  "
                  f"(first call {first_s:.2f} s)")
    delta = compilation_counter.delta(before)
    traces, recompiles = delta.get("num_dynamo_traces", 0), delta.get("num_recompiles", 0)
    print(f"Dynamo traces: {traces}, recompiles: {recompiles}, pieces: "
          f"{delta.get('num_piecewise_graphs_seen', 0)} ({delta.get('num_splits', 0)} attention "
          f"splits), piece compiles: {delta.get('num_backend_compilations', 0)} "
          f"(shared {delta.get('num_shared_artifacts', 0)}, cache hits {delta.get('num_cache_hits', 0)})")
    print(f"(timings: median of {args.repeats} interleaved runs, {torch.get_num_threads()} torch "
          "threads; tiny models on a busy CPU are noisy and overhead-bound)")
    if not all_match:
        raise SystemExit("FAILED: compiled outputs differ from eager")
    if traces != 1 or recompiles:
        raise SystemExit(f"FAILED: expected one Dynamo trace and no recompiles, got {delta}")
    print(f"OK: outputs match eager for token counts {list(TOKEN_COUNTS)}; "
          f"Dynamo traced once (backend {args.backend})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
