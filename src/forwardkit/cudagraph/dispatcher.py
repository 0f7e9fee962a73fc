"""Which CUDA graph (if any) serves a batch: ``CudagraphDispatcher`` (vLLM 0.14.0 semantics).

The dispatcher keeps one set of graph keys (``BatchDescriptor``) per runtime mode
(PIECEWISE, FULL). Per step it pads the token count to a capture size and picks FULL
for uniform-decode batches when full graphs exist, PIECEWISE for everything else when
piecewise graphs exist, and NONE (eager, unpadded) otherwise.
:func:`determine_batch_execution_and_padding` is the runner-side decision around it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.cudagraph.metrics import CUDAGraphStat
from forwardkit.forward_context import BatchDescriptor
from forwardkit.logger import init_logger
from forwardkit.platforms import current_platform

__all__ = [
    "BatchExecution",
    "CudagraphDispatcher",
    "as_cudagraph_mode",
    "cudagraphs_available",
    "determine_batch_execution_and_padding",
    "is_uniform_decode",
]

logger = init_logger(__name__)

_PIECEWISE_ASSERT = (
    "Compilation mode should be CompilationMode.VLLM_COMPILE when cudagraph_mode piecewise "
    "cudagraphs is used, and attention should be in splitting_ops or inductor splitting "
    "should be used. "
)


def cudagraphs_available(platform: Any = None) -> bool:
    """Whether CUDA graphs can really be captured on ``platform`` (default: the current one).

    False on CPU, and on a CUDA platform emulated without a GPU (tests), so callers can
    run with mode NONE there.
    """
    platform = current_platform if platform is None else platform
    if not platform.supports_static_graph():
        return False
    if platform.is_cuda_alike():
        return torch.cuda.is_available()
    return True


def as_cudagraph_mode(mode: Any) -> CUDAGraphMode:
    """Accept a ``CUDAGraphMode`` or its name (``"FULL_AND_PIECEWISE"``); anything else raises."""
    if isinstance(mode, CUDAGraphMode):
        return mode
    if isinstance(mode, str) and mode.upper() in CUDAGraphMode.__members__:
        return CUDAGraphMode[mode.upper()]
    raise ValueError(
        f"invalid cudagraph_mode {mode!r}; expected a CUDAGraphMode or one of "
        f"{list(CUDAGraphMode.__members__)}"
    )


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class CudagraphDispatcher:
    """Maps a step's ``(num_tokens, uniform_decode, has_lora)`` to a runtime mode and graph key.

    ``engine_config`` is read by attribute: ``compilation_config`` (``cudagraph_mode``,
    ``cudagraph_capture_sizes``, ``max_cudagraph_capture_size``, ``bs_to_padded_graph_size``,
    ``cudagraph_specialize_lora``, ``is_attention_compiled_piecewise()``),
    ``scheduler_config.max_num_seqs``, ``speculative_config`` and ``lora_config`` (both may be
    absent/None). Until :meth:`initialize_cudagraph_keys` runs, :meth:`dispatch` returns NONE.
    """

    def __init__(self, engine_config: Any) -> None:
        self.engine_config = engine_config
        self.compilation_config = engine_config.compilation_config
        self.cudagraph_mode: CUDAGraphMode = as_cudagraph_mode(self.compilation_config.cudagraph_mode)
        self.cudagraph_keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.PIECEWISE: set(),
            CUDAGraphMode.FULL: set(),
        }
        self.keys_initialized = False
        spec = getattr(engine_config, "speculative_config", None)
        num_spec = 0 if spec is None else int(getattr(spec, "num_speculative_tokens", 0) or 0)
        self.uniform_decode_query_len = 1 + num_spec

        if self.cudagraph_mode.requires_piecewise_compilation():
            assert self.compilation_config.is_attention_compiled_piecewise(), (
                _PIECEWISE_ASSERT + f"cudagraph_mode={self.cudagraph_mode}, "
                f"compilation_mode={getattr(self.compilation_config, 'mode', None)}, "
                f"splitting_ops={getattr(self.compilation_config, 'splitting_ops', None)}"
            )
        platform = getattr(engine_config, "platform", None) or current_platform
        if not cudagraphs_available(platform):
            logger.info_once(
                "CUDA graphs are off: platform %s cannot capture them on this machine; steps "
                "run eagerly (runtime mode NONE).",
                getattr(platform, "name", "?"),
            )

    # ---- configuration reads (done per call: sizes may be adjusted after construction) ----
    @property
    def max_num_seqs(self) -> int:
        """``scheduler_config.max_num_seqs``."""
        return int(self.engine_config.scheduler_config.max_num_seqs)

    def _capture_sizes(self) -> list[int]:
        return sorted(self.compilation_config.cudagraph_capture_sizes or [])

    def _max_capture_size(self) -> int:
        return int(self.compilation_config.max_cudagraph_capture_size or 0)

    def _lora_cases(self) -> list[bool]:
        if getattr(self.engine_config, "lora_config", None) is None:
            return [False]
        if getattr(self.compilation_config, "cudagraph_specialize_lora", True):
            return [True, False]
        return [True]  # as in vLLM: without specialisation every graph includes the LoRA ops

    def _pad(self, num_tokens: int) -> int:
        """``bs_to_padded_graph_size[num_tokens]`` (computed from the sizes if the table is absent)."""
        table = getattr(self.compilation_config, "bs_to_padded_graph_size", None)
        if table is not None and 0 <= num_tokens < len(table):
            return int(table[num_tokens])
        sizes = self._capture_sizes()
        i = bisect.bisect_left(sizes, num_tokens)
        if num_tokens < 0 or i == len(sizes):
            raise IndexError(
                f"num_tokens={num_tokens} has no CUDA-graph padding; accepted range is "
                f"0..{self._max_capture_size()} (capture sizes {sizes})"
            )
        return 0 if num_tokens == 0 else sizes[i]

    # ---- keys ----
    def _create_padded_batch_descriptor(
        self, num_tokens: int, uniform_decode: bool, has_lora: bool
    ) -> BatchDescriptor:
        uq = self.uniform_decode_query_len
        padded = self._pad(num_tokens)
        if uniform_decode and self.cudagraph_mode.has_mode(CUDAGraphMode.FULL):
            assert padded % uq == 0, (
                f"padded token count {padded} (from num_tokens={num_tokens}) is not a multiple of "
                f"uniform_decode_query_len={uq}; capture sizes must be multiples of it"
            )
            return BatchDescriptor(padded, padded // uq, True, has_lora)
        return BatchDescriptor(padded, min(padded, self.max_num_seqs), False, has_lora)

    def add_cudagraph_key(self, runtime_mode: CUDAGraphMode, batch_descriptor: BatchDescriptor) -> None:
        """Register a graph key; ``runtime_mode`` must be PIECEWISE or FULL."""
        assert runtime_mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL), (
            f"Invalid cudagraph runtime mode for keys: {runtime_mode}"
        )
        self.cudagraph_keys[runtime_mode].add(batch_descriptor)

    def initialize_cudagraph_keys(
        self, cudagraph_mode: CUDAGraphMode | str, uniform_decode_query_len: int | None = None
    ) -> None:
        """Build the key sets for the resolved ``cudagraph_mode`` (call after backend resolution).

        ``uniform_decode_query_len`` defaults to ``1 + num_speculative_tokens`` from the config.
        Unlike vLLM (which pads with the config's value) a value passed here also replaces the one used for padding, so
        keys and dispatch can never disagree. Calling again rebuilds the keys from scratch.
        """
        mode = as_cudagraph_mode(cudagraph_mode)
        if uniform_decode_query_len is not None:
            self.uniform_decode_query_len = _positive_int(
                "uniform_decode_query_len", uniform_decode_query_len
            )
        self.cudagraph_mode = mode
        self.cudagraph_keys = {CUDAGraphMode.PIECEWISE: set(), CUDAGraphMode.FULL: set()}
        for runtime_mode, descs in self._key_groups():
            for desc in descs:
                self.add_cudagraph_key(runtime_mode, desc)
        self.keys_initialized = True

    def _key_groups(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """(runtime mode, descriptors) groups for the current mode, largest size first."""
        mode, uq = self.cudagraph_mode, self.uniform_decode_query_len
        sizes = list(reversed(self._capture_sizes()))
        lora_cases = self._lora_cases()
        groups: list[tuple[CUDAGraphMode, list[BatchDescriptor]]] = []
        if mode.mixed_mode() != CUDAGraphMode.NONE:
            descs = [BatchDescriptor(s, None, False, lora) for s in sizes for lora in lora_cases]
            groups.append((mode.mixed_mode(), descs))
        if mode.decode_mode() == CUDAGraphMode.FULL and mode.separate_routine():
            limit = uq * self.max_num_seqs
            descs = [
                BatchDescriptor(s, s // uq, True, lora)
                for s in sizes
                if uq <= s <= limit
                for lora in lora_cases
            ]
            groups.append((CUDAGraphMode.FULL, descs))
        return groups

    def get_capture_descs(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """What the runner should capture, in capture order.

        One group per runtime mode: the mixed-batch group first (relaxed descriptors, run with
        ``uniform_decode=False``), then the uniform-decode FULL group (``desc.uniform`` is True,
        ``desc.num_reqs`` requests of ``uniform_decode_query_len`` tokens). Within a group sizes
        go largest first, so smaller graphs reuse the pool blocks of larger ones; each size lists
        its LoRA cases ``True`` before ``False``. Empty before keys are initialised.
        """
        if not self.keys_initialized:
            return []
        return [(m, descs) for m, descs in self._key_groups() if descs]

    # ---- per step ----
    def dispatch(
        self,
        num_tokens: int,
        uniform_decode: bool = False,
        has_lora: bool = False,
        disable_full: bool = False,
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """Pick ``(runtime_mode, batch_descriptor)`` for a step of ``num_tokens`` tokens.

        NONE with the unpadded ``BatchDescriptor(num_tokens)`` when keys are not initialised,
        the mode is NONE, ``num_tokens`` exceeds the largest capture size, or no key matches.
        ``disable_full`` (cascade attention, encoder inputs, DP sync) skips FULL keys.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        if (
            not self.keys_initialized
            or self.cudagraph_mode == CUDAGraphMode.NONE
            or num_tokens > self._max_capture_size()
        ):
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)

        desc = self._create_padded_batch_descriptor(num_tokens, uniform_decode, has_lora)
        relaxed = desc.relax_for_mixed_batch_cudagraphs()
        if not disable_full:
            if desc in self.cudagraph_keys[CUDAGraphMode.FULL]:
                return CUDAGraphMode.FULL, desc
            if relaxed in self.cudagraph_keys[CUDAGraphMode.FULL]:
                return CUDAGraphMode.FULL, relaxed
        if relaxed in self.cudagraph_keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, relaxed
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)


# ---------------------------------------------------------------------------------------------
# Runner-side decision (vLLM: GPUModelRunner._determine_batch_execution_and_padding)
# ---------------------------------------------------------------------------------------------
class BatchExecution(NamedTuple):
    """How a step runs; unpacks like vLLM's 5-tuple."""

    cudagraph_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor
    should_ubatch: bool
    num_tokens_across_dp: torch.Tensor | None
    cudagraph_stats: CUDAGraphStat | None


def is_uniform_decode(
    max_num_scheduled_tokens: int,
    uniform_decode_query_len: int,
    num_tokens: int,
    num_reqs: int,
    force_uniform_decode: bool | None = None,
) -> bool:
    """Every request has exactly ``uniform_decode_query_len`` tokens (unless forced)."""
    if force_uniform_decode is not None:
        return bool(force_uniform_decode)
    return (
        max_num_scheduled_tokens == uniform_decode_query_len
        and num_tokens == max_num_scheduled_tokens * num_reqs
    )


def _sp_pad(engine_config: Any, num_tokens: int) -> tuple[int, int]:
    """Round up to a multiple of TP when sequence parallelism is on; returns (padded, tp)."""
    pass_config = getattr(engine_config.compilation_config, "pass_config", None)
    enable_sp = bool(getattr(pass_config, "enable_sp", False)) if pass_config is not None else False
    tp = int(getattr(engine_config.parallel_config, "tensor_parallel_size", 1) or 1)
    if enable_sp and tp > 1:
        return -(-num_tokens // tp) * tp, tp
    return num_tokens, 1


def _default_coordinate(**kwargs: Any) -> tuple[bool, torch.Tensor | None, int]:
    from forwardkit.distributed import coordinate_batch_across_dp  # step-state layer

    return coordinate_batch_across_dp(**kwargs)


def determine_batch_execution_and_padding(
    dispatcher: CudagraphDispatcher,
    num_tokens: int,
    num_reqs: int,
    num_scheduled_tokens: Sequence[int] | None,
    max_num_scheduled_tokens: int,
    *,
    use_cascade_attn: bool = False,
    allow_microbatching: bool = True,
    force_eager: bool = False,
    force_uniform_decode: bool | None = None,
    force_has_lora: bool | None = None,
    has_active_lora: bool = False,
    num_encoder_reqs: int = 0,
    coordinate_fn: Callable[..., tuple[bool, Any, int]] | None = None,
) -> BatchExecution:
    """Decide mode, padded descriptor, micro-batching and DP token counts for one step.

    ``has_active_lora`` is whether any LoRA adapter is active in the batch (the runner's
    input batch); ``force_*`` override the derived values (dummy runs). With
    ``data_parallel_size > 1`` the ranks agree through ``coordinate_fn`` (default
    ``forwardkit.distributed.coordinate_batch_across_dp``, a collective every rank must call),
    then re-dispatch at the agreed padded count with FULL disabled when any rank could not use
    FULL. A CUDAGraphStat is produced when
    ``observability_config.cudagraph_metrics`` is on.
    """
    cfg = dispatcher.engine_config
    uq = dispatcher.uniform_decode_query_len
    uniform_decode = is_uniform_decode(
        max_num_scheduled_tokens, uq, num_tokens, num_reqs, force_uniform_decode
    )
    model_config = getattr(cfg, "model_config", None)
    has_encoder_output = bool(getattr(model_config, "is_encoder_decoder", False)) and num_encoder_reqs > 0
    has_lora = has_active_lora if force_has_lora is None else bool(force_has_lora)
    num_tokens_padded, tp = _sp_pad(cfg, num_tokens)

    def dispatch(n: int, disable_full: bool) -> tuple[CUDAGraphMode, BatchDescriptor]:
        if force_eager:
            return CUDAGraphMode.NONE, BatchDescriptor(n)
        return dispatcher.dispatch(n, uniform_decode, has_lora, disable_full)

    mode, desc = dispatch(num_tokens_padded, use_cascade_attn or has_encoder_output)
    num_tokens_padded = desc.num_tokens
    assert num_tokens_padded % tp == 0, (
        f"padded token count {num_tokens_padded} is not a multiple of the TP size {tp} needed by "
        "sequence parallelism; make every capture size a multiple of it"
    )

    should_ubatch, num_tokens_across_dp = False, None
    parallel_config = cfg.parallel_config
    if int(getattr(parallel_config, "data_parallel_size", 1)) > 1:
        coordinate = coordinate_fn or _default_coordinate
        should_ubatch, num_tokens_across_dp, synced_mode = coordinate(
            num_tokens_unpadded=num_tokens,
            parallel_config=parallel_config,
            allow_microbatching=allow_microbatching,
            allow_dp_padding=dispatcher.compilation_config.cudagraph_mode != CUDAGraphMode.NONE,
            num_tokens_padded=num_tokens_padded,
            uniform_decode=uniform_decode,
            num_scheduled_tokens_per_request=num_scheduled_tokens,
            cudagraph_mode=mode.value,
        )
        if num_tokens_across_dp is not None:
            num_tokens_padded = int(num_tokens_across_dp[parallel_config.data_parallel_rank])
            mode, desc = dispatch(
                num_tokens_padded, synced_mode <= CUDAGraphMode.PIECEWISE.value
            )
            assert desc.num_tokens == num_tokens_padded, (
                f"re-dispatch after DP sync padded {num_tokens_padded} tokens to {desc.num_tokens}; "
                "the agreed per-rank token counts would be wrong"
            )

    stats = None
    observability = getattr(cfg, "observability_config", None)
    if observability is not None and getattr(observability, "cudagraph_metrics", False):
        stats = CUDAGraphStat(
            num_unpadded_tokens=num_tokens,
            num_padded_tokens=desc.num_tokens,
            num_paddings=desc.num_tokens - num_tokens,
            runtime_mode=str(mode),
        )
    return BatchExecution(mode, desc, should_ubatch, num_tokens_across_dp, stats)
