"""``import forwardkit`` (and ``from forwardkit import LLM, SamplingParams``) vs ``import torch``
plus ``pydantic``: wall-clock import time in fresh interpreters.

Each figure is the median over ``--runs`` subprocesses (``python -c "<imports>"``, timed from
inside the interpreter so start-up is excluded); the runs interleave the statements so machine
load hits all alike. ``import forwardkit`` alone loads nothing heavy (its names are loaded on
first use); the ``from forwardkit import ...`` line is what a user's first line costs.

Usage: ``python benchmarks/import_time.py [--runs 7]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

STATEMENTS = {
    "import torch, pydantic": "import torch, pydantic",
    # pydantic's top-level import is lazy; its dataclass machinery is what a library using it loads
    "import torch, pydantic.dataclasses": "import torch, pydantic.dataclasses",
    "import forwardkit": "import forwardkit",
    "from forwardkit import CompilationConfig": "from forwardkit import CompilationConfig",
    "from forwardkit import LLM, SamplingParams": "from forwardkit import LLM, SamplingParams",
}
_TIMER = "import time; _t = time.perf_counter(); {stmt}; print(time.perf_counter() - _t)"


def time_import(statement: str) -> float:
    """Seconds the statement takes in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", _TIMER.format(stmt=statement)], check=True,
                         capture_output=True, text=True, env=dict(os.environ))
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {label: [] for label in STATEMENTS}
    for label in STATEMENTS:  # one warm-up each (file-system cache)
        time_import(STATEMENTS[label])
    for _ in range(args.runs):
        for label, stmt in STATEMENTS.items():
            samples[label].append(time_import(stmt))
    base = statistics.median(samples["import torch, pydantic"])
    full = statistics.median(samples["import torch, pydantic.dataclasses"])
    for label, values in samples.items():
        median = statistics.median(values)
        print(f"{label:45s} median {median:.3f} s  (vs torch+pydantic {median - base:+.3f} s, "
              f"vs torch+pydantic.dataclasses {median - full:+.3f} s)")


if __name__ == "__main__":
    main()
