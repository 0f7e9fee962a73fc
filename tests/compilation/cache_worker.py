"""Subprocess body for the cache tests: build the toy model (mode 3, Inductor), run it, and print
the compilation counters and the output as one JSON line. Usage: ``cache_worker.py SIZE [TAG]``
(TAG becomes a compile size, which changes the config hash and so the cache entry)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from toy_model import CompiledToyModel, ToyModel  # noqa: E402

from forwardkit.compilation.counters import compilation_counter  # noqa: E402
from forwardkit.config.compilation import CompilationConfig  # noqa: E402
from forwardkit.config.engine import EngineConfig  # noqa: E402


def main() -> None:
    n = int(sys.argv[1])
    tag = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    cc = CompilationConfig(mode=3, backend="inductor", splitting_ops=["fktest::attn"],
                           compile_sizes=[tag], compile_ranges_split_points=[2048])
    model = CompiledToyModel(engine_config=EngineConfig(compilation_config=cc), num_layers=1, hidden=16)
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        out = model(x)
        ref = ToyModel(num_layers=1, hidden=16)(x)
    print(json.dumps({
        "counters": dataclasses.asdict(compilation_counter),
        "max_err": (out - ref).abs().max().item(),
        "local_cache_dir": cc.local_cache_dir,
    }))


if __name__ == "__main__":
    main()
