"""AOT precompile: save Dynamo's result for a model, and load it instead of tracing again.

On a cold start (mode 3, Inductor, cache on, ``FORWARDKIT_USE_AOT_COMPILE`` not 0) the model's
``forward`` is traced with ``torch.compile(...).aot_compile`` instead of a plain first call. The
piecewise backend then returns a :class:`SerializableSplitFunction`: the stitched split module
for running, plus the Dynamo FX graph for saving. The whole Dynamo result (transformed
bytecode, signature, graph) is written to the compile cache. A warm start loads it, skips the
Dynamo trace, and rebuilds the piecewise backend from the saved graph on the first call (its
pieces then load from the artifact cache as usual).

Safety: the AOT entry lives in a :class:`~forwardkit.compilation.cache.CompileCache` (atomic
writes, checksums, private directories), keyed by the engine config hash, torch and Python
versions, the forward's identity and the module prefix. The traced source files are not known
before tracing, so (as in vLLM) they are recorded in the entry and re-hashed on load: a changed
file makes the entry stale and the model is traced again (and the entry replaced). Any failure
to load (corrupt, unreadable, stale, incompatible) falls back to tracing; any failure to save
only warns. Guards are dropped (as for every trace-once compile).

On by default (``FORWARDKIT_USE_AOT_COMPILE=0`` turns it off; it is off whenever the compile
cache is). vLLM 0.14.0 leaves it off on CPU; here it pays on CPU too. Measured on 2 CPU cores:
on the built-in 4-layer model it saves almost nothing (the trace it skips is ~1 s, most of it
imports that loading Inductor's artifacts needs anyway, while rebuilding the backend from the
saved graph costs ~0.7 s: a fake-tensor pass to restore the example values, then the split);
on the 16-layer Llama-3.2-1B shape it takes about 1 s off a warm start (the warm-up step with
the trace 3.7-4.6 s, with the AOT entry 2.7-3.5 s). Runner inputs are slices of persistent buffers; their
fake values are saved as plain tensors of the same size and strides (the graph pickler cannot
save a view's link to its base).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch._dynamo.aot_compile_types import SerializableCallable

from forwardkit import envs
from forwardkit.compilation.cache import CompileCache, cache_enabled, code_hash, compile_cache_root
from forwardkit.compilation.counters import compilation_counter
from forwardkit.compilation.vec_isa import cpu_codegen_key
from forwardkit.distributed.parallel_state import rank_dir_name
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from torch._dynamo.aot_compile import AOTCompiledFunction
    from torch._subclasses.fake_tensor import FakeTensorMode

    from forwardkit.config.engine import EngineConfig

__all__ = ["AotEntry", "SerializableSplitFunction", "aot_enabled"]

logger = init_logger(__name__)

ENTRY = "dynamo_aot"
# Node meta kept when pickling: placeholders keep their (symbolic) fake example values, every
# other node only its stack trace. Fake views do not pickle, stacks and Dynamo's graph args
# point at live objects (real parameters); the other example values are recomputed on load.
_KEEP_PLACEHOLDER_META = ("example_value", "val", "tensor_meta", "stack_trace")
_KEEP_META = ("stack_trace",)

# The backend factory for SerializableSplitFunction.deserialize_compile_artifacts; set only
# while an entry is being loaded (deserialisation is a classmethod without arguments).
# A compiled graph or the split module: called with the graph's inputs (tensors, SymInts),
# its result passed on to the model's caller.
GraphFn = Callable[..., object]
# The piecewise backend as Dynamo calls it: (graph, example inputs) -> what runs the graph.
GraphBackend = Callable[[torch.fx.GraphModule, list[torch.Tensor]], GraphFn]

_loading: list[Callable[[], GraphBackend]] = []


def _unviewed(value: object) -> object:
    """A fake input that is a view (the runner passes slices of its persistent buffers) as a
    plain fake tensor of the same size and strides: the graph pickler cannot save the view's
    link to its base, and the loaded graph needs only the size, strides and dtype."""
    if isinstance(value, torch.Tensor) and value._is_view() and hasattr(value, "fake_mode"):
        with value.fake_mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                       device=value.device)
    return value


class AotCompileError(RuntimeError):
    """``aot_compile`` itself failed (before the model ran); the caller traces without AOT."""


def aot_enabled(engine_config: EngineConfig) -> bool:
    """AOT precompile applies: mode 3, Inductor backend, cache on, env switch on."""
    cc = engine_config.compilation_config
    if int(cc.mode or 0) != 3 or (cc.backend or "inductor") != "inductor":
        return False
    if not envs.FORWARDKIT_USE_AOT_COMPILE:
        return False
    return cache_enabled(dict(cc.inductor_compile_config))


@dataclasses.dataclass
class SerializableSplitFunction(SerializableCallable):
    """What the piecewise backend returns under AOT compile.

    Holds the Dynamo graph (to save) and the runnable split module (to call). A deserialised one
    has no runnable yet: the first call builds a fresh piecewise backend (from the loading
    model's config) on the saved graph, which loads every piece from the artifact cache.
    """

    graph_module: torch.fx.GraphModule
    prefix: str
    runnable: GraphFn | None = None
    fake_mode: FakeTensorMode | None = None
    make_backend: Callable[[], GraphBackend] | None = None

    def __call__(self, *args: object) -> object:
        runnable = self.runnable
        if runnable is None:
            runnable = self._materialize()
        return runnable(*args)

    def _materialize(self) -> GraphFn:
        if self.make_backend is None or self.fake_mode is None:  # both set by deserialisation
            raise RuntimeError("a loaded AOT function was called without a backend factory")
        from torch._guards import TracingContext, tracing

        backend = self.make_backend()
        fakes = [n.meta.get("example_value") for n in self.graph_module.graph.find_nodes(op="placeholder")]
        with tracing(TracingContext(self.fake_mode)):
            _ExampleValues(self.graph_module, self.fake_mode).run(*fakes)
            result = backend(self.graph_module, fakes)
        runnable = result.runnable if isinstance(result, SerializableSplitFunction) else result
        if runnable is None:
            raise RuntimeError("the piecewise backend returned a split function without a runnable")
        self.runnable = runnable
        return runnable

    @classmethod
    def serialize_compile_artifacts(cls, fn: SerializableSplitFunction) -> bytes:
        """Pickle the Dynamo graph (metadata trimmed) and the prefix."""
        from torch.fx._graph_pickler import GraphPickler, Options

        gm = fn.graph_module
        saved = {}
        for node in gm.graph.nodes:
            saved[node] = node.meta
            keep = _KEEP_PLACEHOLDER_META if node.op == "placeholder" else _KEEP_META
            node.meta = {k: _unviewed(v) for k, v in node.meta.items() if k in keep}
        try:
            graph = GraphPickler.dumps(gm, Options(ops_filter=None))
        finally:
            for node, meta in saved.items():
                node.meta = meta
        return pickle.dumps({"graph": graph, "prefix": fn.prefix})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> SerializableSplitFunction:
        """Unpickle the graph into a new fake mode; the backend is built on first call."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        if not _loading:
            raise RuntimeError("forwardkit AOT entries can only be loaded through AotEntry.load")
        state = pickle.loads(data)
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        gm = GraphPickler.loads(state["graph"], fake_mode)
        if not isinstance(gm, torch.fx.GraphModule):
            raise RuntimeError(f"AOT entry holds a {type(gm).__name__}, not a GraphModule")
        gm.recompile()
        return cls(gm, state["prefix"], None, fake_mode, _loading[-1])


class _ExampleValues(torch.fx.Interpreter):
    """Fake-run a loaded graph to restore every node's ``example_value`` (as Dynamo sets it),
    which splitting and range compiles read."""

    def __init__(self, gm: torch.fx.GraphModule, fake_mode: FakeTensorMode) -> None:
        super().__init__(gm)
        self.fake_mode = fake_mode

    def run(self, *args: object, initial_env: dict[torch.fx.Node, Any] | None = None,
            enable_io_processing: bool = True) -> object:
        """Propagate the placeholders' fakes (symbolic token dim) through the graph."""
        from torch._dispatch.python import enable_python_dispatcher

        with self.fake_mode, enable_python_dispatcher():
            return super().run(*args, initial_env=initial_env,
                               enable_io_processing=enable_io_processing)

    def run_node(self, n: torch.fx.Node) -> object:
        """Run one node on fakes and record its value."""
        result = super().run_node(n)
        if n.op not in ("placeholder", "output"):
            n.meta["example_value"] = result
        return result


@contextlib.contextmanager
def _backend_factory(make_backend: Callable[[], GraphBackend]) -> Iterator[None]:
    _loading.append(make_backend)
    try:
        yield
    finally:
        _loading.pop()


_PRIMITIVES = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _is_plain(value: object, depth: int = 0) -> bool:
    if isinstance(value, _PRIMITIVES):
        return True
    if depth > 4:
        return False
    if isinstance(value, (tuple, list)):
        return all(_is_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v, depth + 1) for k, v in value.items())
    return False


def _plain(value: object) -> str | None:
    """A stable text of a value a trace can bake in as constants (numbers, strings, dtypes and
    lists/dicts of them), else None."""
    if not _is_plain(value):
        return None
    if isinstance(value, dict):
        return repr(sorted(value.items()))
    return repr(value)


def model_fingerprint(module: torch.nn.Module, arguments: Mapping[str, object],
                      dynamic: Mapping[str, int | Sequence[int] | None]) -> str:
    """A hash of what a guard-free trace of ``module`` specialises on beyond the config hash.

    Every submodule's class and plain attributes (numbers, strings, dtypes: the constants a
    trace bakes in), every parameter's and buffer's name, shape, dtype and device, and the
    call's arguments by name (tensors: dtype, device, the sizes of the non-dynamic dims). Guards
    are dropped, so without this a model built differently under the same config (e.g. a
    changed built-in default) would run a stale graph.
    """
    lines = []
    for name, sub in module.named_modules():
        attrs = sorted((k, r) for k, v in vars(sub).items()
                       if not k.startswith("_") and (r := _plain(v)) is not None)
        lines.append(f"M {name} {type(sub).__module__}.{type(sub).__qualname__} {attrs}")
    for kind, items in (("P", module.named_parameters()), ("B", module.named_buffers())):
        for name, t in items:
            lines.append(f"{kind} {name} {tuple(t.shape)} {t.dtype} {t.device.type} {t.requires_grad}")
    for name, a in sorted(arguments.items()):
        if isinstance(a, torch.Tensor):
            dims = dynamic.get(name)
            dyn = {d % a.ndim for d in ([dims] if isinstance(dims, int) else list(dims or []))} if a.ndim else set()
            shape = tuple("*" if i in dyn else n for i, n in enumerate(a.shape))
            lines.append(f"A {name} {a.dtype} {a.device.type} {shape}")
        else:
            lines.append(f"A {name} {_plain(a) or type(a).__qualname__}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _drop_all_guards(guards: Sequence[object]) -> list[bool]:
    return [False] * len(guards)


class AotEntry:
    """The saved Dynamo result of one compiled module instance (one cache entry)."""

    def __init__(self, module: torch.nn.Module, forward: Callable[..., object], engine_config: EngineConfig,
                 prefix: str, fingerprint: str) -> None:
        self.module, self.forward, self.engine_config = module, forward, engine_config
        self.prefix = prefix or "backbone"
        cc = engine_config.compilation_config
        root, source = compile_cache_root(cc.cache_dir)
        code = forward.__code__
        factors = {
            "config_hash": engine_config.compute_hash(),
            "torch": torch.__version__,
            "python": sys.version,
            "forward": f"{forward.__module__}.{forward.__qualname__}:{code.co_filename}:{code.co_firstlineno}",
            "class": f"{type(module).__module__}.{type(module).__qualname__}",
            "prefix": self.prefix,
            "model": fingerprint,
            "format": 1,
            "cpu_codegen": cpu_codegen_key(),
        }
        digest = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:10]
        pc = engine_config.parallel_config
        local = os.path.join(root, "torch_aot_compile", digest,
                             rank_dir_name(pc), self.prefix)
        self.cache = CompileCache(root, local, "binary", source)
        self.cache.write_metadata("cache_key_factors.json", json.dumps(factors, indent=2, sort_keys=True))

    def load(self, make_backend: Callable[[], GraphBackend]) -> tuple[AOTCompiledFunction, set[str]] | None:
        """The loaded function (call it as ``fn(module, *args, **kwargs)``) and its traced files,
        or None when there is no usable entry (missing, stale, corrupt: each logged)."""
        stale: list[str] = []

        def loader(path: str) -> tuple[AOTCompiledFunction, set[str]] | None:
            from torch._dynamo.aot_compile import AOTCompiledFunction

            with open(path, "rb") as f:
                payload = pickle.load(f)
            files = set(payload["traced_files"])
            if code_hash(files) != payload["code_hash"]:
                stale.append(path)
                return None
            with _backend_factory(make_backend):
                fn = AOTCompiledFunction.deserialize(payload["function"], self.forward.__globals__)
            fn.disable_guard_check()
            return fn, files

        if not os.path.exists(os.path.join(self.cache.local_dir, CompileCache.INDEX)):
            return None
        result = self.cache.load(ENTRY, loader)
        if stale:
            compilation_counter.num_cache_hits -= 1  # cache.load counted the read as a hit
            compilation_counter.num_cache_misses += 1
            logger.info("traced source files changed since %s was saved; tracing again", stale[0])
            return None
        if result is not None:
            compilation_counter.num_aot_loads += 1
        return result

    def compile(self, fn: Callable[..., object], backend: GraphBackend, args: tuple[object, ...],
                kwargs: Mapping[str, object]) -> AOTCompiledFunction:
        """AOT-compile ``fn`` (an unbound forward) for this module; returns the compiled function,
        called as ``aot_fn(module, *args, **kwargs)``. Raises :class:`AotCompileError`."""
        try:
            compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend,
                                     options={"guard_filter_fn": _drop_all_guards})
            # torch.compile's stub returns a plain Callable; the compiled function has aot_compile
            aot_fn = compiled.aot_compile(((self.module, *args), dict(kwargs)))  # type: ignore[attr-defined]
        except Exception as e:
            raise AotCompileError(f"{type(e).__name__}: {e}") from e
        aot_fn.disable_guard_check()
        self._pending = aot_fn
        return aot_fn

    def save_after_first_call(self, traced_files: set[str]) -> None:
        """Write the function compiled by :meth:`compile` (after its first call succeeded) with
        the source files its trace read; only warns on failure."""
        aot_fn = self._pending
        try:
            data = type(aot_fn).serialize(aot_fn).serialized_data
            payload = pickle.dumps({
                "traced_files": sorted(traced_files),
                "code_hash": code_hash(traced_files),
                "function": data,
            })

            def saver(path: str) -> None:
                with open(path, "wb") as f:
                    f.write(payload)

            self.cache.save(ENTRY, saver)
            compilation_counter.num_aot_saves += 1
        except Exception as e:  # the model runs; only the next start is slower
            logger.warning_once("could not save the AOT-compiled %s: %s: %s",
                                type(self.module).__name__, type(e).__name__, str(e))
