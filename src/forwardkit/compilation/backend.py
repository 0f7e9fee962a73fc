"""``ForwardkitBackend``: the mode-3 (VLLM_COMPILE) Dynamo backend.

Dynamo hands it one FX graph (parameters lifted as inputs, the token count as a ``SymInt``).
It splits the graph at ``splitting_ops`` (kept eager), swaps every other piece for a lazy
:class:`~forwardkit.compilation.piecewise.PiecewiseBackend`, and returns the stitched module.
One backend instance compiles exactly one graph.

Piecewise CUDA graphs: the graph layer sits below this one, so the backend never builds a
graph wrapper itself. The model runner hands it a :data:`PieceWrapperFactory` (through
:func:`set_piece_wrapper` on the model, read when the backend is built); every compiled
piece is then replaced by ``factory(piece, index, num_pieces)`` instead of the bare piece.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher

from forwardkit import envs
from forwardkit.compilation.cache import CompileCache, cache_enabled, code_hash, compile_cache_root
from forwardkit.compilation.compiler import PieceCompiler
from forwardkit.compilation.counters import compilation_counter, log_summary
from forwardkit.compilation.passes import PostGradPassManager
from forwardkit.compilation.piecewise import ArtifactStore, PiecewiseBackend
from forwardkit.compilation.split import SplitItem, split_graph
from forwardkit.compilation.vec_isa import cpu_codegen_key
from forwardkit.config.compilation_methods import register_piecewise_backend
from forwardkit.distributed.parallel_state import rank_dir_name
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from forwardkit.config.compilation import CompilationConfig
    from forwardkit.config.engine import EngineConfig

__all__ = [
    "DEFAULT_SPLITTING_OPS",
    "ForwardkitBackend",
    "PieceWrapperFactory",
    "PiecewiseCompileInterpreter",
    "set_piece_wrapper",
]

logger = init_logger(__name__)

DEFAULT_SPLITTING_OPS = ["forwardkit::unified_attention", "forwardkit::unified_attention_with_output"]

# (piece, index among the compiled pieces, number of compiled pieces) -> what runs instead.
PieceWrapperFactory = Callable[[PiecewiseBackend, int, int], Callable[..., Any]]


def set_piece_wrapper(model: torch.nn.Module, factory: PieceWrapperFactory | None) -> int:
    """Have every compiled piece of ``model``'s compiled submodules wrapped by ``factory``.

    Must run before the model's first forward (the backend reads it when it is built at the
    first trace); a submodule that is already compiled raises ``RuntimeError``. ``None``
    removes the factory. Returns the number of submodules that will compile (those marked
    ``@support_torch_compile`` and not skipped by mode, ``enforce_eager`` or a gate).
    """
    modules = [m for m in model.modules() if getattr(type(m), "_forwardkit_compile_decorated", False)]
    if any(getattr(m, "_fk_compiler", None) is not None for m in modules):
        raise RuntimeError(
            "set_piece_wrapper: the model has already been compiled (it ran a forward); the "
            "piece wrapper must be set before the first forward pass"
        )
    compiled = 0
    for m in modules:
        m._fk_piece_wrapper = factory  # type: ignore[assignment]  # Module.__setattr__ stub: tensors/modules only
        compiled += not getattr(m, "_fk_do_not_compile", True)
    return compiled


class PiecewiseCompileInterpreter(torch.fx.Interpreter):
    """Runs the split module on fake inputs and installs a :class:`PiecewiseBackend` per piece.

    Dynamo's placeholder fakes belong to another fake mode than the one active during the
    backend call, so every tensor is re-fakified into the active mode first ("Mixing fake
    modes" otherwise). Nothing is compiled here: compiles happen lazily at the first real call.
    """

    def __init__(self, module: torch.fx.GraphModule, compile_names: list[str], make_piece: Any):
        super().__init__(module)
        self.compile_names = compile_names
        self.make_piece = make_piece
        fake_mode = torch._guards.detect_fake_mode()
        if fake_mode is None:
            raise RuntimeError("PiecewiseCompileInterpreter runs inside a Dynamo backend call, "
                               "under its fake mode; none is active")
        self.fake_mode = fake_mode

    def run(self, *args: Any) -> Any:  # type: ignore[override]
        """Propagate fakes through the split module (under the active fake mode)."""
        fake_args = [
            self.fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args
        ]
        with self.fake_mode, enable_python_dispatcher():
            return super().run(*fake_args)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        """Run the piece on fakes, then replace a compilable one with its lazy backend."""
        assert isinstance(target, str)
        output = super().call_module(target, args, kwargs)
        if target in self.compile_names:
            index = self.compile_names.index(target)
            submod = self.fetch_attr(target)
            self.module.__dict__[target] = self.make_piece(submod, args, index, target)
            compilation_counter.num_piecewise_capturable_graphs_seen += 1
        return output


def _user_passes_and_options(cc: CompilationConfig) -> tuple[dict[str, Any], list[Any]]:
    """Split ``inductor_compile_config`` into real Inductor options and user passes."""
    from forwardkit.config.pass_config import resolve_inductor_pass

    options: dict[str, Any] = {}
    passes: list[Any] = []
    known = torch._inductor.config._config  # type: ignore[attr-defined]
    for key, value in dict(cc.inductor_compile_config).items():
        if key == "post_grad_custom_post_pass" or (callable(value) and key not in known):
            if isinstance(value, PostGradPassManager):
                raise ValueError(
                    "inductor_compile_config['post_grad_custom_post_pass'] holds a pass manager; "
                    "forwardkit installs its own. Pass a plain pass (a callable on torch.fx.Graph)."
                )
            if value is not None:
                passes.append(value)
        elif key in known:
            options[key] = value
        else:
            logger.warning_once("ignoring unknown Inductor option %r in inductor_compile_config", key)
    for name, value in dict(cc.inductor_passes).items():
        resolved = resolve_inductor_pass(name, value)
        if not any(p is resolved or p == resolved for p in passes):
            passes.append(resolved)
    return options, passes


class ForwardkitBackend:
    """Split-and-compile backend built from an engine config (``CompilationConfig.init_backend``)."""

    def __init__(self, engine_config: EngineConfig, prefix: str = "",
                 piece_wrapper: PieceWrapperFactory | None = None) -> None:
        self.engine_config = engine_config
        self.piece_wrapper = piece_wrapper
        self.compilation_config = cc = engine_config.compilation_config
        self.prefix = prefix or "backbone"
        self.backend_name = cc.backend or "inductor"
        if self.backend_name not in ("inductor", "eager"):
            raise ValueError(
                f"compilation_config.backend={self.backend_name!r} is not supported by the "
                "piecewise backend; use 'inductor' or 'eager'"
            )
        options, user_passes = _user_passes_and_options(cc)
        options["enable_auto_functionalized_v2"] = False  # custom passes expect v1
        self.pass_manager = PostGradPassManager(cc.pass_config, user_passes)
        options["post_grad_custom_post_pass"] = self.pass_manager
        self.inductor_config = options
        self.traced_files: set[str] = set()
        self.aot = False  # return a SerializableSplitFunction (AOT precompile)
        self.called = False
        self.split_gm: torch.fx.GraphModule | None = None
        self.pieces: list[SplitItem] = []
        self.piece_backends: list[PiecewiseBackend] = []
        self.cache: CompileCache | None = None
        self._start = time.perf_counter()
        self._counters_at_start = compilation_counter.clone()

    # ------------------------------------------------------------------ cache
    def _cache_factors(self) -> dict[str, Any]:
        cfg = self.engine_config
        config_hash = cfg.compute_hash()
        env = {
            k: str(getattr(envs, k))
            for k in ("FORWARDKIT_COMPILE_CACHE_SAVE_FORMAT",)
        }
        files = set(self.traced_files)
        if cfg.compilation_config.pass_config.enable_sp:  # the rewrite's code shapes the pieces
            from forwardkit.compilation import sequence_parallelism

            files.add(sequence_parallelism.__file__)
        return {
            "config_hash": config_hash,
            "torch": torch.__version__,
            "code_hash": code_hash(files),
            "compiler": self.backend_name,
            "env": env,
            "prefix": self.prefix,
            "cpu_codegen": cpu_codegen_key(),
        }

    def _init_cache(self) -> CompileCache | None:
        cc = self.compilation_config
        if self.backend_name == "eager" or not cache_enabled(self.inductor_config):
            return None
        root, source = compile_cache_root(cc.cache_dir)
        factors = self._cache_factors()
        key_dir = CompileCache.key_dir(root, factors)
        pc = self.engine_config.parallel_config
        local = os.path.join(key_dir, rank_dir_name(pc), self.prefix)
        cache = CompileCache(root, local, cc.compile_cache_save_format, source)
        cache.write_metadata("cache_key_factors.json", json.dumps(factors, indent=2, sort_keys=True))
        cc.compile_state.local_cache_dir = local  # run-time state, writable on a resolved config
        return cache

    # ------------------------------------------------------------------ call
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        """Split ``gm``, install lazy per-piece backends and return the stitched module."""
        if self.called:
            raise RuntimeError(
                "a ForwardkitBackend compiles exactly one graph, and it was called again: the "
                "model was re-traced (a recompile). Build a new backend per compiled module."
            )
        self.called = True
        compilation_counter.num_graphs_seen += 1
        cc = self.compilation_config
        self.cache = self._init_cache()
        ops = list(DEFAULT_SPLITTING_OPS if cc.splitting_ops is None else cc.splitting_ops)
        if cc.use_inductor_graph_partition:
            ops = []
        self._sequence_parallelism(gm)
        split_gm, items = split_graph(gm, ops)
        self.split_gm, self.pieces = split_gm, items
        compilation_counter.num_piecewise_graphs_seen += len(items)
        compilation_counter.num_splits += sum(it.is_splitting_graph for it in items)
        compile_names = [it.submod_name for it in items if not it.is_splitting_graph]

        ranges = cc.get_compile_ranges()
        sizes = [s for s in (cc.compile_sizes or []) if isinstance(s, int)]
        compiler = PieceCompiler(self.backend_name, self.inductor_config, self.cache, cc)
        store = ArtifactStore(compiler)

        def make_piece(submod: torch.fx.GraphModule, args: Any, index: int, name: str) -> Any:
            piece = PiecewiseBackend(
                submod, args, index, len(compile_names), name, ranges, sizes, store,
                on_all_compiled=self._all_compiled,
            )
            self.piece_backends.append(piece)
            if self.piece_wrapper is None or cc.use_inductor_graph_partition:
                return piece
            # NOTE: a single-piece graph is still wrapped (the wrapper only acts on PIECEWISE
            # steps); splitting pieces (attention) are never here, so they stay eager.
            return self.piece_wrapper(piece, index, len(compile_names))

        fakes = [
            n.meta.get("example_value", a)
            for n, a in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)
        ]
        PiecewiseCompileInterpreter(split_gm, compile_names, make_piece).run(*fakes)
        if self.cache is not None:
            graph_text = split_gm.print_readable(print_output=False)
            self.cache.write_metadata(
                "computation_graph.py",
                "from __future__ import annotations\nimport torch\n"
                + graph_text.replace("<lambda>", "GraphModule"),
            )
        logger.info(
            "split the graph into %d pieces (%d splitting ops: %s)",
            len(items), sum(it.is_splitting_graph for it in items), ops,
        )
        if self.aot:
            from forwardkit.compilation.aot import SerializableSplitFunction

            return SerializableSplitFunction(gm, self.prefix, split_gm)
        return split_gm

    def _sequence_parallelism(self, gm: torch.fx.GraphModule) -> None:
        """The sequence-parallelism rewrite of the whole graph, before the split
        (``pass_config.enable_sp`` with TP > 1; ``compilation/sequence_parallelism.py``)."""
        tp = self.engine_config.parallel_config.tensor_parallel_size
        if not self.compilation_config.pass_config.enable_sp or tp < 2:
            return
        from forwardkit.compilation.sequence_parallelism import SequenceParallelismPass
        from forwardkit.distributed.parallel_state import get_tp_group

        converted = SequenceParallelismPass(tp, get_tp_group().rank)(gm)
        compilation_counter.num_sp_reduce_scatters += converted

    def _all_compiled(self) -> None:
        """Every range and size of the last piece is compiled: log the summary once."""
        log_summary(time.perf_counter() - self._start, self._counters_at_start)


register_piecewise_backend(ForwardkitBackend)  # CompilationConfig.init_backend builds it for mode 3
