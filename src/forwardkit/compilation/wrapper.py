"""Trace once, drop every guard, then run the captured bytecode directly.

:class:`TraceOnceCompiler` owns one model instance's compile. It compiles a per-instance copy of
the class's ``forward`` code object (so Dynamo's cache is never shared between instances with
different configs, which dropped guards would otherwise allow), with ``guard_filter_fn``
dropping all guards. A Dynamo bytecode hook records the transformed code; later calls run that
code directly, skipping Dynamo's frame evaluation entirely (what vLLM's bytecode hook does).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch._guards import detect_fake_mode
from torch.utils._sympy.value_ranges import ValueRanges

from forwardkit.compilation.counters import compilation_counter
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from torch._dynamo.symbolic_convert import InliningInstructionTranslator
    from torch._dynamo.types import GuardFilterEntry
    from torch._dynamo.variables.base import VariableTracker

    from forwardkit.compilation.aot import AotEntry, GraphBackend, GraphFn

__all__ = ["GuardViolationError", "TraceOnceCompiler", "collect_traced_files"]

logger = init_logger(__name__)


@contextlib.contextmanager
def collect_traced_files(files: set[str]) -> Iterator[None]:
    """Record the source file of every function Dynamo inlines while tracing (for the cache key)."""
    from torch._dynamo.symbolic_convert import InliningInstructionTranslator

    original = InliningInstructionTranslator.inline_call_

    def patched(self: InliningInstructionTranslator) -> VariableTracker:
        files.add(self.f_code.co_filename)
        return original(self)

    InliningInstructionTranslator.inline_call_ = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        InliningInstructionTranslator.inline_call_ = original  # type: ignore[method-assign]


def _drop_all_guards(guards: Sequence[GuardFilterEntry]) -> list[bool]:
    return [False] * len(guards)


def _keep_shape_guards(guards: Sequence[GuardFilterEntry]) -> list[bool]:
    return [g.guard_type == "SHAPE_ENV" for g in guards]


# How torch words a guard failure: the fail_on_recompile stance (a traced frame) and an AOT
# compiled function's own guard check.
_TORCH_GUARD_FAILURES = ("Detected recompile when torch.compile stance", "fail_on_recompile",
                         "GuardManager check failed")


def _admit_sizes_0_and_1(example_inputs: list[torch.Tensor]) -> None:
    """Lower the range of every backed size symbol traced as ``>= 2`` to ``>= 0``, so the shape
    guards Dynamo derives after the compile do not reject sizes 0 and 1."""
    fake_mode = detect_fake_mode(example_inputs)
    shape_env = fake_mode.shape_env if fake_mode is not None else None
    if shape_env is None:
        return
    ranges = shape_env.var_to_range
    for symbol, value_range in list(ranges.items()):
        if value_range.lower == 2:
            ranges[symbol] = ValueRanges(0, value_range.upper)


class GuardViolationError(RuntimeError):
    """A call broke a shape guard of the compiled graph (``evaluate_guards=True``). The message
    is forwardkit's explanation followed by torch's original error text."""


class TraceOnceCompiler:
    """Compiles ``forward`` of one module instance once; dispatches later calls without Dynamo.

    With ``evaluate_guards`` (``dynamic_shapes_config.evaluate_guards``) the shape guards are
    kept and every call goes through Dynamo's guard check; a call that breaks one raises
    :class:`GuardViolationError` instead of tracing again or silently running a graph that was
    specialised for other shapes (vLLM: keep ``SHAPE_ENV`` guards, fail on recompile).
    """

    def __init__(self, module: torch.nn.Module, forward: Callable[..., object], backend: GraphBackend,
                 evaluate_guards: bool = False, backed_shapes: bool = True) -> None:
        self.module = module
        self.evaluate_guards = evaluate_guards
        # Backed dynamic sizes are traced as ">= 2" (Dynamo specialises 0 and 1); with the guards
        # kept, sizes 0 and 1 would then break "2 <= s0" on every call. As in vLLM, the kept
        # guards admit them: the traced graph serves every size.
        widen = evaluate_guards and backed_shapes
        self.traces = 0
        code = forward.__code__.replace()  # a fresh code object: a private Dynamo cache
        self.code = code
        fn = types.FunctionType(
            code, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__
        )
        fn.__kwdefaults__ = forward.__kwdefaults__
        fn.__qualname__ = forward.__qualname__
        self.fn = fn
        self.transformed: Callable[..., object] | None = None
        self.aot_fn: Callable[..., object] | None = None

        def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> GraphFn:
            self.traces += 1
            compilation_counter.num_dynamo_traces += 1
            if self.traces > 1:
                compilation_counter.num_recompiles += 1
                logger.warning("%s was traced again (trace #%d)", type(module).__name__, self.traces)
            compiled = backend(gm, example_inputs)
            if widen:
                _admit_sizes_0_and_1(example_inputs)
            return compiled

        self.counting_backend = counting_backend
        self.compiled = torch.compile(
            types.MethodType(fn, module),
            fullgraph=True,
            dynamic=False,
            backend=counting_backend,
            options={"guard_filter_fn": _keep_shape_guards if evaluate_guards else _drop_all_guards},
        )

    def _hook(self, code: types.CodeType, new_code: types.CodeType) -> types.CodeType | None:
        """Dynamo bytecode hook: remember our transformed code; returning None keeps it."""
        if code is self.code:
            self.transformed = types.FunctionType(
                new_code, self.fn.__globals__, self.fn.__name__, self.fn.__defaults__, self.fn.__closure__
            )
        return None

    def first_call(self, *args: object, **kwargs: object) -> object:
        """Trace, compile and run (records the transformed bytecode on the way)."""
        from torch._dynamo.convert_frame import register_bytecode_hook

        handle = register_bytecode_hook(self._hook)
        try:
            return self.compiled(*args, **kwargs)
        finally:
            handle.remove()

    def aot_first_call(self, entry: AotEntry, *args: object, **kwargs: object) -> object:
        """Trace through ``entry`` (an :class:`~forwardkit.compilation.aot.AotEntry`) so the result
        can be saved, then run it. Later calls run the AOT function (no Dynamo frame hook)."""
        self.aot_fn = entry.compile(self.fn, self.counting_backend, args, kwargs)
        return self.aot_fn(self.module, *args, **kwargs)

    def __call__(self, *args: object, **kwargs: object) -> object:
        if self.evaluate_guards:
            return self._guarded_call(*args, **kwargs)
        if self.aot_fn is not None:
            return self.aot_fn(self.module, *args, **kwargs)
        if self.transformed is not None:
            return self.transformed(self.module, *args, **kwargs)
        return self.compiled(*args, **kwargs)

    def _guarded_call(self, *args: object, **kwargs: object) -> object:
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self.compiled(*args, **kwargs)
        except RuntimeError as e:
            text = str(e)
            if not any(marker in text for marker in _TORCH_GUARD_FAILURES):
                raise
            failed = [line.strip()[2:].split("  #")[0] for line in text.splitlines()
                      if line.strip().startswith("- ")]
            # torch's own text follows, unchanged: code written against vLLM (which lets it
            # through) matches "Detected recompile when torch.compile stance ..." or
            # "GuardManager check failed".
            raise GuardViolationError(
                f"{type(self.module).__name__}: this call breaks a shape guard of the compiled "
                "graph (compilation_config.dynamic_shapes_config.evaluate_guards=True keeps and "
                f"checks them): {'; '.join(failed) or text.splitlines()[0]}\n"
                f"torch's error: {text}"
            ) from e
