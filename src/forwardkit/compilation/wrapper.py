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
from collections.abc import Callable, Iterator
from typing import Any

import torch

from forwardkit.compilation.counters import compilation_counter
from forwardkit.logger import init_logger

__all__ = ["TraceOnceCompiler", "collect_traced_files"]

logger = init_logger(__name__)


@contextlib.contextmanager
def collect_traced_files(files: set[str]) -> Iterator[None]:
    """Record the source file of every function Dynamo inlines while tracing (for the cache key)."""
    from torch._dynamo.symbolic_convert import InliningInstructionTranslator

    original = InliningInstructionTranslator.inline_call_

    def patched(self: Any) -> Any:
        files.add(self.f_code.co_filename)
        return original(self)

    InliningInstructionTranslator.inline_call_ = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        InliningInstructionTranslator.inline_call_ = original  # type: ignore[method-assign]


def _drop_all_guards(guards: list[Any]) -> list[bool]:
    return [False] * len(guards)


class TraceOnceCompiler:
    """Compiles ``forward`` of one module instance once; dispatches later calls without Dynamo."""

    def __init__(self, module: torch.nn.Module, forward: Callable[..., Any], backend: Any) -> None:
        self.module = module
        self.traces = 0
        code = forward.__code__.replace()  # a fresh code object: a private Dynamo cache
        self.code = code
        fn = types.FunctionType(
            code, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__
        )
        fn.__kwdefaults__ = forward.__kwdefaults__
        fn.__qualname__ = forward.__qualname__
        self.fn = fn
        self.transformed: Callable[..., Any] | None = None
        self.aot_fn: Callable[..., Any] | None = None

        def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            self.traces += 1
            compilation_counter.num_dynamo_traces += 1
            if self.traces > 1:
                compilation_counter.num_recompiles += 1
                logger.warning("%s was traced again (trace #%d)", type(module).__name__, self.traces)
            return backend(gm, example_inputs)

        self.counting_backend = counting_backend
        self.compiled = torch.compile(
            types.MethodType(fn, module),
            fullgraph=True,
            dynamic=False,
            backend=counting_backend,
            options={"guard_filter_fn": _drop_all_guards},
        )

    def _hook(self, old_code: types.CodeType, new_code: types.CodeType) -> None:
        if old_code is self.code:
            self.transformed = types.FunctionType(
                new_code, self.fn.__globals__, self.fn.__name__, self.fn.__defaults__, self.fn.__closure__
            )

    def first_call(self, *args: Any, **kwargs: Any) -> Any:
        """Trace, compile and run (records the transformed bytecode on the way)."""
        from torch._dynamo.convert_frame import register_bytecode_hook

        handle = register_bytecode_hook(self._hook)
        try:
            return self.compiled(*args, **kwargs)
        finally:
            handle.remove()

    def aot_first_call(self, entry: Any, *args: Any, **kwargs: Any) -> Any:
        """Trace through ``entry`` (an :class:`~forwardkit.compilation.aot.AotEntry`) so the result
        can be saved, then run it. Later calls run the AOT function (no Dynamo frame hook)."""
        self.aot_fn = entry.compile(self.fn, self.counting_backend, args, kwargs)
        return self.aot_fn(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.aot_fn is not None:
            return self.aot_fn(self.module, *args, **kwargs)
        if self.transformed is not None:
            return self.transformed(self.module, *args, **kwargs)
        return self.compiled(*args, **kwargs)
