"""The forward context: what the step that is running right now needs to know.

Model code deep inside the network (attention custom ops, MoE layers, CUDA-graph wrappers)
reads the current :class:`ForwardContext` via :func:`get_forward_context` instead of taking
extra arguments, which keeps compiled graphs' signatures stable. The model runner installs
it around each forward with :func:`set_forward_context`.

Re-implements vLLM 0.14.0's ``vllm.forward_context`` with one
deliberate change: the current context lives in a :class:`contextvars.ContextVar`, not a
process global, so every thread (micro-batch threads) and asyncio task sees its own context.
A new thread starts with no context; an asyncio task starts with its creator's.
``_forward_context`` is still readable as a module attribute (it returns the caller's current
context), but assigning to it has no effect; use :func:`override_forward_context`.

Batch-size telemetry (``FORWARDKIT_LOG_BATCHSIZE_INTERVAL >= 0``) follows vLLM, except that
each scope times itself (vLLM's single ``forward_start_time`` breaks under nesting or
threads), the log line also gives the p99 per size, and :func:`get_batchsize_stats` /
:func:`reset_batchsize_stats` expose the numbers without parsing logs. ``DPMetadata`` and the
SP helpers are defined in :mod:`forwardkit.distributed.dp_utils` and re-exported here.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from forwardkit import envs, telemetry
from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.config.compilation_methods import STATE_ATTR as _STATE_ATTR
from forwardkit.distributed.dp_utils import DPMetadata, coordinate_batch_across_dp

# The SP helpers live with DPMetadata; re-exported here under vLLM's names.
from forwardkit.distributed.dp_utils import (
    _compute_chunked_local_num_tokens as _compute_chunked_local_num_tokens,
)
from forwardkit.distributed.dp_utils import _compute_sp_num_tokens as _compute_sp_num_tokens
from forwardkit.distributed.dp_utils import make_dp_metadata as _make_dp_metadata
from forwardkit.logger import init_logger
from forwardkit.microbatching.slices import UBatchSlices
from forwardkit.platforms import Platform, active_platform, current_platform

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig

__all__ = [
    "AttnMetadata",
    "AttnMetadataDict",
    "BatchDescriptor",
    "DPMetadata",
    "ForwardContext",
    "ForwardContextNotSetError",
    "UBatchSlices",
    "coordinate_batch_across_dp",
    "create_forward_context",
    "current_platform",
    "get_batchsize_stats",
    "get_forward_context",
    "init_logger",
    "is_forward_context_available",
    "override_forward_context",
    "reset_batchsize_stats",
    "set_forward_context",
    "StepAttentionMetadata",
]

logger = init_logger(__name__)

# Batch-size telemetry. Plain module attributes: tests monkeypatch them.
batchsize_logging_interval: float = envs.FORWARDKIT_LOG_BATCHSIZE_INTERVAL
track_batchsize: bool = batchsize_logging_interval >= 0
batchsize_forward_time: defaultdict[Any, list[float]] = defaultdict(list)
forward_start_time: float = 0
last_logging_time: float = 0

_DEFAULT_PLATFORM_HOOK = Platform.set_additional_forward_context
_HOOK_NAME = "set_additional_forward_context"
_new_object = object.__new__
_NONE, _PIECEWISE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
_NOT_SET_MSG = (
    "Forward context is not set. Please use `set_forward_context` to set the forward context."
)


class ForwardContextNotSetError(AssertionError):
    """``get_forward_context()`` was called outside any forward context.

    An ``AssertionError`` subclass, so code written against vLLM keeps working.
    """


class BatchDescriptor(NamedTuple):
    """The key that identifies a captured CUDA graph: the shape class of one step.

    ``num_tokens`` is the padded token count; ``num_reqs`` None means "any number of
    requests" (PIECEWISE graphs and mixed-batch FULL graphs); ``uniform`` marks
    uniform-decode batches; ``has_lora`` active LoRA adapters. Every field takes part in
    equality and hashing, so keep the set minimal.
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False

    def relax_for_mixed_batch_cudagraphs(self) -> BatchDescriptor:
        """The same descriptor with ``num_reqs=None`` and ``uniform=False`` (mixed-batch key)."""
        return BatchDescriptor(self.num_tokens, None, False, self.has_lora)


class StepAttentionMetadata:
    """Base class of an attention backend's per-step metadata: what the forward context
    carries for each attention layer. Backends subclass it (forwardkit's torch-native
    backend: ``forwardkit.layers.attention_metadata.AttentionMetadata``); the forward context
    only passes it through."""

    __slots__ = ()


#: Attention metadata of one step: layer name -> that layer's metadata.
AttnMetadataDict = dict[str, StepAttentionMetadata]
#: What ``ForwardContext.attn_metadata`` holds: one dict, one dict per micro-batch, or None
#: (profile / warm-up runs).
AttnMetadata = AttnMetadataDict | list[AttnMetadataDict] | None


@dataclass
class ForwardContext:
    """Everything the running step exposes to model code.

    ``no_compile_layers`` is the config's ``static_forward_context`` dict itself (layer name
    -> layer); ``attn_metadata`` is a dict layer name -> metadata (a list of such dicts, one
    per micro-batch, when micro-batching; None in profile/warm-up runs);
    ``virtual_engine`` indexes each attention layer's ``kv_cache`` list.
    ``cudagraph_runtime_mode`` must be NONE, PIECEWISE or FULL.
    """

    no_compile_layers: dict[str, Any]
    attn_metadata: AttnMetadata
    virtual_engine: int
    dp_metadata: DPMetadata | None = None
    cudagraph_runtime_mode: CUDAGraphMode = _NONE
    batch_descriptor: BatchDescriptor | None = None
    ubatch_slices: UBatchSlices | None = None
    additional_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        mode = self.cudagraph_runtime_mode
        if not (mode is _NONE or mode is _PIECEWISE or mode is _FULL):
            raise AssertionError(f"Invalid cudagraph runtime mode: {mode}")


_CURRENT: ContextVar[ForwardContext | None] = ContextVar("forwardkit_forward_context", default=None)


def __getattr__(name: str) -> Any:
    # vLLM exposes the current context as the module global ``_forward_context``.
    if name == "_forward_context":
        return _CURRENT.get()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_forward_context() -> ForwardContext:
    """The forward context of the calling thread / task.

    Raises :class:`ForwardContextNotSetError` (an ``AssertionError``) when none is set.
    """
    ctx = _CURRENT.get()
    if ctx is None:
        raise ForwardContextNotSetError(_NOT_SET_MSG)
    return ctx


def is_forward_context_available() -> bool:
    """Whether a forward context is set for the calling thread / task."""
    return _CURRENT.get() is not None


def create_forward_context(
    attn_metadata: AttnMetadata,
    vllm_config: EngineConfig,
    virtual_engine: int = 0,
    dp_metadata: DPMetadata | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = _NONE,
    batch_descriptor: BatchDescriptor | None = None,
    ubatch_slices: UBatchSlices | None = None,
    additional_kwargs: dict[str, Any] | None = None,
) -> ForwardContext:
    """Build (but do not install) a :class:`ForwardContext` for ``vllm_config``.

    ``vllm_config`` is the :class:`~forwardkit.config.engine.EngineConfig`; only its
    ``compilation_config.static_forward_context`` (and, under DP, ``parallel_config``) is read.
    """
    return ForwardContext(
        no_compile_layers=vllm_config.compilation_config.static_forward_context,
        attn_metadata=attn_metadata,
        virtual_engine=virtual_engine,
        dp_metadata=dp_metadata,
        cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor,
        ubatch_slices=ubatch_slices,
        additional_kwargs=additional_kwargs or {},
    )


def _restore(token: Token | None) -> None:
    if token is None:
        raise RuntimeError("forward-context scope exited without being entered")
    try:
        _CURRENT.reset(token)
    except ValueError:  # exited in another asyncio task/context than entered: best effort
        old = token.old_value
        _CURRENT.set(None if old is Token.MISSING else old)


class _OverrideScope:
    """Context manager installing a fixed context (see :func:`override_forward_context`)."""

    __slots__ = ("_ctx", "_token")

    def __init__(self, forward_context: ForwardContext | None) -> None:
        self._ctx = forward_context
        self._token: Token | None = None

    def __enter__(self) -> None:
        self._token = _CURRENT.set(self._ctx)

    def __exit__(self, *exc: object) -> None:
        _restore(self._token)


def override_forward_context(forward_context: ForwardContext | None) -> _OverrideScope:
    """Context manager: make ``forward_context`` current (None: none) and restore on exit.

    Affects only the calling thread / asyncio task; nests; restores on exceptions.
    """
    return _OverrideScope(forward_context)


#: What :func:`set_forward_context` hands its scope: its arguments, in its order (a plain tuple,
#: typed; a NamedTuple would cost ~0.3 us a step).
_StepArgs = tuple[AttnMetadata, "EngineConfig", int, "int | None", "torch.Tensor | None",
                  CUDAGraphMode, "BatchDescriptor | None", "UBatchSlices | None"]


class _ForwardStepScope:
    """The context manager returned by :func:`set_forward_context` (work happens on enter)."""

    # NOTE: set_forward_context makes instances without calling __init__ (~0.1 us a step):
    # ``_args`` is set there, the rest on enter.
    __slots__ = ("_args", "_token", "_start", "_num_tokens")
    _args: _StepArgs
    _token: Token
    _start: float | None
    _num_tokens: int | None

    def __init__(self, args: _StepArgs) -> None:
        self._args = args

    def __enter__(self) -> None:
        global forward_start_time
        (attn_metadata, vllm_config, virtual_engine, num_tokens, num_tokens_across_dp,
         cudagraph_runtime_mode, batch_descriptor, ubatch_slices) = self._args
        if track_batchsize and attn_metadata is not None:
            # NOTE: the start time is kept per scope; vLLM's single global is
            # also updated for compatibility but not used for the measurement.
            self._num_tokens = num_tokens
            self._start = forward_start_time = time.perf_counter()
        else:
            self._start = None

        dp_metadata = None
        parallel_config = vllm_config.parallel_config
        if parallel_config.data_parallel_size > 1 and (
            attn_metadata is not None or num_tokens is not None
        ):
            if num_tokens_across_dp is None:
                assert ubatch_slices is None, (
                    "ubatch_slices need num_tokens_across_dp from coordinate_batch_across_dp"
                )
                assert num_tokens is not None, (
                    "with data_parallel_size > 1, set_forward_context needs num_tokens or "
                    "num_tokens_across_dp"
                )
                # A collective: every DP rank must enter its forward context together.
                _, num_tokens_across_dp, _ = coordinate_batch_across_dp(
                    num_tokens_unpadded=num_tokens, parallel_config=parallel_config,
                    allow_microbatching=False, allow_dp_padding=False,
                )
                assert num_tokens_across_dp is not None
            dp_metadata = _make_dp_metadata(parallel_config, num_tokens or 0, num_tokens_across_dp)

        if (cudagraph_runtime_mode is not _NONE and num_tokens is not None
                and batch_descriptor is None):
            batch_descriptor = BatchDescriptor(num_tokens)

        platform = active_platform()
        if (type(platform).set_additional_forward_context is _DEFAULT_PLATFORM_HOOK
                and _HOOK_NAME not in platform.__dict__):
            # NOTE: the base hook always returns {}; skipping the keyword call saves ~1 us/step.
            additional_kwargs: dict[str, Any] = {}
        else:
            additional_kwargs = platform.set_additional_forward_context(
                attn_metadata=attn_metadata, vllm_config=vllm_config,
                virtual_engine=virtual_engine, dp_metadata=dp_metadata, num_tokens=num_tokens,
                num_tokens_across_dp=num_tokens_across_dp,
                cudagraph_runtime_mode=cudagraph_runtime_mode,
                batch_descriptor=batch_descriptor, ubatch_slices=ubatch_slices,
            ) or {}
        if not (cudagraph_runtime_mode is _NONE or cudagraph_runtime_mode is _PIECEWISE
                or cudagraph_runtime_mode is _FULL):
            raise AssertionError(f"Invalid cudagraph runtime mode: {cudagraph_runtime_mode}")
        # NOTE: the dataclass's own __init__ (defaults, __post_init__) costs ~0.4 us a step;
        # the instance is the same object it would build (the mode is checked just above).
        # The layer dict is read from the compile state directly (the config's
        # static_forward_context property goes through two property lookups).
        compilation_config = vllm_config.compilation_config
        try:
            layers = compilation_config.__dict__[_STATE_ATTR].static_forward_context
        except (KeyError, AttributeError):  # a config object of another make (vLLM's own)
            layers = _foreign_layers(compilation_config)
        ctx = _new_object(ForwardContext)
        ctx.__dict__ = {
            "no_compile_layers": layers,
            "attn_metadata": attn_metadata, "virtual_engine": virtual_engine,
            "dp_metadata": dp_metadata, "cudagraph_runtime_mode": cudagraph_runtime_mode,
            "batch_descriptor": batch_descriptor, "ubatch_slices": ubatch_slices,
            "additional_kwargs": additional_kwargs,
        }
        self._token = _CURRENT.set(ctx)

    def __exit__(self, *exc: object) -> None:
        try:
            token = self._token
        except AttributeError:
            raise RuntimeError("forward-context scope exited without being entered") from None
        try:
            _CURRENT.reset(token)
        except ValueError:  # exited in another asyncio task/context than entered
            _restore(token)
        if self._start is not None:
            _record_forward_time(self._num_tokens, self._start)


def _foreign_layers(compilation_config: object) -> dict[str, Any]:
    """The layer dict of a compilation config that is not forwardkit's (no private compile
    state): its ``static_forward_context`` attribute, as vLLM's own config objects have it."""
    try:
        layers: object = compilation_config.static_forward_context  # type: ignore[attr-defined]
    except AttributeError:
        layers = None
    if not isinstance(layers, dict):
        raise TypeError(
            "set_forward_context: vllm_config.compilation_config must be a CompilationConfig or "
            "an object whose static_forward_context is a dict (layer name -> layer); got "
            f"{type(compilation_config).__name__} with static_forward_context={layers!r}")
    return layers


def set_forward_context(
    attn_metadata: AttnMetadata,
    vllm_config: EngineConfig,
    virtual_engine: int = 0,
    num_tokens: int | None = None,
    num_tokens_across_dp: torch.Tensor | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = _NONE,
    batch_descriptor: BatchDescriptor | None = None,
    ubatch_slices: UBatchSlices | None = None,
) -> _ForwardStepScope:
    """Context manager that installs the forward context of one model step.

    On entry: with ``data_parallel_size > 1`` builds :class:`DPMetadata` from
    ``num_tokens_across_dp`` (or, when that is None, from a ``coordinate_batch_across_dp``
    all-reduce without padding — a collective every DP rank must join); when the mode is not
    NONE and no descriptor is given, uses ``BatchDescriptor(num_tokens)``; asks the platform
    for ``additional_kwargs``; installs the context for the calling thread / task. On exit
    the previous context is restored (also on exceptions, which propagate) and, with
    batch-size telemetry on and ``attn_metadata`` not None, the step time is recorded.
    The ``with`` target is None.
    """
    scope: _ForwardStepScope = _new_object(_ForwardStepScope)
    scope._args = (attn_metadata, vllm_config, virtual_engine, num_tokens, num_tokens_across_dp,
                   cudagraph_runtime_mode, batch_descriptor, ubatch_slices)
    return scope


def _record_forward_time(num_tokens: int | None, start: float) -> None:
    """Telemetry exit step: sync, record, and log at most once per interval."""
    global last_logging_time
    # NOTE: active_platform() skips the proxy's lookups (its __getattr__ fallback costs ~1 us).
    synchronize = active_platform().synchronize
    if synchronize is not None:
        synchronize()
    now = time.perf_counter()
    batchsize_forward_time[num_tokens].append((now - start) * 1000)
    if now - last_logging_time > batchsize_logging_interval:
        last_logging_time = now
        line = telemetry.format_summary(batchsize_forward_time)
        if line is not None:
            logger.info(line)


def get_batchsize_stats() -> dict[int, dict[str, float]]:
    """Recorded forward times per batch size: ``count``, ``median_ms``, ``p99_ms``, ``mean_ms``.

    Empty unless telemetry is on (``FORWARDKIT_LOG_BATCHSIZE_INTERVAL >= 0``). The key is the
    ``num_tokens`` given to :func:`set_forward_context` (None when it was not given).
    """
    return telemetry.summarize(batchsize_forward_time)


def reset_batchsize_stats() -> None:
    """Forget every recorded forward time (vLLM never clears them; this is an addition)."""
    batchsize_forward_time.clear()
