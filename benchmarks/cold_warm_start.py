"""Time to first step of the default model (forwardkit mode 3, Inductor) in a fresh process,
with a cold compile cache and then with the warm one it left behind.

Each measurement is a new Python process (``--child``) that records the time from its start
(before importing torch) to the end of its first forward step. Each round uses a new empty
FORWARDKIT_CACHE_ROOT for the cold run (so Inductor's kernel cache, kept under it, is cold too)
and then runs warm on what it left; the parent prints every round and the medians' ratio.

    python benchmarks/cold_warm_start.py [--tokens 64] [--repeat 3]
"""

from __future__ import annotations

import time

_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402


def child(tokens: int) -> None:
    import torch

    from forwardkit.compilation.counters import compilation_counter
    from forwardkit.config.engine import EngineConfig
    from forwardkit.config.model import ModelConfig
    from forwardkit.forward_context import set_forward_context
    from forwardkit.kernels.cpu.router import attached_router, bind
    from forwardkit.layers.attention import build_attention_metadata
    from forwardkit.layers.kv_cache import bind_kv_cache
    from forwardkit.models.default import default_hf_config
    from forwardkit.models.loader import load_model

    imported = time.perf_counter() - _START
    cfg = EngineConfig(model_config=ModelConfig(hf_config=default_hf_config()),
                       compilation_config={"mode": 3, "backend": "inductor"})
    model = load_model(cfg)
    ctx = cfg.compilation_config.static_forward_context
    bind_kv_cache(ctx, 64, 16, torch.float32, "cpu")
    md = build_attention_metadata([tokens], [tokens], [list(range(-(-tokens // 16)))], tokens, 16, "cpu")
    with torch.no_grad(), bind(attached_router(model)), \
            set_forward_context({k: md for k in ctx}, cfg, num_tokens=tokens):  # as the runner does
        model(torch.arange(tokens), torch.arange(tokens))
    print(json.dumps({
        "first_step_s": time.perf_counter() - _START,
        "import_s": imported,
        "inductor_compiles": compilation_counter.num_inductor_compiles,
        "cache_hits": compilation_counter.num_cache_hits,
        "dynamo_traces": compilation_counter.num_dynamo_traces,
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="cold+warm rounds (default 3)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.tokens)
        return
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    rounds = []
    for i in range(args.repeat):
        root = tempfile.mkdtemp(prefix="fk-cold-warm-")
        os.chmod(root, 0o700)
        env = dict(os.environ, FORWARDKIT_CACHE_ROOT=root, FORWARDKIT_LOGGING_LEVEL="WARNING")
        results = {}
        for label in ("cold", "warm"):
            out = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(args.tokens)],
                                 env=env, capture_output=True, text=True, check=True, timeout=1800)
            results[label] = r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"round {i + 1} {label:5s}: first step after {r['first_step_s']:6.1f} s "
                  f"(imports {r['import_s']:.1f} s); inductor compiles {r['inductor_compiles']}, "
                  f"cache hits {r['cache_hits']}, dynamo traces {r['dynamo_traces']}", flush=True)
        shutil.rmtree(root, ignore_errors=True)
        rounds.append(results)
    cold = statistics.median(r["cold"]["first_step_s"] for r in rounds)
    warm = statistics.median(r["warm"]["first_step_s"] for r in rounds)
    print(f"median of {len(rounds)}: cold {cold:.1f} s, warm {warm:.1f} s, "
          f"warm / cold = {warm / cold:.2f} (target <= 0.25)")


if __name__ == "__main__":
    main()
