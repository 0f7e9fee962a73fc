"""The methods of ``CompilationConfig``, kept apart from its fields.

:class:`CompilationMethods` is a field-less base class of ``CompilationConfig``; it reads
and writes the config's attributes through ``self``. Checks that vLLM writes as ``assert``
raise :class:`~forwardkit.config.utils.ConfigAssertionError` (a ValueError and an
AssertionError at once).
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from forwardkit.config.compilation_enums import CompilationMode, CUDAGraphMode, Range
from forwardkit.config.compilation_sizes import (
    compile_ranges_from_split_points,
    padded_graph_size_table,
    round_capture_sizes_for_spec_decode,
)
from forwardkit.config.custom_ops import CUSTOM_OP_REGISTRY, is_custom_op_enabled
from forwardkit.config.utils import (
    ConfigAssertionError,
    ConfigAttributeError,
    get_hash_factors,
    hash_factors,
)
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from forwardkit.config.compile_state import CompileRuntimeState
    from forwardkit.config.pass_config import DynamicShapesConfig, PassConfig

__all__ = ["CompilationMethods"]

logger = init_logger(__name__)

_HASH_IGNORED = frozenset(
    {
        "debug_dump_path",
        "cache_dir",
        "bs_to_padded_graph_size",
        "pass_config",
        "dynamic_shapes_config",
    }
)
# (The run-time state, vLLM's hash-ignored init=False fields, is no field: see compile_state.)

STATE_ATTR = "_fk_compile_state"
"""Instance attribute holding a config's ``CompileRuntimeState`` (set at construction)."""


# The mode-3 backend factory (``ForwardkitBackend``). The compilation layer registers it when it
# is imported (``register_piecewise_backend``), so this layer never imports that one. It takes
# the ``EngineConfig``, which this module only passes through: typed ``Any`` here, because
# naming ``EngineConfig`` would make this module (a base of ``CompilationConfig``, which
# ``EngineConfig`` holds) import :mod:`.engine`, a cycle even at type-check time.
_piecewise_backend: Callable[[Any], Any] | None = None


def register_piecewise_backend(factory: Callable[[Any], Any]) -> None:
    """Install the factory ``init_backend`` uses for VLLM_COMPILE (called by
    ``forwardkit.compilation.backend`` at import)."""
    global _piecewise_backend
    _piecewise_backend = factory


class CompilationMethods:
    """Behaviour of ``CompilationConfig``; see that class for the fields."""

    if TYPE_CHECKING:
        # The fields these methods use, declared for the type checker only: the pydantic
        # dataclass ``CompilationConfig`` defines them (with defaults and validators).
        ATTENTION_OPS: ClassVar[tuple[str, ...]]
        mode: CompilationMode | None
        backend: str
        custom_ops: list[str]
        splitting_ops: list[str] | None
        compile_sizes: list[int | str] | None
        compile_ranges_split_points: list[int] | None
        cudagraph_mode: CUDAGraphMode | None
        cudagraph_capture_sizes: list[int] | None
        use_inductor_graph_partition: bool | None
        pass_config: PassConfig
        max_cudagraph_capture_size: int | None
        dynamic_shapes_config: DynamicShapesConfig
        bs_to_padded_graph_size: list[int] | None

    # ------------------------------------------------------------------ run-time state
    # vLLM's init=False fields, forwarded to the config's CompileRuntimeState: the config's own
    # fields hold configuration only, and stay read-only once resolved.

    @property
    def compile_state(self) -> CompileRuntimeState:
        """The mutable run-time state linked to this config (layers, custom-op counters,
        traced files, compile time, per-rank cache dir)."""
        state: CompileRuntimeState = self.__dict__[STATE_ATTR]
        return state

    @property
    def static_forward_context(self) -> dict[str, Any]:
        """Layer name -> layer registered while the model was built (``compile_state``)."""
        return self.compile_state.static_forward_context

    @static_forward_context.setter
    def static_forward_context(self, value: dict[str, Any]) -> None:
        self.compile_state.static_forward_context = value

    @property
    def enabled_custom_ops(self) -> Counter[str]:
        """Custom ops seen enabled while the model was built (``compile_state``)."""
        return self.compile_state.enabled_custom_ops

    @enabled_custom_ops.setter
    def enabled_custom_ops(self, value: Counter[str]) -> None:
        self.compile_state.enabled_custom_ops = value

    @property
    def disabled_custom_ops(self) -> Counter[str]:
        """Custom ops seen disabled while the model was built (``compile_state``)."""
        return self.compile_state.disabled_custom_ops

    @disabled_custom_ops.setter
    def disabled_custom_ops(self, value: Counter[str]) -> None:
        self.compile_state.disabled_custom_ops = value

    @property
    def traced_files(self) -> set[str]:
        """Source files traced by Dynamo (``compile_state``)."""
        return self.compile_state.traced_files

    @traced_files.setter
    def traced_files(self, value: set[str]) -> None:
        self.compile_state.traced_files = value

    @property
    def compilation_time(self) -> float:
        """Seconds spent compiling (``compile_state``)."""
        return self.compile_state.compilation_time

    @compilation_time.setter
    def compilation_time(self, value: float) -> None:
        self.compile_state.compilation_time = value

    @property
    def local_cache_dir(self) -> str | None:
        """Per-rank compile-cache dir set by the compile backend (``compile_state``)."""
        return self.compile_state.local_cache_dir

    @local_cache_dir.setter
    def local_cache_dir(self, value: str | None) -> None:
        self.compile_state.local_cache_dir = value

    # ------------------------------------------------------------------ backend

    def init_backend(self, vllm_config: Any) -> str | Any:
        """The ``torch.compile`` backend for this config, given the engine config
        (an ``EngineConfig``, passed as-is to the VLLM_COMPILE backend factory).

        Modes STOCK_TORCH_COMPILE/DYNAMO_TRACE_ONCE return a registered Dynamo backend name
        as-is, or the object a dotted name points to. VLLM_COMPILE returns a new
        ``forwardkit.compilation.backend.ForwardkitBackend(vllm_config)``: the config layer never
        imports the compilation layer; that module registers the class here
        (``register_piecewise_backend``) when it is imported, which any forwardkit model or
        ``support_torch_compile`` does; before that this raises ``RuntimeError``.
        """
        if self.mode is None:
            raise ValueError(
                "No compilation mode is set (mode is None). init_backend() is meant to be "
                "called on the compilation config of an EngineConfig, which resolves the mode."
            )
        if self.mode == CompilationMode.NONE:
            raise ValueError("No compilation mode is set.")
        if self.mode in (CompilationMode.STOCK_TORCH_COMPILE, CompilationMode.DYNAMO_TRACE_ONCE):
            from torch._dynamo import list_backends

            registered = list_backends(exclude_tags=())
            if self.backend in registered:
                return self.backend
            return _resolve_qualname(self.backend, registered)
        if self.backend not in ("eager", "inductor"):
            logger.info("Using out-of-tree backend %r for piecewise compilation", self.backend)
        if _piecewise_backend is None:
            raise RuntimeError("init_backend() for VLLM_COMPILE needs forwardkit.compilation.backend; "
                               "import it (any forwardkit model or support_torch_compile does)")
        return _piecewise_backend(vllm_config)

    def resolved_cudagraph_mode(self) -> CUDAGraphMode:
        """``cudagraph_mode`` once the engine config has decided it (never None there)."""
        if self.cudagraph_mode is None:
            raise ConfigAttributeError(
                "cudagraph_mode is None; resolve it (the engine config does) before using it"
            )
        return self.cudagraph_mode

    # ------------------------------------------------------------------ sizes

    def post_init_cudagraph_sizes(self) -> None:
        """Finish size setup once capture sizes are known: expand ``compile_sizes``, sort
        ``cudagraph_capture_sizes`` in place and build ``bs_to_padded_graph_size``.

        ``compile_sizes`` keeps first-occurrence order (the reference's order was
        unspecified) without duplicates (the reference could repeat ints after expanding
        ``"cudagraph_capture_sizes"``, so resolving its output again changed it).
        """
        sizes = self.cudagraph_capture_sizes
        if sizes is None:
            raise ConfigAttributeError(
                "cudagraph_capture_sizes is None; set it to a list (the engine config does) "
                "before post_init_cudagraph_sizes()"
            )
        computed: list[int] = []
        for entry in dict.fromkeys(self.compile_sizes or []):
            if isinstance(entry, str):
                if entry != "cudagraph_capture_sizes":
                    raise ConfigAssertionError(
                        "Unrecognized size type in compile_sizes, expect "
                        f"'cudagraph_capture_sizes', got {entry}"
                    )
                computed.extend(sizes)
            else:
                computed.append(entry)
        ordered = sorted(sizes)
        if ordered and ordered[-1] != self.max_cudagraph_capture_size:
            raise ConfigAssertionError(
                f"max_cudagraph_capture_size ({self.max_cudagraph_capture_size}) must equal the "
                f"largest of cudagraph_capture_sizes ({ordered[-1]})"
            )
        padded_graph_size_table(ordered, self.max_cudagraph_capture_size)  # validate first
        self.compile_sizes = list(dict.fromkeys(computed))
        sizes.sort()
        self.compute_bs_to_padded_graph_size()

    def compute_bs_to_padded_graph_size(self) -> None:
        """Set ``bs_to_padded_graph_size[bs]`` = smallest capture size >= bs, for 0..max."""
        self.bs_to_padded_graph_size = padded_graph_size_table(
            self.cudagraph_capture_sizes or [], self.max_cudagraph_capture_size
        )

    def adjust_cudagraph_sizes_for_spec_decode(
        self, uniform_decode_query_len: int, tensor_parallel_size: int
    ) -> None:
        """Round capture sizes up to multiples of the decode query length (1 + speculative
        tokens), and of the TP size under sequence parallelism; rebuild the padding table."""
        result = round_capture_sizes_for_spec_decode(
            self.cudagraph_capture_sizes or [],
            self.max_cudagraph_capture_size or 0,
            uniform_decode_query_len,
            tensor_parallel_size,
            bool(self.pass_config.enable_sp),
        )
        if result is None:
            return
        self.cudagraph_capture_sizes, self.max_cudagraph_capture_size = result
        self.compute_bs_to_padded_graph_size()

    def get_compile_ranges(self) -> list[Range]:
        """Inclusive Inductor compile ranges from ``compile_ranges_split_points``."""
        return compile_ranges_from_split_points(self.compile_ranges_split_points)

    # ------------------------------------------------------------------ splitting ops

    def set_splitting_ops_for_v1(self, all2all_backend: str, data_parallel_size: int = 1) -> None:
        """Resolve ``splitting_ops`` (and downgrade ``cudagraph_mode`` where it cannot work)."""
        if self.mode != CompilationMode.VLLM_COMPILE:
            if self.splitting_ops is None:
                self.splitting_ops = []
            return
        if self.pass_config.fuse_attn_quant and not self.use_inductor_graph_partition:
            self.set_splitting_ops_for_attn_fusion()
        elif self.splitting_ops is None:
            self.splitting_ops = list(self.ATTENTION_OPS)
        elif len(self.splitting_ops) == 0:
            if self.cudagraph_mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE):
                logger.warning_once(
                    "Using piecewise cudagraph with empty splitting_ops; the whole graph "
                    "becomes one piece."
                )
            if self.cudagraph_mode == CUDAGraphMode.PIECEWISE:
                logger.warning_once(
                    "Piecewise cudagraph with empty splitting_ops is the same as no cudagraph; "
                    "setting cudagraph_mode to NONE. Use FULL or FULL_DECODE_ONLY for full graphs."
                )
                self.cudagraph_mode = CUDAGraphMode.NONE
            elif self.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE:
                logger.warning_once(
                    "FULL_AND_PIECEWISE with empty splitting_ops; setting cudagraph_mode to FULL."
                )
                self.cudagraph_mode = CUDAGraphMode.FULL
        if (
            all2all_backend == "deepep_high_throughput"
            and data_parallel_size > 1
            and self.cudagraph_mode != CUDAGraphMode.NONE
        ):
            logger.info(
                "DeepEP high-throughput kernels are not CUDA-graph compatible; "
                "setting cudagraph_mode to NONE."
            )
            self.cudagraph_mode = CUDAGraphMode.NONE

    def set_splitting_ops_for_attn_fusion(self) -> None:
        """Splitting ops for attention + quant fusion: attention must stay in the graph."""
        if not self.pass_config.fuse_attn_quant:
            raise ConfigAssertionError(
                "set_splitting_ops_for_attn_fusion() needs pass_config.fuse_attn_quant=True"
            )
        if self.splitting_ops is None:
            if self.cudagraph_mode is None:
                raise ConfigAttributeError(
                    "cudagraph_mode is None; resolve it (the engine config does) before "
                    "set_splitting_ops_for_attn_fusion()"
                )
            self.splitting_ops = []
            if self.cudagraph_mode.has_piecewise_cudagraphs():
                logger.warning_once(
                    "Piecewise cudagraphs cannot be used with attention fusion "
                    "(fuse_attn_quant); setting cudagraph_mode to FULL."
                )
                self.cudagraph_mode = CUDAGraphMode.FULL
        if self.splitting_ops_contain_attention():
            raise ConfigAssertionError(
                "attention ops should not be in splitting_ops when fuse_attn_quant is True; "
                f"got splitting_ops={self.splitting_ops}"
            )

    def splitting_ops_contain_attention(self) -> bool:
        """True when every attention op is in ``splitting_ops``."""
        return self.splitting_ops is not None and all(op in self.splitting_ops for op in self.ATTENTION_OPS)

    def is_attention_compiled_piecewise(self) -> bool:
        """True when the graph is split at attention and compiled piece by piece."""
        if not self.splitting_ops_contain_attention():
            return False
        if not self.use_inductor_graph_partition:
            return self.mode == CompilationMode.VLLM_COMPILE
        return self.backend == "inductor" and self.mode != CompilationMode.NONE

    # ------------------------------------------------------------------ custom ops

    def is_custom_op_enabled(self, op: str) -> bool:
        """Whether ``op`` is on under ``custom_ops`` (needs 'all' or 'none' in the list).

        The rule is :func:`forwardkit.config.custom_ops.is_custom_op_enabled`; as in vLLM this
        method first insists that the list was resolved (holds 'all' or 'none').
        """
        if "all" not in self.custom_ops and "none" not in self.custom_ops:
            raise ConfigAssertionError(
                f"custom_ops must contain 'all' or 'none' before asking about {op!r}, got "
                f"{self.custom_ops}; the engine config adds one of them"
            )
        return is_custom_op_enabled(self.custom_ops, op, self.mode, self.backend)

    def custom_op_log_check(self) -> None:
        """Log enabled/disabled custom ops; warn (once) about ``custom_ops`` entries that
        have no effect in this model. Never raises for unknown ops."""
        if not self.enabled_custom_ops and not self.disabled_custom_ops:
            logger.debug("No custom ops found in model.")
            return
        logger.debug("enabled custom ops: %s", self.enabled_custom_ops)
        logger.debug("disabled custom ops: %s", self.disabled_custom_ops)
        present = set(self.enabled_custom_ops) | set(self.disabled_custom_ops)
        registered = set(CUSTOM_OP_REGISTRY)
        for op in self.custom_ops:
            if op in ("all", "none"):
                continue
            if not op.startswith(("+", "-")):
                raise ConfigAssertionError(f"Invalid custom op syntax {op!r} (expected '+op' or '-op')")
            name = op[1:]
            if name in present:
                continue
            why = "is not present in this model" if name in registered else "does not exist or was not registered"
            logger.warning_once(
                "Op %r %s; %s it via custom_ops has no effect.",
                name,
                why,
                "enabling" if op[0] == "+" else "disabling",
            )

    # ------------------------------------------------------------------ hashing

    def compute_hash(self) -> str:
        """SHA-256 over everything that changes the compiled graph (paths, timings and
        runtime state such as the custom-op counters excluded; ``pass_config``/``dynamic_shapes_config`` by their hashes)."""
        factors = get_hash_factors(self, _HASH_IGNORED)
        factors["pass_config"] = self.pass_config.compute_hash()
        factors["dynamic_shapes_config"] = self.dynamic_shapes_config.compute_hash()
        return hash_factors(factors)


def _resolve_qualname(name: str, registered: list[str]) -> Any:
    """The object ``"package.module.attr"`` names; ValueError listing options otherwise."""
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        raise ValueError(
            f"Invalid backend {name!r}: not a registered torch.compile backend "
            f"({', '.join(registered)}) and not a dotted name 'module.attr'"
        )
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"Invalid backend {name!r}: cannot resolve it ({e})") from e

