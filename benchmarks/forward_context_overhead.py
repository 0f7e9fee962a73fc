"""Per-step CPU overhead of the forward context and of the CUDA-graph padding lookup.

Measures, in microseconds per step (median over repeats):

* ``set_forward_context`` enter + exit + one ``get_forward_context()`` with an engine config
  and a per-layer attention-metadata dict, telemetry off and on;
* the same as a data-parallel runner step does it: ``data_parallel_size=2`` (MoE), the agreed
  per-rank token counts passed in (``num_tokens_across_dp``), so entering builds ``DPMetadata``;
* the same with ``override_forward_context`` around a prebuilt context (the floor);
* the alternative a user would write by hand: a plain module global swapped by a
  ``@contextmanager`` generator (vLLM's pattern), for comparison;
* the padding lookup ``bs_to_padded_graph_size[n]`` (and ``pad_for_cudagraph(n)``);
* optionally, when ``vllm`` is importable: vLLM's own ``set_forward_context`` +
  ``get_forward_context`` in the same process, with the same arguments as the first two rows
  (a real ``VllmConfig``, its batch-size telemetry off), timed in loops interleaved with the
  forwardkit loops; the ``vs vLLM`` column is forwardkit us / vLLM us.

Usage: ``python benchmarks/forward_context_overhead.py --iters 20000``

vLLM on a CPU-only machine, without touching the torch you have (in a venv)::

    pip install vllm==0.14.0 --no-deps
    pip install psutil cbor2 aiohttp pyzmq msgspec blake3 cachetools pybase64 prometheus_client \
        py-cpuinfo cloudpickle pillow requests

The CUDA wheel detects no platform without a GPU; this script then gives vLLM its
``CpuPlatform`` (the platform only contributes ``set_additional_forward_context``, which is
``{}`` on every built-in platform).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

import forwardkit.forward_context as fc
from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.forward_context import (
    BatchDescriptor,
    create_forward_context,
    get_forward_context,
    override_forward_context,
    set_forward_context,
)
from forwardkit.platforms import use_platform


def capture_sizes(max_size: int = 512) -> list[int]:
    """vLLM's default capture sizes: 1, 2, 4, then steps of 8 to 256, then 16 to 512."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_size + 1, 16))
    return [s for s in sizes if s <= max_size]


def padding_table(sizes: list[int]) -> list[int]:
    """``bs_to_padded_graph_size``: index n -> smallest capture size >= n."""
    table = [0] * (sizes[-1] + 1)
    it = iter(sizes)
    current = next(it)
    for n in range(1, len(table)):
        while current < n:
            current = next(it)
        table[n] = current
    return table


def make_config(num_layers: int, dp: int = 1) -> Any:
    """A real EngineConfig (``dp`` > 1: data parallel, rank 0, MoE), else a stand-in."""
    try:
        from forwardkit.config.engine import EngineConfig
        from forwardkit.config.parallel import ParallelConfig

        if dp > 1:
            cfg = EngineConfig(parallel_config=ParallelConfig(
                data_parallel_size=dp, data_parallel_rank=0, is_moe_model=True))
        else:
            cfg = EngineConfig()
    except Exception:  # pragma: no cover - only while the config layer is incomplete
        cfg = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1),
                              compilation_config=SimpleNamespace(static_forward_context={}))
    layers = cfg.compilation_config.static_forward_context
    for i in range(num_layers):
        layers.setdefault(f"model.layers.{i}.self_attn.attn", object())
    return cfg


def time_interleaved(steps: list[Callable[[int], Any]], iters: int, repeats: int) -> list[float]:
    """Median microseconds per call of each ``step(i)`` over ``repeats`` timed loops.

    The loops take turns (A, B, A, B, ...), so drift of the machine hits every step alike.
    """
    per_loop = max(1, iters // repeats)
    samples: list[list[float]] = [[] for _ in steps]
    for r in range(repeats + 1):
        for step, out in zip(steps, samples):
            t0 = time.perf_counter_ns()
            for i in range(per_loop):
                step(i)
            elapsed = time.perf_counter_ns() - t0
            if r:  # the first round is a warm-up
                out.append(elapsed / per_loop / 1000)
    return [statistics.median(out) for out in samples]


def time_per_step(step: Callable[[int], Any], iters: int, repeats: int) -> float:
    """Median microseconds per call of ``step(i)`` over ``repeats`` timed loops."""
    return time_interleaved([step], iters, repeats)[0]


VLLM_VERSION = "0.14.0"
VLLM_EXTRA_DEPS = ("psutil cbor2 aiohttp pyzmq msgspec blake3 cachetools pybase64 "
                   "prometheus_client py-cpuinfo cloudpickle pillow requests")


def load_vllm() -> tuple[SimpleNamespace | None, str]:
    """vLLM's forward-context module and a platform for it, or (None, why not)."""
    if importlib.util.find_spec("vllm") is None:
        return None, "vllm is not installed"
    # vLLM logs INFO lines while building configs; keep them out of the table (env overrides).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm
        import vllm.platforms as vllm_platforms

        platform_note = ""
        if not vllm_platforms.current_platform.device_type:
            # Nothing detected (e.g. the CUDA wheel without a GPU): use vLLM's CPU platform.
            # vllm.forward_context binds current_platform when imported, so set it first.
            from vllm.platforms.cpu import CpuPlatform

            vllm_platforms.current_platform = CpuPlatform()
            platform_note = " (set by this script: none detected)"
        import vllm.forward_context as vllm_fc
        from vllm.config import CUDAGraphMode as VllmCUDAGraphMode
    except Exception as exc:  # a vllm that does not import here is the same as none
        return None, f"import vllm failed ({type(exc).__name__}: {exc})"
    platform = type(vllm_fc.current_platform).__name__ + platform_note
    return SimpleNamespace(version=vllm.__version__, fc=vllm_fc, mode=VllmCUDAGraphMode,
                           platform=platform), ""


def make_vllm_config(num_layers: int, dp: int = 1) -> tuple[Any, str]:
    """A real ``vllm.config.VllmConfig`` (``dp`` > 1: DP rank 0, MoE), else a stand-in."""
    saved_env = dict(os.environ)  # vLLM's platform hooks export thread / preload settings
    try:
        from vllm.config import ParallelConfig, VllmConfig

        if dp > 1:
            cfg: Any = VllmConfig(parallel_config=ParallelConfig(
                data_parallel_size=dp, data_parallel_rank=0, is_moe_model=True))
        else:
            cfg = VllmConfig()
        kind = "VllmConfig"
    except Exception as exc:
        cfg = SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_size=dp, data_parallel_rank=0,
                                            is_moe_model=True),
            compilation_config=SimpleNamespace(static_forward_context={}))
        kind = f"stand-in namespace (VllmConfig failed: {type(exc).__name__})"
    finally:
        for key in set(os.environ) - set(saved_env):
            del os.environ[key]
        os.environ.update(saved_env)
    layers = cfg.compilation_config.static_forward_context
    for i in range(num_layers):
        layers.setdefault(f"model.layers.{i}.self_attn.attn", object())
    return cfg, kind


_GLOBAL_CTX: Any = None


@contextmanager
def _global_context(ctx: Any) -> Iterator[None]:
    """The hand-written alternative: one process global swapped by a generator."""
    global _GLOBAL_CTX
    prev, _GLOBAL_CTX = _GLOBAL_CTX, ctx
    try:
        yield
    finally:
        _GLOBAL_CTX = prev


def main(argv: list[str] | None = None) -> int:
    """Run the measurements and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20000, help="steps per measurement")
    parser.add_argument("--repeats", type=int, default=21, help="timed loops per measurement")
    parser.add_argument("--layers", type=int, default=32, help="attention layers in the dict")
    parser.add_argument("--num-tokens", type=int, default=13)
    args = parser.parse_args(argv)
    if args.iters < args.repeats or args.repeats < 1:
        parser.error("--iters must be >= --repeats >= 1")
    vl, vllm_missing = load_vllm()

    with use_platform("cpu"):
        cfg = make_config(args.layers)
        attn = {name: SimpleNamespace(slot_mapping=None)
                for name in cfg.compilation_config.static_forward_context}
        n = args.num_tokens
        desc = BatchDescriptor(16)
        mode = CUDAGraphMode.PIECEWISE

        def fk_step(_: int) -> None:
            with set_forward_context(attn, cfg, num_tokens=n, cudagraph_runtime_mode=mode,
                                     batch_descriptor=desc):
                get_forward_context()

        dp_cfg = make_config(args.layers, dp=2)
        across_dp = torch.tensor([n, n + 3], dtype=torch.int32)  # what the planner hands in

        def fk_dp_step(_: int) -> None:
            with set_forward_context(attn, dp_cfg, num_tokens=n, num_tokens_across_dp=across_dp,
                                     cudagraph_runtime_mode=mode, batch_descriptor=desc):
                get_forward_context()

        prebuilt = create_forward_context(attn, cfg, cudagraph_runtime_mode=mode,
                                          batch_descriptor=desc)

        def override_step(_: int) -> None:
            with override_forward_context(prebuilt):
                get_forward_context()

        def global_step(_: int) -> None:
            with _global_context(prebuilt):
                _ = _GLOBAL_CTX

        vllm_steps: list[Callable[[int], Any]] = []
        if vl is not None:
            vl_cfg, vl_kind = make_vllm_config(args.layers)
            vl_dp_cfg, vl_dp_kind = make_vllm_config(args.layers, dp=2)
            vl_set, vl_get = vl.fc.set_forward_context, vl.fc.get_forward_context
            vl_desc = vl.fc.BatchDescriptor(16)
            vl_mode = vl.mode.PIECEWISE

            def vllm_step(_: int) -> None:
                with vl_set(attn, vl_cfg, num_tokens=n, cudagraph_runtime_mode=vl_mode,
                            batch_descriptor=vl_desc):
                    vl_get()

            def vllm_dp_step(_: int) -> None:
                with vl_set(attn, vl_dp_cfg, num_tokens=n, num_tokens_across_dp=across_dp,
                            cudagraph_runtime_mode=vl_mode, batch_descriptor=vl_desc):
                    vl_get()

            with vl_set(attn, vl_dp_cfg, num_tokens=n, num_tokens_across_dp=across_dp,
                        cudagraph_runtime_mode=vl_mode, batch_descriptor=vl_desc):
                dp_meta = vl_get().dp_metadata  # the DP row must really build DPMetadata
            if dp_meta is None or int(dp_meta.max_tokens_across_dp_cpu) != n + 3:
                raise RuntimeError(f"vLLM built no / wrong DPMetadata: {dp_meta}")
            vllm_steps = [vllm_step, vllm_dp_step]

        table = padding_table(capture_sizes())
        sizes = [1 + (i * 37) % (len(table) - 1) for i in range(1024)]

        def pad_step(i: int) -> int:
            return table[sizes[i & 1023]]

        # (operation, telemetry, us, us of the matching vLLM row or None)
        rows: list[tuple[str, str, float, float | None]] = []
        saved = (fc.track_batchsize, fc.batchsize_logging_interval)
        vl_saved = vl.fc.track_batchsize if vl is not None else False
        try:
            fc.track_batchsize = False
            if vl is not None:
                vl.fc.track_batchsize = False  # vLLM's default (VLLM_LOG_BATCHSIZE_INTERVAL=-1)
            for label, fk, other in (("set_forward_context + get", fk_step, vllm_steps[:1]),
                                     ("set_forward_context(DP=2) + get", fk_dp_step,
                                      vllm_steps[1:])):
                fk_us, *vl_us = time_interleaved([fk, *other], args.iters, args.repeats)
                rows.append((label, "off", fk_us, vl_us[0] if vl_us else None))
                if vl is not None and vl_us:
                    rows.append((f"vLLM {vl.version} {label}", "off", vl_us[0], None))
            fc.track_batchsize, fc.batchsize_logging_interval = True, 1e12  # record, never log
            rows.append(("set_forward_context + get", "on",
                         time_per_step(fk_step, args.iters, args.repeats), None))
        finally:
            fc.track_batchsize, fc.batchsize_logging_interval = saved
            fc.reset_batchsize_stats()
            if vl is not None:
                vl.fc.track_batchsize = vl_saved
        rows.append(("override_forward_context + get", "-",
                     time_per_step(override_step, args.iters, args.repeats), None))
        rows.append(("baseline: global + @contextmanager", "-",
                     time_per_step(global_step, args.iters, args.repeats), None))
        rows.append(("bs_to_padded_graph_size[n]", "-",
                     time_per_step(pad_step, args.iters, args.repeats), None))
        pad_fn = getattr(cfg, "pad_for_cudagraph", None)
        if pad_fn is not None and getattr(cfg.compilation_config, "bs_to_padded_graph_size", None):
            rows.append(("EngineConfig.pad_for_cudagraph(n)", "-",
                         time_per_step(lambda i: pad_fn(sizes[i & 1023]), args.iters,
                                       args.repeats), None))

    print(f"forward-context overhead: {args.iters} steps x {args.repeats} loops, "
          f"{args.layers} attention layers, config {type(cfg).__name__}")
    if vl is None:
        print(f"vLLM rows skipped: {vllm_missing}; to add them (in a venv, keeps your torch): "
              f"pip install vllm=={VLLM_VERSION} --no-deps && pip install {VLLM_EXTRA_DEPS}")
        width = 38
        print(f"{'operation':<{width}} {'telemetry':>9} {'median us/step':>15}")
        for name, telemetry_state, us, _ in rows:
            print(f"{name:<{width}} {telemetry_state:>9} {us:>15.3f}")
        return 0
    config_note = vl_kind if vl_kind == vl_dp_kind else f"{vl_kind} / DP=2: {vl_dp_kind}"
    print(f"vLLM {vl.version} rows: vllm.forward_context.set_forward_context + "
          f"get_forward_context, config {config_note}, platform {vl.platform}, telemetry off; "
          "loops interleaved with the forwardkit row above; vs vLLM = forwardkit us / vLLM us")
    width = max(38, *(len(name) for name, *_ in rows))
    print(f"{'operation':<{width}} {'telemetry':>9} {'median us/step':>15} {'vs vLLM':>8}")
    for name, telemetry_state, us, ref in rows:
        ratio = f"{us / ref:.2f}" if ref else "-"
        print(f"{name:<{width}} {telemetry_state:>9} {us:>15.3f} {ratio:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
