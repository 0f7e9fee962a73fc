"""The contenders of ``forwardkit bench``: one :class:`ModelRunner` each, same model and weights.

- ``eager``: the same model as plain PyTorch would run it: mode NONE, no CUDA graphs, every
  op native (``custom_ops=["none", "-cpu_linear", "-cpu_attention"]``: no custom-op wrappers,
  plain ``F.linear`` for linear layers: no native kernel, no oneDNN packing, no huge pages;
  attention by torch ops (SDPA over gathered blocks), not the native decode kernel).
- ``torch.compile``: what a user would write by hand: that eager model wrapped in stock
  ``torch.compile(dynamic=True)`` (Inductor, guards kept), so Inductor sees every op.
- ``forwardkit``: the configuration resolved from the command line (``-O`` / ``-cc``).
- ``forwardkit+dbo``: the same with dual-batch overlap on (``--enable-dbo``); only with
  ``--data-parallel-size > 1`` (micro-batching needs DP ranks to agree on it), and then in
  the default list.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn

from forwardkit.commands.flag_config import engine_config_from_args
from forwardkit.compilation.counters import compilation_counter
from forwardkit.config.engine import EngineConfig
from forwardkit.runner.model_runner import ModelRunner

if TYPE_CHECKING:
    from torch._inductor.compile_fx import CompileFxOutput

__all__ = ["CONTENDER_NAMES", "DBO_CONTENDER", "Contender", "build_contender"]

CONTENDER_NAMES = ("eager", "torch.compile", "forwardkit")
DBO_CONTENDER = "forwardkit+dbo"
# The baselines' compilation config: plain PyTorch, every op native ("cpu_linear" and
# "cpu_attention" are on under "none" too: each needs its own "-").
# with -O0 the mode resolves to NONE (0); not set here, so resolution does not warn that the
# user disabled Inductor (the user did not: the baselines are forwardkit's own)
NATIVE_EAGER = '{"custom_ops": ["none", "-cpu_linear", "-cpu_attention"]}'



@dataclass
class Contender:
    """A runner plus how to count its recompilations."""

    name: str
    runner: ModelRunner
    engine_config: EngineConfig
    build_s: float
    _traces: list[int] = field(default_factory=lambda: [0])

    def traces(self) -> int:
        """Dynamo traces (graphs handed to a compiler) so far."""
        if self.name in ("forwardkit", DBO_CONTENDER):
            return compilation_counter.num_dynamo_traces + compilation_counter.stock_torch_compile_count
        return self._traces[0]


def _counting_inductor(
    calls: list[int],
) -> Callable[[torch.fx.GraphModule, list[torch.Tensor]], CompileFxOutput]:
    """Inductor as ``torch.compile(backend="inductor")`` uses it, counting each graph it gets."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> CompileFxOutput:
        from torch._inductor.compile_fx import compile_fx

        calls[0] += 1
        return compile_fx(gm, example_inputs)

    return backend


def engine_config_for(name: str, args: argparse.Namespace, hf_config: dict[str, Any] | None,
                      num_blocks: int) -> EngineConfig:
    """The engine config a contender runs with (the baselines run at ``-O0`` with every op
    native: no compile, no CUDA graphs, no custom-op wrappers)."""
    ns = copy.copy(args)
    if name == DBO_CONTENDER:
        ns.enable_dbo = True
    elif name != "forwardkit":
        ns.enforce_eager = False
        ns.engine_O = ["0"]
        ns.compilation_config = NATIVE_EAGER
    cfg = engine_config_from_args(ns, default_hf_config=hf_config)
    return dataclasses.replace(cfg, cache_config=dataclasses.replace(cfg.cache_config,
                                                                     num_gpu_blocks=num_blocks))


def build_contender(name: str, args: argparse.Namespace, hf_config: dict[str, Any] | None,
                    num_blocks: int) -> Contender:
    """Build the runner of contender ``name`` (model load, compile set-up and graph capture)."""
    if name not in (*CONTENDER_NAMES, DBO_CONTENDER):
        raise ValueError(f"unknown contender {name!r}; expected some of "
                         f"{[*CONTENDER_NAMES, DBO_CONTENDER]}")
    start = time.perf_counter()
    cfg = engine_config_for(name, args, hf_config, num_blocks)
    # the baselines' config has "-cpu_linear" and "-cpu_attention": plain F.linear weights,
    # attention by torch ops
    runner = ModelRunner(cfg)
    contender = Contender(name, runner, cfg, 0.0)
    if name == "torch.compile":
        inner = runner.module.get_submodule("model")
        compiled = torch.compile(inner, dynamic=True, backend=_counting_inductor(contender._traces))
        runner.module.add_module("model", cast(nn.Module, compiled))
    runner.capture_model()
    contender.build_s = time.perf_counter() - start
    return contender
