"""``CUDAGraphWrapper``: capture a runnable once per batch descriptor, replay it afterwards.

Behaviour follows vLLM 0.14.0's ``vllm.compilation.cuda_graph``. Per call the wrapper reads the runtime mode and batch descriptor
from the forward context: if the mode is NONE or not this wrapper's mode it just calls the
runnable (this lets a FULL wrapper around the model and PIECEWISE wrappers around compiled
pieces coexist); otherwise it captures on first sight of the descriptor and replays later.

The graph primitives come from a :class:`GraphBackend` (default: ``torch.cuda.CUDAGraph``),
so the capture/replay/fall-through decisions can be tested on CPU with a fake backend.

Differences from the reference, on purpose:
* the platform's global graph pool is fetched at the first capture, not at construction, so a
  wrapper can be built on a machine without CUDA (vLLM's constructor fails there);
* vLLM's NCCL-allocator hook (``set_graph_pool_id``) is not needed: forwardkit has no custom
  NCCL buffer allocator;
* ``eager_warmups`` (default 0, like vLLM 0.14 whose runner does the warm-ups) lets a
  standalone user have the wrapper run a new descriptor eagerly N times before capturing it.
"""

from __future__ import annotations

import contextlib
import enum
import gc
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from forwardkit import envs
from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.cudagraph import monitor
from forwardkit.forward_context import BatchDescriptor, get_forward_context
from forwardkit.logger import init_logger
from forwardkit.platforms import current_platform

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig

__all__ = [
    "Graph",
    "CUDAGraphEntry",
    "CUDAGraphOptions",
    "CUDAGraphWrapper",
    "GraphBackend",
    "piecewise_cudagraph_options",
    "weak_ref_tensor",
    "weak_ref_tensors",
]

logger = init_logger(__name__)


@dataclass
class CUDAGraphOptions:
    """Per-wrapper options; piecewise pieces differ by position."""

    debug_log_enable: bool = True  # DEBUG-log each capture (first piece only for piecewise)
    gc_disable: bool = False  # make gc.collect / empty_cache no-ops during capture
    weak_ref_output: bool = True  # turn the output into weak refs inside the capture


class Graph(Protocol):
    """A captured graph as the wrappers use it (``torch.cuda.CUDAGraph`` or a test stand-in)."""

    def replay(self) -> None:
        """Launch the captured work again."""


@dataclass
class CUDAGraphEntry:
    """One captured graph: its key, the graph, its (weak) outputs and recorded input pointers."""

    batch_descriptor: BatchDescriptor
    cudagraph: Graph | None = None
    output: Any | None = None
    input_addresses: list[int] | None = None


def piecewise_cudagraph_options(index: int, num_pieces: int) -> CUDAGraphOptions:
    """Options for compiled piece ``index`` of ``num_pieces``.

    Only the first piece logs captures and keeps gc/empty_cache during capture; only the last
    piece turns its output into weak references inside the capture (no later graph reads it).
    """
    if isinstance(num_pieces, bool) or not isinstance(num_pieces, int) or num_pieces < 1:
        raise ValueError(f"num_pieces must be a positive int, got {num_pieces!r}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_pieces:
        raise ValueError(f"piece index must be an int in [0, {num_pieces}), got {index!r}")
    return CUDAGraphOptions(
        debug_log_enable=index == 0,
        gc_disable=index != 0,
        weak_ref_output=index == num_pieces - 1,
    )


def weak_ref_tensor(tensor: Any) -> Any:
    """A tensor aliasing ``tensor``'s memory without keeping it alive; non-tensors unchanged.

    The caller must keep the memory alive some other way (for graph outputs: the graph pool).
    """
    if not isinstance(tensor, torch.Tensor):
        return tensor
    storage = tensor.untyped_storage()
    weak_storage = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), tensor.device, storage.nbytes()
    )
    weak = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return weak.set_(weak_storage, tensor.storage_offset(), tensor.size(), tensor.stride())


def weak_ref_tensors(tensors: Any) -> Any:
    """Weak references for a tensor, a list/tuple of tensors, or an object with ``.tensors``.

    Objects with a ``tensors`` dict (``IntermediateTensors``) are rebuilt as
    ``type(obj)(weak dict)``. Anything else raises ``ValueError("Invalid type for tensors")``.
    """
    if isinstance(tensors, torch.Tensor):
        return weak_ref_tensor(tensors)
    if isinstance(tensors, list):
        return [weak_ref_tensor(t) for t in tensors]
    if isinstance(tensors, tuple):
        return tuple(weak_ref_tensor(t) for t in tensors)
    inner = getattr(tensors, "tensors", None)
    if isinstance(inner, dict):
        return type(tensors)({k: weak_ref_tensor(v) for k, v in inner.items()})
    raise ValueError(f"Invalid type for tensors: {type(tensors).__name__}")


class GraphBackend:
    """Graph primitives used by the wrapper; this default uses ``torch.cuda.CUDAGraph``.

    Tests substitute a subclass with fake graphs to exercise the wrapper's decisions on CPU.
    """

    def __init__(self) -> None:
        # Captures made through this backend, per label (runtime-mode name): the owner (one
        # runner, whose wrappers all share this backend) reads its own counts here.
        self.captured: Counter[str] = Counter()

    def graph_pool(self) -> object:
        """The memory pool every capture shares (the platform's global pool)."""
        return current_platform.get_global_graph_pool()

    def new_graph(self) -> Graph:
        """A fresh, empty graph object."""
        return torch.cuda.CUDAGraph()

    def capture(self, graph: Graph, pool: object) -> contextlib.AbstractContextManager[object]:
        """Context manager capturing the enclosed work into ``graph`` using ``pool``.

        Captures on the current stream unless it is the default stream (which cannot be
        captured); then torch's own side stream is used.
        """
        stream: torch.cuda.Stream | None = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream():
            stream = None
        # this default backend's graphs and pools are torch's own (new_graph, graph_pool)
        return torch.cuda.graph(cast(torch.cuda.CUDAGraph, graph), pool=cast(Any, pool), stream=stream)

    def replay(self, graph: Graph) -> None:
        """Launch a captured graph."""
        graph.replay()

    def weak_ref(self, output: Any) -> Any:
        """Weak references to ``output`` (see :func:`weak_ref_tensors`)."""
        return weak_ref_tensors(output)

    def on_captured(self, graph: Graph, rerun: Callable[[], object], output: object) -> None:
        """Told after each capture what it ran; a real graph recorded its kernels already.

        ``rerun`` calls the runnable again with the captured arguments (the same tensors) and
        ``output`` is what replays of ``graph`` return. A stand-in graph that replays by
        re-running (tests on CPU) keeps both; the default does nothing.
        """

    def capture_call(self, pool: object, run: Callable[[], Any], label: enum.Enum | str, *,
                     release_output: bool = False, gc_disable: bool = False) -> tuple[Graph, Any, Any]:
        """Capture ``run()`` into a new graph on ``pool``: the one capture sequence of every
        wrapper (checks that capture is allowed, tells :meth:`on_captured`, counts the capture
        under ``label`` in ``monitor``).

        Returns ``(graph, output, replay_output)``: ``output`` is what ``run()`` returned (a
        weak reference already when ``release_output``: its memory goes back to the pool
        inside the capture, safe only when no later graph reads it) and ``replay_output`` the
        weak references that replays of ``graph`` refill. ``gc_disable`` turns the capture
        context's ``gc.collect`` / ``empty_cache`` into no-ops (slow once per piece).
        """
        monitor.validate_cudagraph_capturing_enabled()
        graph = self.new_graph()
        with contextlib.ExitStack() as stack:
            if gc_disable:
                stack.enter_context(_gc_and_empty_cache_disabled())
            with self.capture(graph, pool):
                output = run()
                if release_output:
                    output = self.weak_ref(output)
        replay_output = self.weak_ref(output)
        self.on_captured(graph, run, replay_output)
        monitor.record_capture()  # the process-wide total (vLLM's compilation_counter)
        self.captured[label.name if isinstance(label, enum.Enum) else label] += 1
        return graph, output, replay_output


@contextlib.contextmanager
def _gc_and_empty_cache_disabled() -> Iterator[None]:
    """Make ``gc.collect`` and ``torch.cuda.empty_cache`` no-ops for the block.

    The graph-capture context calls both on entry; once per layer piece that is very slow,
    so only the first piece of a piecewise model keeps them.
    """
    saved_collect, saved_empty = gc.collect, torch.cuda.empty_cache
    gc.collect = lambda *args, **kwargs: 0
    torch.cuda.empty_cache = lambda: None
    try:
        yield
    finally:
        gc.collect, torch.cuda.empty_cache = saved_collect, saved_empty


def _tensor_addresses(args: tuple[object, ...]) -> list[int]:
    return [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]


class CUDAGraphWrapper:
    """Wraps ``runnable``; captures/replays it for steps whose runtime mode is ``runtime_mode``.

    ``runtime_mode`` is FULL (whole model, wrapped by the runner) or PIECEWISE (one compiled
    piece); NONE is an ``AssertionError``. Callers must pass the same input storage on every
    replay of a descriptor (the wrapper never copies inputs), and consume replay outputs before
    the next replay: they live in the shared graph pool. Unknown attributes are looked up on the
    runnable. In DEBUG logging mode (``FORWARDKIT_LOGGING_LEVEL=DEBUG`` at construction) replay
    checks that positional tensor inputs still have their captured addresses.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        engine_config: EngineConfig,
        runtime_mode: CUDAGraphMode,
        cudagraph_options: CUDAGraphOptions | None = None,
        *,
        graph_backend: GraphBackend | None = None,
        eager_warmups: int = 0,
    ) -> None:
        if not isinstance(runtime_mode, CUDAGraphMode):
            raise ValueError(
                f"runtime_mode must be CUDAGraphMode.PIECEWISE or CUDAGraphMode.FULL, got {runtime_mode!r}"
            )
        assert runtime_mode != CUDAGraphMode.NONE, (
            "CUDAGraphWrapper needs runtime_mode PIECEWISE or FULL, got NONE; "
            "leave the runnable unwrapped to run eagerly"
        )
        if not runtime_mode.valid_runtime_modes():
            raise ValueError(
                f"runtime_mode {runtime_mode} is a configuration mode; a wrapper serves one "
                "runtime mode: PIECEWISE or FULL"
            )
        if isinstance(eager_warmups, bool) or not isinstance(eager_warmups, int) or eager_warmups < 0:
            raise ValueError(f"eager_warmups must be an int >= 0, got {eager_warmups!r}")
        self.runnable = runnable
        self.engine_config = engine_config
        self.compilation_config = engine_config.compilation_config
        self.runtime_mode = runtime_mode
        self.cudagraph_options = cudagraph_options or CUDAGraphOptions()
        self.graph_backend = graph_backend or GraphBackend()
        self.eager_warmups = eager_warmups
        self.graph_pool: object = None  # fetched at the first capture (see module docstring)
        self.is_debugging_mode = envs.FORWARDKIT_LOGGING_LEVEL == "DEBUG"
        self.concrete_cudagraph_entries: dict[BatchDescriptor, CUDAGraphEntry] = {}
        self._warmups_done: dict[BatchDescriptor, int] = {}

    def __getattr__(self, key: str) -> Any:
        # Only reached for attributes the wrapper itself lacks.
        runnable = self.__dict__.get("runnable")
        if runnable is not None and hasattr(runnable, key):
            return getattr(runnable, key)
        raise AttributeError(
            f"Attribute {key} not exists in the runnable of cudagraph wrapper: {runnable}"
        )

    def unwrap(self) -> Callable[..., Any]:
        """The wrapped runnable."""
        return self.runnable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = get_forward_context()
        runtime_mode = context.cudagraph_runtime_mode
        descriptor = context.batch_descriptor
        if runtime_mode == CUDAGraphMode.NONE or runtime_mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)

        assert descriptor is not None, (
            f"forward context has runtime mode {runtime_mode} but no batch_descriptor; "
            "pass the dispatcher's descriptor (or num_tokens) to set_forward_context"
        )
        entry = self.concrete_cudagraph_entries.get(descriptor)
        if entry is None:
            entry = self.concrete_cudagraph_entries[descriptor] = CUDAGraphEntry(descriptor)
        if entry.cudagraph is None:
            done = self._warmups_done.get(descriptor, 0)
            if done < self.eager_warmups:
                self._warmups_done[descriptor] = done + 1
                return self.runnable(*args, **kwargs)
            return self._capture(entry, args, kwargs)
        return self._replay(entry, args)

    def _capture(self, entry: CUDAGraphEntry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.cudagraph_options.debug_log_enable:
            logger.debug("Capturing a cudagraph on (%s, %s)", self.runtime_mode.name, entry.batch_descriptor)
        monitor.validate_cudagraph_capturing_enabled()  # before the entry records anything
        entry.input_addresses = _tensor_addresses(args)
        if self.graph_pool is None:
            self.graph_pool = self.graph_backend.graph_pool()
        graph, output, entry.output = self.graph_backend.capture_call(
            self.graph_pool, lambda: self.runnable(*args, **kwargs), self.runtime_mode,
            release_output=self.cudagraph_options.weak_ref_output,
            gc_disable=self.cudagraph_options.gc_disable)
        entry.cudagraph = graph
        return output

    def _replay(self, entry: CUDAGraphEntry, args: tuple[Any, ...]) -> Any:
        if self.is_debugging_mode:
            addresses = _tensor_addresses(args)
            assert addresses == entry.input_addresses, (
                "Input addresses for cudagraphs are different during replay. "
                f"Expected {entry.input_addresses}, got {addresses} "
                f"(descriptor {entry.batch_descriptor}); pass slices of the same persistent "
                "buffers on every step"
            )
        self.graph_backend.replay(cast(Graph, entry.cudagraph))  # set: the entry was captured
        return entry.output
