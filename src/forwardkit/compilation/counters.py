"""Process-global compilation counters and the compile-time log helpers.

Tests read the counters to prove what happened (one Dynamo trace, N pieces, a cache hit
instead of a compile); :meth:`CompilationCounter.expect` asserts exact increments over a block.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from forwardkit.logger import init_logger

__all__ = ["CompilationCounter", "compilation_counter", "log_compile", "log_summary"]

logger = init_logger(__name__)


@dataclasses.dataclass
class CompilationCounter:
    """Integer counters, incremented by the decorator, the backend and the cache."""

    num_models_seen: int = 0  # decorated modules built with compilation active
    num_dynamo_traces: int = 0  # Dynamo handed a graph to a forwardkit-installed backend
    num_recompiles: int = 0  # a trace of a model that had already been traced once
    num_graphs_seen: int = 0  # the piecewise (mode 3) backend was called
    num_splits: int = 0  # splitting-op pieces after the split
    num_piecewise_graphs_seen: int = 0  # pieces after the split, splitting ones included
    num_piecewise_capturable_graphs_seen: int = 0  # compiled (non-splitting) pieces
    num_backend_compilations: int = 0  # compile-or-load requests for a (piece, range/size)
    num_inductor_compiles: int = 0  # real Inductor compiles
    num_eager_compiles: int = 0  # "compiles" with the eager backend
    num_shared_artifacts: int = 0  # requests served by an identical piece's artifact
    num_cache_hits: int = 0  # artifacts loaded from the on-disk cache
    num_cache_misses: int = 0  # lookups that found no usable entry
    num_cache_errors: int = 0  # corrupt / missing / unloadable entries detected
    num_compiled_artifacts_saved: int = 0  # artifacts written to the on-disk cache
    num_cache_entries_updated: int = 0  # index entries written
    num_compile_failures: int = 0  # compiles that raised
    num_sp_reduce_scatters: int = 0  # all-reduces the sequence-parallelism pass split
    num_norm_quant_fusions: int = 0  # quantized projections fed by their RMSNorm's int8 output
    num_act_quant_fusions: int = 0  # quantized projections fed by their SiLU-and-mul's int8 output
    num_aot_saves: int = 0  # Dynamo results saved by the AOT precompile path
    num_aot_loads: int = 0  # Dynamo results loaded instead of tracing
    num_cudagraph_captured: int = 0  # CUDA graphs captured (written by the graphs layer)
    num_gpu_runner_capture_triggers: int = 0
    stock_torch_compile_count: int = 0  # models compiled with plain torch.compile (mode 1)

    def clone(self) -> CompilationCounter:
        """A snapshot copy."""
        return dataclasses.replace(self)

    def reset(self) -> None:
        """Set every counter back to zero."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)

    def delta(self, before: CompilationCounter) -> dict[str, int]:
        """Non-zero differences ``self - before`` by field name."""
        out = {}
        for f in dataclasses.fields(self):
            d = getattr(self, f.name) - getattr(before, f.name)
            if d:
                out[f.name] = d
        return out

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that each named counter grows by exactly the given amount inside the block."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(deltas) - names)
        if unknown:
            raise ValueError(f"unknown counters {unknown}; known: {sorted(names)}")
        before = self.clone()
        yield
        for name, want in deltas.items():
            got = getattr(self, name) - getattr(before, name)
            assert got == want, f"{name}: expected +{want}, got +{got}"


compilation_counter = CompilationCounter()


def log_compile(what: str, seconds: float, *, source: str = "compiled") -> None:
    """One concise line per compile (or cache load) with the time spent."""
    logger.info("%s %s in %.2f s", source, what, seconds)


def log_summary(total_s: float, before: CompilationCounter | None = None) -> None:
    """A warm-up summary: total compile time and what the counters recorded."""
    c = compilation_counter
    d = c.delta(before) if before is not None else dataclasses.asdict(c)
    logger.info(
        "compilation summary: %.2f s; traces=%d recompiles=%d pieces=%d splits=%d "
        "compiles=%d (inductor %d, eager %d, shared %d) cache hits=%d misses=%d errors=%d",
        total_s,
        d.get("num_dynamo_traces", 0),
        d.get("num_recompiles", 0),
        d.get("num_piecewise_graphs_seen", 0),
        d.get("num_splits", 0),
        d.get("num_backend_compilations", 0),
        d.get("num_inductor_compiles", 0),
        d.get("num_eager_compiles", 0),
        d.get("num_shared_artifacts", 0),
        d.get("num_cache_hits", 0),
        d.get("num_cache_misses", 0),
        d.get("num_cache_errors", 0),
    )
