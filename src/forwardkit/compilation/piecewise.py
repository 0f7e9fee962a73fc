"""Per-piece lazy compilation: one artifact per compile range and per compile size.

A :class:`PiecewiseBackend` replaces one compilable ``submod_<k>`` of the split module. On each
call it reads the token count (the first ``SymInt`` argument), picks the compile size equal to
it or else the compile range containing it (a size beats a range), and runs that entry's
artifact, compiling (or loading from the cache) on first use. Structurally identical pieces
(the middle of every decoder layer) share one artifact through :class:`ArtifactStore`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.fx

from forwardkit.compilation.compiler import PieceCompiler
from forwardkit.compilation.counters import compilation_counter, log_compile
from forwardkit.config.compilation_enums import Range
from forwardkit.logger import init_logger

__all__ = ["ArtifactStore", "PiecewiseBackend", "graph_fingerprint"]

logger = init_logger(__name__)

# A compiled piece: called with the piece's inputs (tensors, SymInts), returns its outputs.
Runnable = Callable[..., object]

# Used when the config defines no compile ranges (a standalone CompilationConfig).
CATCH_ALL = Range(1, 2**31 - 1)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"T({value.dtype},{tuple(str(s) for s in value.shape)},{tuple(str(s) for s in value.stride())},{value.device.type},{value.requires_grad})"
    if isinstance(value, torch.SymInt):
        return f"S({value.node.expr})"
    return f"V({type(value).__name__}:{value!r})"


def graph_fingerprint(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> str:
    """A hash of a piece's structure and input metadata, independent of node names.

    Two decoder layers' middle pieces differ only in placeholder names (lifted parameters),
    so they get the same fingerprint and share one compiled artifact. A piece that reads
    module attributes (``get_attr``) includes their names, so it never shares wrongly.
    """
    names: dict[torch.fx.Node, str] = {}
    lines = [";".join(_describe(v) for v in example_inputs)]

    def ref(a: torch.fx.node.Argument) -> torch.fx.node.Argument:
        return torch.fx.node.map_arg(a, lambda n: names[n])

    for i, node in enumerate(gm.graph.nodes):
        names[node] = f"n{i}"
        target = node.target
        if node.op == "call_function":
            target = torch.fx.node._get_qualified_name(target) if callable(target) else str(target)
        elif node.op == "placeholder":
            target = ""
        lines.append(f"{node.op}|{target}|{ref(node.args)!r}|{ref(dict(node.kwargs))!r}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


class ArtifactStore:
    """In-memory map (fingerprint, range) -> runnable shared by all pieces of one model."""

    def __init__(self, compiler: PieceCompiler) -> None:
        self.compiler = compiler
        self.runnables: dict[tuple[str, Range], Runnable] = {}

    def get(
        self,
        fingerprint: str,
        entry: Range,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[object],
        label: str,
    ) -> Runnable:
        """The runnable for ``(fingerprint, entry)``, compiling or loading it on first request."""
        key = (fingerprint, entry)
        compilation_counter.num_backend_compilations += 1
        found = self.runnables.get(key)
        if found is not None:
            compilation_counter.num_shared_artifacts += 1
            logger.debug("%s %s shares an identical piece's artifact", label, entry)
            return found
        start = time.perf_counter()
        runnable, source = self.compiler.compile_or_load(
            graph, example_inputs, entry, fingerprint, label
        )
        elapsed = time.perf_counter() - start
        self.compiler.add_compilation_time(elapsed)
        log_compile(f"{label} for {'size' if entry.is_single_size() else 'range'} {entry}", elapsed, source=source)
        self.runnables[key] = runnable
        return runnable


class PiecewiseBackend:
    """Callable that stands in for one compilable piece of the split graph.

    ``fake_inputs`` are the piece's inputs from the fake-tensor run of the split module;
    they are the example inputs of range compiles (symbolic shapes). Size compiles use the
    real arguments of the first call with that size (static shapes).
    """

    def __init__(
        self,
        graph: torch.fx.GraphModule,
        fake_inputs: Sequence[object],
        index: int,
        total: int,
        name: str,
        ranges: Sequence[Range],
        sizes: Sequence[int],
        store: ArtifactStore,
        on_all_compiled: Callable[[], None] | None = None,
    ) -> None:
        self.graph = graph
        self.fake_inputs = list(fake_inputs)
        self.index, self.total, self.name = index, total, name
        self.symint_positions = [i for i, a in enumerate(fake_inputs) if isinstance(a, torch.SymInt)]
        self.ranges = list(ranges) or [CATCH_ALL]
        self.sizes = sorted(set(sizes or []))
        self.store = store
        self.fingerprint = graph_fingerprint(graph, fake_inputs)
        self.on_all_compiled = on_all_compiled
        if self.symint_positions:
            self.todo: set[Range] = set(self.ranges) | {Range(s, s) for s in self.sizes}
        else:
            self.todo = {CATCH_ALL}
        # token count -> runnable; filled on first use of each count (a dict hit per step).
        self._by_n: dict[int | None, Runnable] = {}
        self._by_entry: dict[Range, Runnable] = {}

    @property
    def is_first(self) -> bool:
        """Whether this is the first compiled piece of the graph."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Whether this is the last compiled piece of the graph."""
        return self.index == self.total - 1

    def entry_for(self, n: int | None) -> Range:
        """The compile size equal to ``n``, else the first compile range containing it."""
        if n is None:
            return CATCH_ALL
        if n in self.sizes:
            return Range(n, n)
        for r in self.ranges:
            if n in r:
                return r
        raise ValueError(
            f"token count {n} is outside every compile range {self.ranges} of {self.name}; "
            "raise max_num_batched_tokens (the last range ends there) or pad the batch"
        )

    def __call__(self, *args: object) -> object:
        # at run time the first SymInt input holds the step's token count
        n = cast("int | None", args[self.symint_positions[0]]) if self.symint_positions else None
        runnable = self._by_n.get(n)
        if runnable is None:
            runnable = self._resolve(n, args)
        return runnable(*args)

    def _resolve(self, n: int | None, args: Sequence[object]) -> Runnable:
        entry = self.entry_for(n)
        static = entry.is_single_size() and n is not None
        runnable = self._by_entry.get(entry)
        if runnable is None:
            runnable = self.store.get(
                self.fingerprint,
                entry,
                self.graph,
                args if static else self.fake_inputs,
                f"piece {self.index}/{self.total} ({self.name})",
            )
            self._by_entry[entry] = runnable
        # Only mark done after success, so a failed compile is retried by the next call.
        self._by_n[n] = runnable
        if entry in self.todo:
            self.todo.discard(entry)
            if not self.todo and self.is_last and self.on_all_compiled is not None:
                self.on_all_compiled()
        return runnable
