"""``EngineConfig`` (vLLM's ``VllmConfig``): all configs of one engine, resolved together.

Constructing an ``EngineConfig`` runs vLLM 0.14.0's ordered resolution:
optimisation-level defaults, compilation and cudagraph modes per platform, capture sizes,
compile ranges and splitting ops. The order is part of the behaviour (for
example capture sizes are worked out before splitting ops may downgrade the cudagraph
mode), so it is kept exactly. Deliberate differences from the reference:

* checks the reference writes as ``assert`` raise ``ConfigAssertionError`` (a ``ValueError``
  and an ``AssertionError``); at construction they reach the caller as a pydantic
  ``ValidationError`` (also a ``ValueError``) carrying the message;
* micro-batching without a model no longer crashes with ``AttributeError``;
* resolution is idempotent (resolving a resolved config gives the same config): ``+rms_norm``
  is added once, split points are deduplicated, capture sizes are dropped when graphs end up
  off, and an out-of-tree backend with a resolved VLLM_COMPILE mode, an unknown mode-1/2
  backend or a mode-3 splitting op that is not ``namespace::op`` is rejected here;
* a failed resolution restores the sub-configs it had changed;
* ``pad_for_cudagraph`` rejects negative batch sizes and explains a missing table;
* quantisation (blocked-weight ``+quant_fp8``), LoRA and KV-transfer steps are absent
  because forwardkit has none of those features;
* the platform hook ``check_and_update_config`` runs only when the platform defines one
  (forwardkit's CPU platform does not, so CPU keeps VLLM_COMPILE instead of the reference
  CPU platform's DYNAMO_TRACE_ONCE).

Resolution reads device facts from ``self.platform`` only: the compilation config built from a
dict, JSON or None gets it explicitly (``CompilationConfig(platform=...)``, passed on to a dict
``pass_config``), and so do the steps that ask the device (capture, FlashInfer cut-offs). No
process-wide platform swap happens, so engine configs for different platforms can be built
from several threads at once. (A ``CompilationConfig`` or ``ParallelConfig`` object built
before keeps what its own construction read from ``current_platform``, as in vLLM.)

The current config (``set_current_engine_config``; also importable from :mod:`.current`) lives
in a ``contextvars.ContextVar``, not a process global, so threads and asyncio tasks building
models concurrently each see their own.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass

from forwardkit import envs
from forwardkit.config.attention import selected_attention_backend
from forwardkit.config.cache import CacheConfig
from forwardkit.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
from forwardkit.config.custom_ops import apply_kernel_switch_env, custom_ops_default
from forwardkit.config.engine_graphs import (
    resolve_static_graphs,
    sequence_parallel_multiple,
    served_graph_mode,
    set_compile_ranges,
    sizes_for_sequence_parallelism,
)
from forwardkit.config.frozen import FreezableConfig, freeze, is_frozen, thawed_copy
from forwardkit.config.levels import (
    OptimizationLevel,
    apply_level_defaults,
    default_capture_sizes,
)
from forwardkit.config.lora import LoRAConfig
from forwardkit.config.model import ModelConfig
from forwardkit.config.observability import ObservabilityConfig
from forwardkit.config.parallel import ParallelConfig, check_parallel_fits_model
from forwardkit.config.scheduler import SchedulerConfig, SpeculativeConfig
from forwardkit.config.utils import ConfigAssertionError, short_repr
from forwardkit.logger import init_logger
from forwardkit.platforms import Platform, current_platform, platform_by_name

__all__ = [
    "EngineConfig",
    "OptimizationLevel",
    "default_capture_sizes",
    "get_current_engine_config",
    "get_current_engine_config_or_none",
    "get_layers_from_engine_config",
    "set_current_engine_config",
]

logger = init_logger(__name__)

# vLLM allows only the DeepEP backends; forwardkit's own all-gather exchange (its default
# backend, which every non-naive backend runs on the CPU) has the DBO yield points too.
_UBATCH_BACKENDS = ("allgather_reducescatter", "deepep_low_latency", "deepep_high_throughput")
_ASYNC_EXECUTORS = ("mp", "uni", "external_launcher")


@dataclass(config=ConfigDict(extra="forbid", arbitrary_types_allowed=True))
class EngineConfig(FreezableConfig):
    """Every config of one engine instance, resolved together on construction."""

    model_config: ModelConfig | None = None
    """The model (None: no model, as vLLM's ``VllmConfig()``; capture sizes stay empty)."""
    parallel_config: ParallelConfig = Field(default_factory=ParallelConfig)
    """Parallel layout (a dict is accepted)."""
    scheduler_config: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """Batch limits (a dict is accepted)."""
    cache_config: CacheConfig = Field(default_factory=CacheConfig)
    """Paged KV cache (a dict is accepted)."""
    if TYPE_CHECKING:
        # Constructor arguments may be a dict, a JSON string or None (converted under this
        # config's platform in __post_init__); after construction they are always these types.
        compilation_config: CompilationConfig = Field(default_factory=CompilationConfig)
    else:
        compilation_config: Any = None
    """``CompilationConfig``; a dict or a JSON object string is converted; None = defaults."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (a dict is accepted); None = off."""
    lora_config: LoRAConfig | None = None
    """LoRA adapter slots (a dict is accepted); None = no LoRA."""
    observability_config: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    """Per-step statistics (a dict is accepted); not part of the compile-cache hash."""
    optimization_level: OptimizationLevel = OptimizationLevel.O2
    """O0..O3 (ints 0-3 and numeric strings accepted)."""
    if TYPE_CHECKING:
        platform: Platform = Field(default_factory=current_platform._get)
    else:
        platform: Any = None
    """A ``Platform`` or its name; None = ``forwardkit.platforms.current_platform``."""
    instance_id: str = ""
    """Unique id of this engine instance (``time_ns`` when empty)."""
    attention_backend: str | None = None
    """Registered attention backend name the model's attention layers use; None =
    ``FORWARDKIT_ATTENTION_BACKEND``, else ``TORCH_NATIVE`` (resolved to the name)."""

    @field_validator("platform", mode="before")
    @classmethod
    def _platform(cls, value: Any) -> Platform | None:
        if value is None:
            return None
        if isinstance(value, str):
            return platform_by_name(value)
        if not isinstance(value, Platform):
            raise ValueError(f"platform must be a Platform, 'cuda' or 'cpu', got {short_repr(value)} "
                             f"({type(value).__name__})")
        return value

    def __post_init__(self) -> None:
        # A sub-config resolved before (it belongs to another engine config) is read-only:
        # this config resolves a copy of it and the original stays as it is.
        for name in ("model_config", "parallel_config", "scheduler_config", "cache_config",
                     "compilation_config", "speculative_config", "lora_config"):
            value = getattr(self, name)
            if is_frozen(value):
                setattr(self, name, thawed_copy(value))
        if self.platform is None:
            self.platform = current_platform._get()
        # Everything resolution builds or checks is given self.platform explicitly (the
        # compilation config's platform defaults included): no process-wide platform swap.
        self.compilation_config = _to_compilation_config(self.compilation_config, self.platform)
        # Resolution mutates the sub-configs in place (as vLLM does); a failure puts them
        # back, so a rejected config changes nothing the caller passed in.
        parts = [self.compilation_config, self.compilation_config.pass_config, self.model_config,
                 self.parallel_config, self.scheduler_config]
        saved = [(obj, {k: copy.copy(v) for k, v in vars(obj).items()
                        if k not in type(obj).RUNTIME_STATE})  # not touched by resolution
                 for obj in parts if obj is not None]
        try:
            self._resolve()
        except BaseException:
            for obj, state in saved:
                vars(obj).update(state)
            raise
        freeze(self)  # resolved: this config and its sub-configs are read-only from here on

    def require_model_config(self) -> ModelConfig:
        """``model_config``; a ``ValueError`` when this config has none (an ``EngineConfig``
        built directly without one, as vLLM allows). ``build_engine_config`` always sets one
        (the built-in model when no checkpoint or shape is given)."""
        if self.model_config is None:
            raise ValueError(
                "this engine config has no model_config; build it with "
                "forwardkit.config.builder.build_engine_config (no model = the built-in model) "
                "or pass model_config=ModelConfig(...)"
            )
        return self.model_config

    # ------------------------------------------------------------------ resolution
    def _resolve(self) -> None:
        cc = self.compilation_config = _to_compilation_config(self.compilation_config, self.platform)
        model, parallel, sched = self.model_config, self.parallel_config, self.scheduler_config
        if not self.instance_id:  # step 1
            self.instance_id = str(time.time_ns())
        self.attention_backend = selected_attention_backend(self.attention_backend)
        if model is not None:  # step 3
            parallel.is_moe_model = model.is_moe
            if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < model.get_max_model_len():
                raise ValueError(
                    f"max_num_batched_tokens ({sched.max_num_batched_tokens}) is smaller than the "
                    f"model's max_model_len ({model.max_model_len}) while chunked prefill is off"
                )
        self._resolve_async_scheduling()  # steps 5-6
        if parallel.disable_nccl_for_dp_synchronization is None:
            parallel.disable_nccl_for_dp_synchronization = bool(sched.async_scheduling)
        if self.optimization_level > OptimizationLevel.O0 and model is not None and model.enforce_eager:
            logger.warning("Enforce eager set, overriding optimization level to -O0")  # step 7
            self.optimization_level = OptimizationLevel.O0
        if model is not None and model.enforce_eager and cc.mode not in (None, CompilationMode.NONE):
            # NOTE: the reference keeps the mode it was given and compiles under enforce_eager;
            # here enforce_eager means no compilation, and the config says so.
            logger.warning("enforce_eager runs the model eagerly: compilation_config.mode=%d (%s) "
                           "is overridden to 0 (NONE)", int(cc.mode), cc.mode.name)
            cc.mode = CompilationMode.NONE
        self._warn_ignored_passes()  # step 8
        if cc.mode is None:  # step 10
            mode = (CompilationMode.VLLM_COMPILE if self.optimization_level > OptimizationLevel.O0
                    else CompilationMode.NONE)
            if mode == CompilationMode.VLLM_COMPILE and cc.backend not in ("eager", "inductor"):
                # NOTE: the reference accepts this and fails later; rejecting it keeps the
                # resolved config valid input for a second resolution.
                raise ValueError(
                    f"compilation_config.backend={cc.backend!r} cannot be used with mode "
                    f"VLLM_COMPILE (resolved from {self.optimization_level.name}); piecewise "
                    "compilation accepts backend 'eager' or 'inductor', or set mode 1 or 2 to use "
                    "a torch.compile backend")
            cc.mode = mode
        if "all" not in cc.custom_ops and "none" not in cc.custom_ops:  # step 11
            cc.custom_ops.append(custom_ops_default(cc.mode, cc.backend))
        apply_kernel_switch_env(cc.custom_ops)  # the deprecated kernel variables, into the list
        apply_level_defaults(cc, self.optimization_level)  # step 12
        if (cc.resolved_cudagraph_mode().requires_piecewise_compilation()
                and cc.mode != CompilationMode.VLLM_COMPILE):
            logger.info("Cudagraph mode %s is not compatible with compilation mode %s; "
                        "overriding to NONE.", cc.cudagraph_mode, cc.mode)  # step 13
            cc.cudagraph_mode = CUDAGraphMode.NONE
        pc = cc.pass_config  # step 14
        if pc.fuse_gemm_comms:
            pc.enable_sp = True
        if pc.enable_sp:
            if "-rms_norm" in cc.custom_ops:
                logger.warning("RMS norm force disabled, sequence parallelism might break")
            elif "+rms_norm" not in cc.custom_ops:  # NOTE: the reference appends it again
                cc.custom_ops.append("+rms_norm")
        resolve_static_graphs(cc, model, sched, parallel, self.platform,
                              self.uniform_decode_query_len)  # step 15
        set_compile_ranges(cc, model, sched, parallel, self.platform)  # step 17
        hook = getattr(self.platform, "check_and_update_config", None)  # step 19
        if callable(hook):
            hook(self)
        self._resolve_splitting_ops()  # step 21
        if pc.enable_sp:  # step 22
            self._resolve_sequence_parallel_ops()
        self._final_checks()  # steps 23-24
        self._resolve_debug_dump_path()  # step 27

    def _warn_ignored_passes(self) -> None:
        """Step 8: the optimization passes run only inside piecewise (Inductor) compilation.
        The reference warns whenever the backend is eager or the mode is not VLLM_COMPILE,
        whether or not the user asked for a pass; here the warning names the passes the user
        enabled that will not run, and says nothing when there are none."""
        cc = self.compilation_config
        if not (cc.backend == "eager" or (cc.mode is not None and cc.mode != CompilationMode.VLLM_COMPILE)):
            return
        asked = sorted(k for k, v in cc.pass_config.to_dict().items() if v is True)
        if asked:
            why = ("backend 'eager'" if cc.backend == "eager"
                   else f"compilation mode {int(cc.mode or 0)} ({cc.mode.name if cc.mode is not None else None})")
            logger.warning_once(
                "pass_config %s: these passes run only inside piecewise Inductor compilation (mode 3 with "
                "backend 'inductor'); with %s they are ignored", ", ".join(asked), why)

    def _resolve_splitting_ops(self) -> None:
        cc, model, parallel = self.compilation_config, self.model_config, self.parallel_config
        effective_dp = parallel.data_parallel_size if model is None or model.is_moe else 1
        graphs_before = cc.cudagraph_mode
        if (cc.splitting_ops is None and cc.mode == CompilationMode.VLLM_COMPILE
                and not self.platform.supports_static_graph() and not cc.pass_config.enable_sp
                and not cc.use_inductor_graph_partition and not cc.pass_config.fuse_attn_quant):
            # NOTE: the reference splits at attention here on every platform: the pieces are
            # what piecewise CUDA graphs capture, and a platform without static graphs never
            # captures one (the reference's own CPU platform compiles one graph, in mode 2).
            # Each split costs a graph exit and entry per layer and step (a 1 B model's
            # decode step runs about 2 ms faster as one graph on a 2-core CPU), so such a
            # platform compiles one graph unless the user lists splitting ops. Sequence
            # parallelism keeps the split: its pass is written for the pieces.
            cc.splitting_ops = []
        cc.set_splitting_ops_for_v1(
            all2all_backend=parallel.all2all_backend, data_parallel_size=effective_dp)
        if graphs_before != CUDAGraphMode.NONE and cc.cudagraph_mode == CUDAGraphMode.NONE:
            # NOTE: the reference keeps the capture sizes it worked out before step 21 turned
            # graphs off, so resolving its own output again gives a different config; we drop
            # them, which makes resolution idempotent (found by a hypothesis property test).
            cc.max_cudagraph_capture_size = 0
            cc.cudagraph_capture_sizes = []
            cc.post_init_cudagraph_sizes()

    def _resolve_sequence_parallel_ops(self) -> None:
        cc, parallel = self.compilation_config, self.parallel_config
        if cc.mode != CompilationMode.VLLM_COMPILE:
            logger.warning("Sequence parallelism is enabled, but running in mode %s; it "
                           "takes effect only with VLLM_COMPILE.", cc.mode)
        fullgraph = bool(cc.use_inductor_graph_partition) or len(cc.splitting_ops or []) == 0
        if parallel.pipeline_parallel_size > 1 or not fullgraph:
            if "-rms_norm" not in cc.custom_ops:
                if "+rms_norm" not in cc.custom_ops:
                    cc.custom_ops.append("+rms_norm")
            else:
                logger.warning("Sequence parallelism with a piecewise graph needs the "
                               "rms_norm custom op, but custom_ops has -rms_norm.")

    def _resolve_async_scheduling(self) -> None:
        sched, spec, parallel = self.scheduler_config, self.speculative_config, self.parallel_config
        reasons = []
        if parallel.pipeline_parallel_size > 1:
            reasons.append("pipeline parallelism")
        if spec is not None and not spec.use_eagle():
            reasons.append(f"speculative method {spec.method!r} (only EAGLE/MTP-like ones)")
        if spec is not None and spec.disable_padded_drafter_batch:
            reasons.append("disable_padded_drafter_batch")
        if parallel.distributed_executor_backend not in _ASYNC_EXECUTORS:
            reasons.append(f"executor {parallel.distributed_executor_backend!r}")
        if sched.async_scheduling and reasons:
            raise ValueError(f"async scheduling is not supported with {', '.join(reasons)}")
        if sched.async_scheduling is None:
            if reasons:  # NOTE: the reference warns; the user asked for nothing here
                logger.info("Async scheduling disabled because of %s.", ", ".join(reasons))
            sched.async_scheduling = not reasons

    @property
    def sequence_parallel_multiple(self) -> int:
        """What every step's token count is padded to a multiple of: the TP size with the
        sequence-parallelism pass on and TP > 1, else 1 (one rule for the capture sizes, the
        step planner and the runner's warm-up)."""
        return sequence_parallel_multiple(self.compilation_config, self.parallel_config)

    def update_sizes_for_sequence_parallelism(self, sizes: list[int]) -> list[int]:
        """Keep the sizes divisible by the TP size (sequence parallelism needs that)."""
        return sizes_for_sequence_parallelism(sizes, self.parallel_config.tensor_parallel_size)

    def _final_checks(self) -> None:
        cc, model, parallel = self.compilation_config, self.model_config, self.parallel_config
        if model is not None:
            check_parallel_fits_model(parallel, model)
        tp = parallel.tensor_parallel_size
        if cc.pass_config.enable_sp and tp > 1:
            odd = [s for s in cc.compile_sizes or [] if isinstance(s, int) and s % tp]
            if odd:
                raise ValueError(
                    f"compilation_config.compile_sizes {odd} are not multiples of "
                    f"tensor_parallel_size={tp}: with pass_config.enable_sp every step is padded "
                    f"to a multiple of {tp}, so they would never run; give multiples of {tp}")
        if cc.mode in (CompilationMode.STOCK_TORCH_COMPILE, CompilationMode.DYNAMO_TRACE_ONCE):
            cc.init_backend(self)  # an unknown backend is a ValueError now, not at start-up
        if cc.mode == CompilationMode.VLLM_COMPILE:  # the split needs 'namespace::op' names
            for op in cc.splitting_ops or []:
                if "::" not in op or not all(op.split("::", 1)):
                    raise ValueError(f"compilation_config.splitting_ops entries must be op names "
                                     f"'namespace::op[.overload]' (e.g. 'forwardkit::unified_attention') "
                                     f"with mode VLLM_COMPILE, got {op!r:.80}")
        if self.platform.is_cuda_alike():  # step 23
            graphs = cc.resolved_cudagraph_mode()
            if (graphs.has_full_cudagraphs() and model is not None
                    and not model.disable_cascade_attn and not graphs.has_piecewise_cudagraphs()):
                logger.warning_once("No piecewise cudagraph for executing cascade attention; "
                                    "it will run eagerly.")
            if graphs.requires_piecewise_compilation() and cc.mode != CompilationMode.VLLM_COMPILE:
                raise ConfigAssertionError(
                    f"Compilation mode should be CompilationMode.VLLM_COMPILE when cudagraph_mode "
                    f"{cc.cudagraph_mode} requires piecewise compilation, got {cc.mode}")
        if parallel.use_ubatching:  # step 24
            if parallel.all2all_backend not in _UBATCH_BACKENDS:
                raise ConfigAssertionError(
                    "Microbatching currently only supports the allgather_reducescatter, "
                    "deepep_low_latency and deepep_high_throughput all2all backends. "
                    f"{parallel.all2all_backend} is not supported. Set all2all_backend to one "
                    "of those.")
            if model is not None and not model.disable_cascade_attn:
                logger.warning("Disabling cascade attention when DBO/micro-batching is enabled.")
                model.disable_cascade_attn = True

    def _resolve_debug_dump_path(self) -> None:
        cc = self.compilation_config
        if cc.debug_dump_path is not None:
            cc.debug_dump_path = Path(cc.debug_dump_path).absolute().expanduser()
        env = envs.FORWARDKIT_DEBUG_DUMP_PATH
        if env:
            if cc.debug_dump_path is not None:
                logger.warning("Config debug_dump_path %s is overridden by FORWARDKIT_DEBUG_DUMP_PATH=%s",
                               cc.debug_dump_path, env)
            cc.debug_dump_path = Path(env).absolute().expanduser()

    # ------------------------------------------------------------------ queries
    @property
    def uniform_decode_query_len(self) -> int:
        """Tokens per request in a decode step: 1 + speculative tokens."""
        spec = self.speculative_config
        return 1 + spec.num_speculative_tokens if spec is not None and spec.num_speculative_tokens else 1

    @property
    def served_cudagraph_mode(self) -> CUDAGraphMode:
        """The CUDA-graph mode a runner of this config serves, decided here once for the
        planner, dispatcher and runner: ``compilation_config.cudagraph_mode`` (vLLM's
        configured value, left as vLLM's resolution leaves it) lowered to NONE with
        ``enforce_eager`` or when :attr:`platform` cannot capture graphs now, else to what
        the :attr:`attention_backend` supports (``config.engine_graphs.served_graph_mode``).
        Reading it needs that backend registered when graphs are on (a ``ValueError`` names
        it otherwise); a FULL mode the backend cannot run at all is a ``ValueError``."""
        return served_graph_mode(self.compilation_config, self.model_config, self.platform,
                                 selected_attention_backend(self.attention_backend),
                                 self.uniform_decode_query_len)

    @property
    def compiles_model(self) -> bool:
        """Whether models built under this config compile their ``support_torch_compile``
        modules: compilation mode is not NONE and ``enforce_eager`` is off. The one answer the
        decorator and the runner read."""
        mode = self.compilation_config.mode
        if mode is None or int(mode) == 0:
            return False
        return self.model_config is None or not self.model_config.enforce_eager

    def pad_for_cudagraph(self, batch_size: int) -> int:
        """The capture size a batch of ``batch_size`` tokens is padded to."""
        table = self.compilation_config.bs_to_padded_graph_size
        if table is None:
            raise ValueError(
                "no cudagraph padding table (compilation_config.bs_to_padded_graph_size is "
                f"None): CUDA graphs are off on platform {self.platform.name!r}, or capture "
                "sizes were set without compute_bs_to_padded_graph_size()")
        if not 0 <= batch_size < len(table):
            raise IndexError(f"batch size {batch_size} is outside the cudagraph padding table "
                             f"[0, {len(table) - 1}] (max_cudagraph_capture_size)")
        return table[batch_size]

    def compile_debug_dump_path(self) -> Path | None:
        """``debug_dump_path / rank_<rank>_dp_<dp index>``, or None without a dump path."""
        path = self.compilation_config.debug_dump_path
        if path is None:
            return None
        p = self.parallel_config
        return Path(path) / f"rank_{p.rank}_dp_{p.data_parallel_index}"

    def compute_hash(self) -> str:
        """10 hex chars over every sub-config hash (and the platform): the compile-cache key."""
        parts = [
            self.model_config.compute_hash() if self.model_config is not None else "None",
            self.cache_config.compute_hash(),
            self.parallel_config.compute_hash(),
            self.scheduler_config.compute_hash(),
            self.compilation_config.compute_hash(),
            self.speculative_config.compute_hash() if self.speculative_config is not None else "None",
            self.lora_config.compute_hash() if self.lora_config is not None else "None",
            self.platform.name,
        ]
        return hashlib.sha256(str(parts).encode()).hexdigest()[:10]


def _to_compilation_config(value: Any, platform: Platform) -> CompilationConfig:
    """``value`` as a ``CompilationConfig``; one built here gets ``platform``'s defaults (a
    given ``CompilationConfig`` keeps those of the platform it was built for)."""
    if value is None:
        return CompilationConfig(platform=platform)
    if isinstance(value, str):
        return CompilationConfig.from_cli(value, platform=platform)
    if isinstance(value, dict):
        return CompilationConfig(**value, platform=platform)
    if not isinstance(value, CompilationConfig):
        raise ValueError(f"compilation_config must be a CompilationConfig, dict or JSON object "
                         f"string, got {type(value).__name__}")
    return value


# ------------------------------------------------------------------ the current config
# A ``contextvars.ContextVar``, so threads and asyncio tasks building models concurrently each
# see their own. It lives here, next to ``EngineConfig`` (the fallback outside a context is a
# default ``EngineConfig()``); :mod:`.current` re-exports it.

_CURRENT: contextvars.ContextVar[EngineConfig | None] = contextvars.ContextVar(
    "forwardkit_current_engine_config", default=None
)


@contextlib.contextmanager
def set_current_engine_config(config: EngineConfig, check_compile: bool = False) -> Iterator[EngineConfig]:
    """Make ``config`` current while a model is built; restores the previous one on exit.

    With ``check_compile``, a normal exit runs ``custom_op_log_check()`` (warns about
    ``custom_ops`` entries that named no op of the model).
    """
    token = _CURRENT.set(config)
    try:
        yield config
    finally:
        _CURRENT.reset(token)
    if check_compile:
        config.compilation_config.custom_op_log_check()


def get_current_engine_config_or_none() -> EngineConfig | None:
    """The current engine config, or None outside :func:`set_current_engine_config`."""
    return _CURRENT.get()


def get_current_engine_config() -> EngineConfig:
    """The current engine config; outside a context, a fresh default ``EngineConfig()``.

    The fallback is built anew on each call (like vLLM), so layers registered into it
    are not shared between models; a warning is logged once.
    """
    config = _CURRENT.get()
    if config is None:
        logger.warning_once(
            "get_current_engine_config() called outside set_current_engine_config(); "
            "using a default EngineConfig()."
        )
        return EngineConfig()
    return config


def get_layers_from_engine_config(config: EngineConfig, layer_type: type,
                                  layer_names: list[str] | None = None) -> dict[str, Any]:
    """Layers of ``static_forward_context`` that are instances of ``layer_type``."""
    ctx = config.compilation_config.compile_state.static_forward_context
    names = list(ctx) if layer_names is None else layer_names
    return {name: ctx[name] for name in names if isinstance(ctx[name], layer_type)}
