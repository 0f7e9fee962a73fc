"""Which CUDA graph (if any) serves a batch: ``CudagraphDispatcher`` (vLLM 0.14.0 semantics).

The dispatcher keeps one set of graph keys (``BatchDescriptor``) per runtime mode
(PIECEWISE, FULL). Per step it pads the token count to a capture size and picks FULL
for uniform-decode batches when full graphs exist, PIECEWISE for everything else when
piecewise graphs exist, and NONE (eager, unpadded) otherwise. The runner's step planner
(``forwardkit.runner.planner``) owns the per-step decision around it (DP agreement, forced
eager steps). The graph mode it serves is fixed once, by :meth:`initialize_cudagraph_keys`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.forward_context import BatchDescriptor
from forwardkit.logger import init_logger
from forwardkit.platforms import current_platform

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig

__all__ = ["CudagraphDispatcher", "cudagraphs_available"]

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
    return bool(platform.can_capture_graphs())


class CudagraphDispatcher:
    """Maps a step's ``(num_tokens, uniform_decode, has_lora)`` to a runtime mode and graph key.

    It reads ``engine_config.compilation_config`` (``cudagraph_mode``,
    ``cudagraph_capture_sizes``, ``max_cudagraph_capture_size``, ``bs_to_padded_graph_size``,
    ``cudagraph_specialize_lora``, ``is_attention_compiled_piecewise()``),
    ``scheduler_config.max_num_seqs``, ``speculative_config`` and ``lora_config`` (both may be
    None). Until :meth:`initialize_cudagraph_keys` runs, :meth:`dispatch` returns NONE
    and :attr:`cudagraph_mode` is NONE; that call fixes the mode for the dispatcher's life.
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        self.compilation_config = engine_config.compilation_config
        configured = CUDAGraphMode.parse(self.compilation_config.cudagraph_mode)
        self._cudagraph_mode = CUDAGraphMode.NONE
        self.cudagraph_keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.PIECEWISE: set(),
            CUDAGraphMode.FULL: set(),
        }
        self.keys_initialized = False
        self.uniform_decode_query_len = engine_config.uniform_decode_query_len

        if configured.requires_piecewise_compilation():
            assert self.compilation_config.is_attention_compiled_piecewise(), (
                _PIECEWISE_ASSERT + f"cudagraph_mode={configured}, "
                f"compilation_mode={self.compilation_config.mode}, "
                f"splitting_ops={self.compilation_config.splitting_ops}"
            )

    @property
    def cudagraph_mode(self) -> CUDAGraphMode:
        """The graph mode the keys were built for (NONE before :meth:`initialize_cudagraph_keys`)."""
        return self._cudagraph_mode

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
        if self.engine_config.lora_config is None:
            return [False]
        if self.compilation_config.cudagraph_specialize_lora:
            return [True, False]
        return [True]  # as in vLLM: without specialisation every graph includes the LoRA ops

    def _pad(self, num_tokens: int) -> int:
        """The capture size ``num_tokens`` pads to: the config's one padding table
        (``EngineConfig.pad_for_cudagraph``)."""
        return int(self.engine_config.pad_for_cudagraph(num_tokens))

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

    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode | str | None = None) -> None:
        """Fix the served ``cudagraph_mode`` and build its key sets; allowed once.

        None = the engine config's ``served_cudagraph_mode`` (the mode is decided there). The
        uniform-decode query length is ``1 + num_speculative_tokens`` from the config, so keys
        and padding always use the same value. A second call raises ``RuntimeError``: the
        mode and keys are fixed for the dispatcher's life.
        """
        if cudagraph_mode is None:
            cudagraph_mode = self.engine_config.served_cudagraph_mode
        mode = CUDAGraphMode.parse(cudagraph_mode)
        if self.keys_initialized:
            raise RuntimeError(
                f"initialize_cudagraph_keys({mode}) called again: the keys were built for "
                f"{self._cudagraph_mode} and the graph mode is fixed once at start-up"
            )
        self._cudagraph_mode = mode
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
