"""Compile (or load) one piece for one range or size: Inductor's standalone compile or eager.

Only the standalone path is implemented (the reference's legacy hook-based adaptor is broken on
torch 2.13). Range compiles use ``dynamic_shapes="from_graph"`` with the piece's fake inputs;
size compiles use ``"from_example_inputs"`` with the real ones, so their shapes are static.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from forwardkit.compilation.cache import CompileCache, inductor_cache_dir
from forwardkit.compilation.counters import compilation_counter
from forwardkit.compilation.vec_isa import prime_vec_isa_list
from forwardkit.config.compilation_enums import Range
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from forwardkit.config.compilation import CompilationConfig

__all__ = ["PieceCompileError", "PieceCompiler", "current_compile_range", "pass_context"]

logger = init_logger(__name__)

_current_range: list[Range] = []


@contextlib.contextmanager
def pass_context(compile_range: Range) -> Iterator[None]:
    """Make ``compile_range`` visible to the post-grad passes of the compile inside the block."""
    _current_range.append(compile_range)
    try:
        yield
    finally:
        _current_range.pop()


def current_compile_range() -> Range | None:
    """The range being compiled, or None outside a compile."""
    return _current_range[-1] if _current_range else None


class PieceCompileError(RuntimeError):
    """Compiling one piece for one range or size failed; the message names both."""


def _artifact_name(fingerprint: str, entry: Range) -> str:
    kind = f"size_{entry.start}" if entry.is_single_size() else f"range_{entry.start}_{entry.end}"
    return f"artifact_{kind}_piece_{fingerprint}"


def _unwrapping(fn: Callable[..., Any], returns_tuple: bool) -> Callable[..., Any]:
    """A loaded artifact always returns a sequence; unwrap it for single-output pieces."""
    if returns_tuple:
        return fn

    def call(*args: Any) -> Any:
        out = fn(*args)
        return out[0] if isinstance(out, (list, tuple)) else out

    return call


class PieceCompiler:
    """Turns (piece graph, inputs, range) into a runnable, using the on-disk cache when enabled."""

    def __init__(
        self,
        backend: str,
        inductor_config: dict[str, Any],
        cache: CompileCache | None,
        compilation_config: CompilationConfig | None = None,
    ) -> None:
        if backend not in ("inductor", "eager"):
            raise ValueError(
                f"piecewise backend {backend!r} is not supported; use 'inductor' or 'eager'"
            )
        self.backend = backend
        self.inductor_config = inductor_config
        self.cache = cache
        self.compilation_config = compilation_config
        self._isa_state: str | None = None  # see vec_isa.prime_vec_isa_list

    def _prime_isa(self) -> None:
        """Settle Inductor's CPU ISA list once, from the cache's probe record when it applies."""
        if self._isa_state is not None or self.cache is None:
            return
        try:
            self._isa_state = prime_vec_isa_list(self.cache.root)
        except Exception as e:  # Inductor probes by itself later; never fail a step over this
            self._isa_state = "failed"
            logger.warning_once("vector-ISA priming failed (%s); Inductor will probe", str(e))

    def add_compilation_time(self, seconds: float) -> None:
        """Accumulate into the config's run-time ``compilation_time`` (``compile_state``) when
        there is a config."""
        cfg = self.compilation_config
        if cfg is not None:
            cfg.compile_state.compilation_time += seconds

    def compile_or_load(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        entry: Range,
        fingerprint: str,
        label: str,
    ) -> tuple[Callable[..., Any], str]:
        """Return ``(runnable, "compiled" | "loaded" | "eager")`` for this piece and entry."""
        if self.backend == "eager":
            compilation_counter.num_eager_compiles += 1
            return graph, "eager"
        from torch._inductor import CompiledArtifact
        from torch._inductor.compile_fx import graph_returns_tuple

        returns_tuple = graph_returns_tuple(graph)
        name = _artifact_name(fingerprint, entry)
        fmt = self.cache.save_format if self.cache is not None else "binary"
        self._prime_isa()
        if self.cache is not None:
            loaded = self.cache.load(name, lambda p: CompiledArtifact.load(path=p, format=fmt))
            if loaded is not None:
                return _unwrapping(loaded, returns_tuple), "loaded"
        static = entry.is_single_size()
        try:
            with (
                inductor_cache_dir(self.cache.inductor_dir if self.cache else None),
                pass_context(entry),
                torch._inductor.config.patch(compile_threads=1),
            ):
                artifact = torch._inductor.standalone_compile(
                    copy.deepcopy(graph),
                    list(example_inputs),
                    dynamic_shapes="from_example_inputs" if static else "from_graph",
                    options={"config_patches": dict(self.inductor_config)},
                )
        except Exception as e:
            compilation_counter.num_compile_failures += 1
            raise PieceCompileError(
                f"compiling {label} for {'size' if static else 'range'} {entry} with Inductor "
                f"failed: {type(e).__name__}: {e}. The next call for this size retries."
            ) from e
        compilation_counter.num_inductor_compiles += 1
        if self.cache is not None:
            try:
                self.cache.save(name, lambda p: artifact.save(path=p, format=fmt))
            except Exception as e:  # a full disk must not fail the forward pass
                logger.warning_once("compile cache: could not save %s: %s", name, e)
        return _unwrapping(artifact, True), "compiled"


# What a first piece compile or artifact load imports (about 1-2 s on 2 cores). These are torch
# modules only: none imports forwardkit, so a thread importing them cannot wait on a module
# lock the main thread holds.
_COMPILE_MODULES = ("torch._dynamo", "torch._inductor.compile_fx", "torch._inductor",
                    "torch.utils.cpp_extension")


def prefetch_compiler_imports() -> threading.Thread | None:
    """Import what the first compile needs on a daemon thread and return it (None when all is
    imported). The model runner starts it before building the model and joins it before the
    first compile, so the imports overlap weight loading (which mostly runs with the GIL
    released) and never run beside the compile path's own imports."""
    import sys

    todo = [m for m in _COMPILE_MODULES if m not in sys.modules]
    if not todo:
        return None

    def run() -> None:
        for name in todo:
            try:
                importlib.import_module(name)
            except Exception:  # the compile path imports it again and reports the error
                return

    thread = threading.Thread(target=run, name="forwardkit-import-prefetch", daemon=True)
    thread.start()
    return thread
