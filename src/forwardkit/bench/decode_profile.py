"""Where a decode step goes: ``forwardkit bench --generation --profile``.

Runs greedy generation on a forwardkit :class:`~forwardkit.engine.llm.LLM` and takes apart its
decode steps (every request past its prompt, one token each). Every second decode step runs
under ``torch.profiler`` (operator events with their input shapes); the steps between run
without it, so the table also shows what the profiler itself adds. Per profiled step:

* ``linear <layer>``: the projections, one row per weight shape (the layers sharing it are
  named), from the ``forwardkit::linear`` op, or ``aten::linear`` / ``mm`` / ``addmm`` for
  weights left on plain ``F.linear``; the LM head is its own row;
* ``attention``: the opaque attention ops between the compiled pieces;
* ``norms / rotary / activation``: the rest of the model forward (Inductor's fused kernels for
  RMSNorm, rotary embedding, SiLU-and-mul, residual adds, and the pieces' Python glue);
* ``sampling``: :class:`~forwardkit.engine.sampler.Sampler` on the step's logits;
* ``host: ...``: the engine's own work: the scheduler (``schedule`` + ``update``), the model
  runner outside the model (inputs, plan, attention metadata, forward context, row selection)
  and the rest of the engine step.

Figures are medians over the profiled steps; ``step`` rows give the whole step with and without
the profiler. Below the table, the native CPU kernels' calls per profiled step (their own
counter, :data:`forwardkit.kernels.cpu.native_build.kernel_calls`): whether the native decode
attention and few-row linear served the step or PyTorch did.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, ParamSpec, TypedDict, TypeVar, cast

import torch

from forwardkit.kernels.cpu.native_build import kernel_calls

if TYPE_CHECKING:
    from torch.autograd.profiler_util import FunctionEvent

    from forwardkit.engine.llm import LLM
    from forwardkit.engine.request import Request
    from forwardkit.runner.model_runner import StepModel

__all__ = ["DecodeProfile", "format_profiles", "profile_decode", "ROW_KINDS"]

ROW_KINDS = ("linear", "lm_head", "attention", "elementwise", "sampling", "host_scheduler",
             "host_runner", "host_engine", "step_profiled", "step_unprofiled")
"""Every profile has one row of each kind except ``linear``, which has one per weight shape."""

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Shape = tuple[int, int, int]  # (rows, out, in) of a linear product

_LINEAR_OPS = {"forwardkit::linear", "forwardkit::quant_linear", "forwardkit::quant_linear_q8",
               "aten::linear", "aten::mm", "aten::addmm", "aten::matmul"}


@dataclasses.dataclass
class ProfileRow:
    """One line of the table: what, the layers or shape, calls per step, ms per step."""

    kind: str
    label: str
    detail: str
    calls: float
    ms: float


@dataclasses.dataclass
class DecodeProfile:
    """The decode-step breakdown of one batch size."""

    batch_size: int
    steps: int
    rows: list[ProfileRow]
    kernel_calls: dict[str, float] = dataclasses.field(default_factory=dict)
    """Median calls per profiled step served by each native CPU kernel (``attention``,
    ``linear``), from the kernels' own counter."""

    def by_kind(self, kind: str) -> list[ProfileRow]:
        """The rows of one kind."""
        return [r for r in self.rows if r.kind == kind]


class _StepSample(TypedDict):
    """One profiled step: total ms, ms per wrapped call, linear [ms, calls] per shape,
    attention (ms, calls)."""

    total: float
    spent: dict[str, float]
    linear: dict[_Shape, list[float]]
    attn: tuple[float, int]
    kernels: dict[str, int]


class _Timers:
    """Wall time of wrapped calls, per name, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.spent: defaultdict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[_P, _R]) -> Callable[_P, _R]:
        def timed(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - start
        return timed


class _ModelProxy:
    """Stands in for ``runner.model`` during profiling: times the forward and the LM head,
    forwards everything else."""

    def __init__(self, model: StepModel, timers: _Timers) -> None:
        self._model = model
        self._forward = timers.wrap("forward", model.__call__)
        self.compute_logits = timers.wrap("logits", model.compute_logits)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._forward(input_ids, positions)

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)


@contextmanager
def _instrumented(llm: LLM, timers: _Timers) -> Iterator[None]:
    """Wrap the engine's parts on the instance (restored afterwards)."""
    saved: dict[tuple[object, str], object] = {
        (llm.scheduler, "schedule"): llm.scheduler.__dict__.get("schedule"),
        (llm.scheduler, "update"): llm.scheduler.__dict__.get("update"),
        (llm.runner, "execute"): llm.runner.__dict__.get("execute"),
        (llm.sampler, "sample"): llm.sampler.__dict__.get("sample"),
    }
    model = llm.runner.model
    for (obj, name) in saved:
        setattr(obj, name, timers.wrap(f"{type(obj).__name__}.{name}", getattr(obj, name)))
    llm.runner.model = _ModelProxy(model, timers)
    try:
        yield
    finally:
        llm.runner.model = model
        for (obj, name), old in saved.items():
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


def _weight_names(model: torch.nn.Module) -> dict[tuple[int, int], list[str]]:
    """Weight shape (out, in) -> the layer names (``layers.N.`` dropped) that have it."""
    names: dict[tuple[int, int], list[str]] = defaultdict(list)
    for qualified, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if isinstance(module, torch.nn.Embedding) or "embed" in qualified.rsplit(".", 1)[-1]:
            continue
        parts = qualified.split(".")
        short = ".".join(p for i, p in enumerate(parts)
                         if not (p.isdigit() or (i + 1 < len(parts) and parts[i + 1].isdigit())))
        short = short.removeprefix("model.")
        # a packed (quantized) weight is [out, bytes]: the layer's own sizes name its shape
        out_in = (getattr(module, "output_size", None), getattr(module, "input_size", None))
        if weight.dtype == torch.uint8 and all(isinstance(v, int) for v in out_in):
            key = (int(out_in[0]), int(out_in[1]))  # type: ignore[arg-type]
        else:
            key = (int(weight.shape[0]), int(weight.shape[1]))
        if short not in names[key]:
            names[key].append(short)
    return dict(names)


def _linear_shape(name: str, shapes: Sequence[Sequence[int]]) -> _Shape | None:
    """(rows, out, in) of a linear-like op event from its input shapes."""
    try:
        if name in ("forwardkit::linear", "aten::linear"):
            x, w = shapes[0], shapes[1]
            return int(torch.Size(x[:-1]).numel()), int(w[0]), int(w[1])
        if name in ("forwardkit::quant_linear", "forwardkit::quant_linear_q8"):
            # (x or its int8 blocks, ..., packed [out, blocks * block bytes] at 1 or 3, ...)
            x, w = shapes[0], shapes[1 if name == "forwardkit::quant_linear" else 3]
            return int(torch.Size(x[:-1]).numel()), int(w[0]), int(x[-1])
        if name == "aten::mm":
            x, w = shapes[0], shapes[1]
            return int(x[0]), int(w[1]), int(w[0])
        if name == "aten::addmm":
            x, w = shapes[1], shapes[2]
            return int(x[0]), int(w[1]), int(w[0])
    except (IndexError, TypeError, ValueError):
        return None
    return None


def _step_ops(events: Iterable[FunctionEvent]) -> tuple[dict[_Shape, list[float]], float, int]:
    """From one profiled step's events: linear time per (rows, out, in) as [ms, calls],
    attention ms and calls. Only outermost linear events count (an ``aten::mm`` inside
    ``forwardkit::linear`` is the same product)."""
    linear: dict[_Shape, list[float]] = defaultdict(lambda: [0.0, 0.0])
    attn_ms, attn_calls = 0.0, 0
    for evt in events:
        name = evt.name
        if "unified_attention" in name:
            parent = evt.cpu_parent
            nested = False
            while parent is not None:
                if "unified_attention" in parent.name:
                    nested = True
                    break
                parent = parent.cpu_parent
            if not nested:
                attn_ms += evt.cpu_time_total / 1000
                attn_calls += 1
            continue
        if name not in _LINEAR_OPS:
            continue
        parent = evt.cpu_parent
        while parent is not None and parent.name not in _LINEAR_OPS:
            parent = parent.cpu_parent
        if parent is not None:
            continue
        # one shape per input (torch annotates the attribute as one flat tuple)
        shape = _linear_shape(name, cast("list[list[int]]", evt.input_shapes))
        if shape is None:
            continue
        linear[shape][0] += evt.cpu_time_total / 1000
        linear[shape][1] += 1
    return linear, attn_ms, attn_calls


def profile_decode(llm: LLM, batch_size: int, prompt_len: int = 32, steps: int = 8,
                   warmup: int = 2, seed: int = 0) -> DecodeProfile:
    """Profile ``steps`` decode steps of ``batch_size`` greedy requests on ``llm`` (plus as many
    unprofiled ones between them, after ``warmup`` decode steps)."""
    from forwardkit.engine.sampling_params import SamplingParams

    if batch_size < 1 or steps < 1 or prompt_len < 1:
        raise ValueError("batch_size, steps and prompt_len must be >= 1")
    rng = random.Random(seed)
    vocab = int(llm.runner.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch_size)]
    timers = _Timers()
    per_step: list[_StepSample] = []
    plain_ms: list[float] = []
    real_step = llm.step
    decode_seen = 0

    def step() -> list[Request]:
        nonlocal decode_seen
        waiting, running = llm.scheduler.waiting, llm.scheduler.running
        decoding = not waiting and len(running) == batch_size and all(
            r.num_computed_tokens >= len(r.prompt_token_ids) for r in running)
        if not decoding:
            return real_step()
        decode_seen += 1
        index = decode_seen - warmup
        if index < 1 or len(per_step) >= steps and len(plain_ms) >= steps:
            return real_step()
        if index % 2 == 0:  # between profiled steps: the step as it runs without the profiler
            start = time.perf_counter()
            out = real_step()
            plain_ms.append((time.perf_counter() - start) * 1000)
            return out
        if len(per_step) >= steps:
            return real_step()
        timers.spent.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    record_shapes=True) as prof:
            timers.on = True
            served = kernel_calls.snapshot()
            start = time.perf_counter()
            out = real_step()
            total = time.perf_counter() - start
            timers.on = False
            served = kernel_calls.since(served)
        linear, attn_ms, attn_calls = _step_ops(prof.events())
        per_step.append({"total": total * 1000, "spent": {k: v * 1000 for k, v in timers.spent.items()},
                         "linear": dict(linear), "attn": (attn_ms, attn_calls), "kernels": served})
        return out

    vars(llm)["step"] = step  # on the instance: the class's method stays as it is
    try:
        with _instrumented(llm, timers):
            params = SamplingParams(temperature=0.0, max_tokens=warmup + 2 * steps + 2,
                                    ignore_eos=True)
            llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        del vars(llm)["step"]
    if not per_step:
        raise RuntimeError("no decode step was profiled (did the prompts not fit one step?)")
    kernels = {name: float(statistics.median(step["kernels"][name] for step in per_step))
               for name in per_step[0]["kernels"]}
    return DecodeProfile(batch_size, len(per_step), _rows(llm, per_step, plain_ms), kernels)


def _rows(llm: LLM, per_step: list[_StepSample], plain_ms: list[float]) -> list[ProfileRow]:
    def med(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    names = _weight_names(llm.runner.module)
    vocab = int(llm.runner.vocab_size)
    shapes = sorted({s for step in per_step for s in step["linear"]}, key=lambda s: (s[1] != vocab, s))
    rows: list[ProfileRow] = []
    linear_in_forward: list[float] = [0.0] * len(per_step)
    for shape in shapes:
        ms = [step["linear"].get(shape, [0.0, 0.0])[0] for step in per_step]
        calls = med([step["linear"].get(shape, [0.0, 0.0])[1] for step in per_step])
        layer = ", ".join(names.get(shape[1:], ["?"]))
        kind = "lm_head" if shape[1] == vocab else "linear"
        if kind == "linear":
            for i, v in enumerate(ms):
                linear_in_forward[i] += v
        detail = f"{shape[0]}x{shape[2]} -> {shape[1]}"
        rows.append(ProfileRow(kind, "LM head" if kind == "lm_head" else f"linear {layer}",
                               detail, calls, med(ms)))
    if not any(r.kind == "lm_head" for r in rows):
        rows.append(ProfileRow("lm_head", "LM head", "-", 0, 0.0))
    spent = [step["spent"] for step in per_step]
    attn = [step["attn"][0] for step in per_step]
    rows.append(ProfileRow("attention", "attention", "opaque op", med([s["attn"][1] for s in per_step]),
                           med(attn)))
    rest = [s.get("forward", 0.0) - lin - a for s, lin, a in zip(spent, linear_in_forward, attn)]
    rows.append(ProfileRow("elementwise", "norms / rotary / activation", "rest of the forward", 0,
                           med(rest)))
    rows.append(ProfileRow("sampling", "sampling", "Sampler", 1, med([s.get("Sampler.sample", 0.0)
                                                                      for s in spent])))
    sched = [s.get("Scheduler.schedule", 0.0) + s.get("Scheduler.update", 0.0) for s in spent]
    rows.append(ProfileRow("host_scheduler", "host: scheduler", "schedule + update", 2, med(sched)))
    runner = [s.get("ModelRunner.execute", 0.0) - s.get("forward", 0.0) - s.get("logits", 0.0)
              for s in spent]
    rows.append(ProfileRow("host_runner", "host: model runner", "inputs, plan, metadata, context",
                           1, med(runner)))
    engine = [step["total"] - s.get("ModelRunner.execute", 0.0) - s.get("Sampler.sample", 0.0) - sc
              for step, s, sc in zip(per_step, spent, sched)]
    rows.append(ProfileRow("host_engine", "host: engine step", "rest of LLM.step", 1, med(engine)))
    rows.append(ProfileRow("step_profiled", "step (profiled)", "", 1,
                           med([step["total"] for step in per_step])))
    rows.append(ProfileRow("step_unprofiled", "step (no profiler)", "", 1, med(plain_ms)))
    return rows


def format_profiles(profiles: list[DecodeProfile], title: str) -> str:
    """The profiles as one text table, a column pair (ms, share of the profiled step) per batch."""
    head = f"{'part':<44}"
    for p in profiles:
        head += f"{f'B={p.batch_size} shape':>22}{'calls':>7}{'ms/step':>10}{'share':>7}"
    lines = [title, "", head, "-" * len(head)]
    labels: list[tuple[str, str]] = []
    for p in profiles:
        for r in p.rows:
            if (r.kind, r.label) not in labels:
                labels.append((r.kind, r.label))
    for kind, label in labels:
        line = f"{label[:43]:<44}"
        for p in profiles:
            total = next(r.ms for r in p.rows if r.kind == "step_profiled") or 1.0
            row = next((r for r in p.rows if r.kind == kind and r.label == label), None)
            if row is None:
                line += f"{'':>22}{'':>7}{'-':>10}{'':>7}"
                continue
            share = "" if kind.startswith("step") else f"{row.ms / total:.0%}"
            calls = f"{row.calls:.0f}" if row.calls else ""
            line += f"{row.detail[:21]:>22}{calls:>7}{row.ms:>10.2f}{share:>7}"
        lines.append(line)
    lines.append("")
    for p in profiles:
        served = ", ".join(f"{name} {count:.0f}" for name, count in sorted(p.kernel_calls.items()))
        lines.append(f"B={p.batch_size}: native CPU kernel calls per step: {served or '-'}")
    return "\n".join(lines)
