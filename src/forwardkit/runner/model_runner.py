"""``ModelRunner``: one forward step = inputs -> plan (padding, DP agreement, graph mode) ->
attention metadata -> forward context -> model -> last-token logits.

The model is whatever ``forwardkit.models.loader.load_model`` returns (eager, or with its
inner module compiled by ``support_torch_compile``). CUDA graphs: for modes with piecewise
graphs the runner hands the compiled model a factory (``set_piece_wrapper``) that wraps every
compiled piece in a PIECEWISE ``CUDAGraphWrapper``; for modes with full graphs it wraps the
whole model in a FULL one. All wrappers share one ``GraphBackend`` and so one graph pool.
Per step the runner only sets the forward context; the wrappers act on it.

On the CPU the runner holds the model's ``CpuLinearRouter`` (``cpu_linear_router``, made by the
loader) and binds it around every step (``execute``, ``dummy_run``): the ``forwardkit::linear``
op of the compiled graph finds it there at run time.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol, TypeVar, cast

import torch
import torch.nn as nn

from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.config.engine import EngineConfig, set_current_engine_config
from forwardkit.cudagraph import monitor
from forwardkit.cudagraph.dispatcher import CudagraphDispatcher
from forwardkit.cudagraph.ubatch_graphs import MICROBATCHED_FULL, UBatchGraphs
from forwardkit.cudagraph.wrapper import CUDAGraphWrapper, GraphBackend, piecewise_cudagraph_options
from forwardkit.forward_context import (
    AttnMetadataDict,
    BatchDescriptor,
    StepAttentionMetadata,
    set_forward_context,
)
from forwardkit.kernels.cpu.router import CpuLinearRouter, attached_router, bind
from forwardkit.layers.attention_backend import AttentionBackend, AttentionCGSupport
from forwardkit.layers.kv_cache import (
    attention_backend_of,
    attention_layers,
    bind_kv_cache,
    kv_cache_bytes_per_block,
)
from forwardkit.layers.lora import LoRASlots, LoRAStepPlan, attach_lora_slots, bind_plan
from forwardkit.logger import init_logger
from forwardkit.microbatching.slices import UBatchSlices
from forwardkit.runner.batch import StepBatch
from forwardkit.runner.input_buffers import InputBuffers, int64_tensor
from forwardkit.runner.microbatched import MicrobatchedForward
from forwardkit.runner.planner import StepPlan, StepPlanner
from forwardkit.runner.setup import num_kv_blocks
from forwardkit.runner.static_metadata import StaticMetadataPool

__all__ = ["ModelRunner", "StepInfo", "StepModel"]

_F = TypeVar("_F", bound=Callable[..., Any])

logger = init_logger(__name__)

# Tokens of a CPU start-up dummy step per compile range (see ``warm_up_compile_ranges``).
_CPU_WARMUP_TOKENS = 2


class StepModel(Protocol):
    """What the runner calls on its model (a ``*ForCausalLM``, or the FULL-graph wrapper
    around one): the forward over a step's tokens and the LM head over selected rows."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...


class StepInfo:
    """How the last step ran: runtime mode, descriptor, real and padded tokens, DP counts."""

    def __init__(self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_tokens: int,
                 num_tokens_across_dp: torch.Tensor | None,
                 ubatch_slices: UBatchSlices | None = None) -> None:
        self.mode = mode
        self.descriptor = descriptor
        self.num_tokens = num_tokens
        self.num_padded_tokens = descriptor.num_tokens
        self.num_tokens_across_dp = num_tokens_across_dp
        # the padded micro-batch slices when the step was micro-batched (DBO), else None
        self.ubatch_slices = ubatch_slices

    def __repr__(self) -> str:
        return (f"StepInfo(mode={self.mode}, tokens={self.num_tokens}, "
                f"padded={self.num_padded_tokens}, across_dp={self.num_tokens_across_dp}, "
                f"ubatches={None if self.ubatch_slices is None else len(self.ubatch_slices)})")


def _router_bound(method: _F) -> _F:
    """Run ``method`` with the runner's ``CpuLinearRouter`` bound (the op reads it per call)."""

    @functools.wraps(method)
    def wrapper(self: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        with bind(self.cpu_linear_router):
            return method(self, *args, **kwargs)

    return cast(_F, wrapper)



def unfold_decodes(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   max_query_len: int) -> tuple[list[int], list[int], list[list[int]]]:
    """Requests of ``2 .. max_query_len`` tokens (speculative decoding's last token and drafts)
    as that many one-token requests: token ``j`` of a request of ``q`` tokens and sequence
    length ``s`` becomes a request of sequence length ``s - q + 1 + j`` with the same blocks,
    so it attends to its prefix and the tokens before it, and writes its K/V to the same slot.
    A backend that stores every row's K/V before any row attends (``UNIFORM_BATCH`` support)
    computes the same attention; a uniform decode step then has one request per token, which
    keeps FULL-graph metadata at fixed shapes and lets decode kernels serve the drafts. The
    lists are returned as they are when ``max_query_len`` is 1 or no request qualifies."""
    if max_query_len <= 1 or all(q == 1 or q > max_query_len for q in query_lens):
        return query_lens, seq_lens, block_tables
    qs: list[int] = []
    ss: list[int] = []
    bs: list[list[int]] = []
    for q, s, b in zip(query_lens, seq_lens, block_tables):
        if 1 < q <= max_query_len:
            qs.extend([1] * q)
            ss.extend(range(s - q + 1, s + 1))
            bs.extend([b] * q)
        else:
            qs.append(q)
            ss.append(s)
            bs.append(b)
    return qs, ss, bs

class ModelRunner:
    """Owns the model, its KV cache and static inputs; runs steps given a :class:`StepBatch`.

    Args:
        engine_config: the engine's config; its run-time compile state
            (``compilation_config.compile_state``, exposed as :attr:`compile_state`) is where
            the model's layers register.
        model: an already built model (built under ``set_current_engine_config(engine_config)``);
            None = ``load_model(engine_config)``.
        device: where to run; default the platform's device.
    """

    def __init__(self, engine_config: EngineConfig, model: nn.Module | None = None,
                 device: torch.device | str | None = None) -> None:
        self.engine_config = cfg = engine_config
        self.device = torch.device(device) if device is not None else cfg.platform.device()
        # the graph mode to serve: decided by the config (read before the model is built, so
        # a mode the device or the attention backend cannot serve fails fast)
        self._served_mode = self._served_graph_mode()
        self.compilation_config = cfg.compilation_config
        # The run-time compile state of this engine config (layers registered by the model
        # build, custom-op counters, traced files, compile time, per-rank cache dir); the
        # model build and the compile backend write it, the runner reads its layers.
        self.compile_state = cfg.compilation_config.compile_state
        self.parallel_config = cfg.parallel_config
        self.dp_size = int(self.parallel_config.data_parallel_size)
        self.dp_rank = int(self.parallel_config.data_parallel_rank)
        self.model_config = cfg.require_model_config()
        prefetch = None
        if model is None:
            from forwardkit.models.loader import load_model  # model layer, loaded lazily

            if cfg.compiles_model:
                from forwardkit.compilation.cache import prepare_compile_cache
                from forwardkit.compilation.compiler import prefetch_compiler_imports

                # a cache_dir that cannot be used fails now, naming the field, not at the
                # first compile after the weights are loaded
                prepare_compile_cache(self.compilation_config)
                prefetch = prefetch_compiler_imports()  # overlaps the weight loading
            try:
                with set_current_engine_config(cfg):
                    model = load_model(cfg)
            finally:
                if prefetch is not None:
                    prefetch.join()
        # the model as an nn.Module (never wrapped): weights, submodules, parameters
        self.module: nn.Module = self._place(model)
        # the model's CPU linear state (routed weights, packed copies, queued huge pages):
        # bound around every step; None when no layer calls the op or not on the CPU
        self.cpu_linear_router: CpuLinearRouter | None = attached_router(self.module)
        # what a step calls: the module, or the FULL CUDAGraphWrapper around it
        self.model: StepModel = cast(StepModel, self.module)
        self.dtype: torch.dtype = self.model_config.dtype
        self.vocab_size = self.model_config.get_vocab_size()
        self.max_model_len = self.model_config.get_max_model_len()
        self.block_size = int(cfg.cache_config.block_size)
        self.max_num_seqs = int(cfg.scheduler_config.max_num_seqs)
        self._init_kv_cache()
        max_capture = self.compilation_config.max_cudagraph_capture_size or 0
        self.max_num_tokens = max(int(cfg.scheduler_config.max_num_batched_tokens), max_capture)
        self.buffers = InputBuffers(self.max_num_tokens, self.device)
        self._init_lora()
        self._init_cudagraphs()
        self.last_step: StepInfo | None = None
        # Set by the engine for steps that need more than last-token logits (prompt logprobs).
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self.capture_stats: dict[str, Any] = {}
        self._served = False  # set by the first real step
        # Set once the model has run a forward: its first call traces and compiles it, which
        # must not happen in a micro-batch (the sibling would call it mid-trace).
        self._model_ran = False

    # ------------------------------------------------------------------ start-up
    def _place(self, model: nn.Module) -> nn.Module:
        param = next(model.parameters(), None)
        if param is not None and param.device != self.device:
            model = model.to(self.device)
        return model.eval()

    def _init_kv_cache(self) -> None:
        sfc = self.compile_state.static_forward_context
        layers = attention_layers(sfc)
        if not layers:
            raise ValueError(
                "the model registered no attention layers in this engine config's "
                "static_forward_context; build it under set_current_engine_config(engine_config)"
            )
        self.attn_layer_names = list(layers)
        # The attention backend every layer was built with: it builds the step metadata. The
        # engine config selected it and decided the graph mode from its support level.
        self.attn_backend: type[AttentionBackend] = attention_backend_of(layers)
        self.attn_cg_support: AttentionCGSupport = self.attn_backend.cudagraph_support
        # Speculative decoding: a decoding request of up to 1 + k tokens is handed to a backend
        # that supports uniform batches as 1 + k one-token requests (see unfold_decodes).
        q = self.engine_config.uniform_decode_query_len
        self.unfold_query_len = (q if q > 1 and self.attn_cg_support
                                 >= AttentionCGSupport.UNIFORM_BATCH else 1)
        self._check_attention_backend()
        self.num_blocks = num_kv_blocks(
            num_gpu_blocks=self.engine_config.cache_config.num_gpu_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            bytes_per_block=kv_cache_bytes_per_block(sfc, self.block_size, self.dtype),
            device=self.device,
        )
        self.kv_caches = bind_kv_cache(sfc, self.num_blocks, self.block_size, self.dtype, self.device)
        # Block id num_blocks is the backend's scratch block: dummy requests live there.
        self.scratch_block = self.num_blocks
        self.max_blocks_per_req = math.ceil(self.max_model_len / self.block_size)

    def _init_lora(self) -> None:
        """With a LoRA config: every adaptable projection gets its slot buffers before the
        model is compiled (the LoRA op is part of every graph) and the shared per-token slot
        buffer (:attr:`lora_token_slots`); None and empty otherwise."""
        lora = self.engine_config.lora_config
        self.lora_slots: dict[str, LoRASlots] = {}
        self.lora_token_slots: torch.Tensor | None = None
        self.lora_num_slots = 0
        if lora is None:
            return
        dtype = self.dtype if lora.lora_dtype == "auto" else getattr(torch, lora.lora_dtype)
        self.lora_num_slots = int(lora.max_loras)
        self.lora_token_slots, self.lora_slots = attach_lora_slots(
            self.module, self.lora_num_slots, int(lora.max_lora_rank), dtype, self.max_num_tokens)

    def _lora_step(self, batch: StepBatch, padded: int) -> LoRAStepPlan | None:
        """Write the step's per-token slots (``batch.lora_slots``, -1 on padding rows) into the
        shared buffer; the step's host plan (None without LoRA)."""
        buf = self.lora_token_slots
        if buf is None:
            return None
        per_req = batch.lora_slots or [-1] * batch.num_reqs
        tokens = [s for s, q in zip(per_req, batch.query_lens) for _ in range(q)]
        tokens += [-1] * (padded - len(tokens))
        buf[:padded].copy_(torch.tensor(tokens, dtype=torch.long))
        return LoRAStepPlan(tokens, self.lora_num_slots, self.lora_slots_dtype, buf.device)

    @property
    def lora_slots_dtype(self) -> torch.dtype:
        """dtype of the LoRA slot buffers (the model's when there are none)."""
        first = next(iter(self.lora_slots.values()), None)
        return self.dtype if first is None else first.a.dtype

    def _served_graph_mode(self) -> CUDAGraphMode:
        """The engine config's ``served_cudagraph_mode``; a ``ValueError`` when it has graphs
        and this runner's device is not the config platform's (the config decided for that)."""
        cfg = self.engine_config
        mode = cfg.served_cudagraph_mode
        if mode != CUDAGraphMode.NONE and self.device.type != cfg.platform.device_type:
            raise ValueError(
                f"the engine config serves CUDA graphs (mode {mode.name}) on platform "
                f"{cfg.platform.name!r}, but this runner's device is {self.device}; run on the "
                f"platform's device or build the config for platform {self.device.type!r}"
            )
        return mode

    def _check_attention_backend(self) -> None:
        """The layers must use the backend the engine config selected: its support level is
        what the config's graph-mode decision assumed. A ``ValueError`` otherwise."""
        selected = self.engine_config.attention_backend
        if self.attn_backend.name != selected:
            raise ValueError(
                f"the model's attention layers use backend {self.attn_backend.name!r} but the "
                f"engine config selected {selected!r} (EngineConfig.attention_backend), whose "
                "CUDA-graph support decides the graph mode; build the model under "
                "set_current_engine_config(engine_config) without a backend override, or "
                f"build the config with attention_backend={self.attn_backend.name!r}"
            )

    def _init_cudagraphs(self) -> None:
        """Build the step planner for the config's served graph mode and install the graph
        wrappers."""
        mode = self._served_mode
        self.planner = StepPlanner(self.engine_config, mode)
        self.static_metadata = StaticMetadataPool()
        # One backend for every wrapper: one graph memory pool for FULL and PIECEWISE captures.
        self.graph_backend = GraphBackend()
        self.piece_wrappers: list[CUDAGraphWrapper] = []
        if mode.has_piecewise_cudagraphs():
            # NOTE: imported here: the compile backend pulls in Inductor, which an eager
            # engine (and ``from forwardkit import LLM``) never needs.
            from forwardkit.compilation.backend import set_piece_wrapper

            compiled = set_piece_wrapper(self.module, self._wrap_piece)
            if compiled == 0:
                logger.warning("cudagraph_mode %s: the model has no compiled submodule, so no "
                               "piecewise graphs will be captured", mode)
        if mode.has_full_cudagraphs():
            self.model = CUDAGraphWrapper(self.model, self.engine_config, CUDAGraphMode.FULL,
                                          graph_backend=self.graph_backend)
        # Micro-batched FULL graphs (both micro-batches of a DBO step in one graph) when
        # micro-batching is configured and the mode has FULL graphs; None otherwise.
        self.ubatch_graphs: UBatchGraphs | None = None
        if mode.has_full_cudagraphs() and self.parallel_config.use_ubatching:
            self.ubatch_graphs = UBatchGraphs(self.graph_backend)
        # the forward of steps the planner micro-batches (runner/microbatched.py)
        self.microbatched = MicrobatchedForward(
            self.engine_config, self.attn_backend, self.attn_layer_names, self.block_size,
            self.device, self.dp_size, self.ubatch_graphs, self._full_metadata,
            lambda q, s, b: unfold_decodes(q, s, b, self.unfold_query_len))

    def _wrap_piece(self, piece: Callable[..., Any], index: int, num_pieces: int) -> CUDAGraphWrapper:
        """The piece-wrapper factory handed to the compilation backend (one wrapper per piece)."""
        wrapper = CUDAGraphWrapper(piece, self.engine_config, CUDAGraphMode.PIECEWISE,
                                   piecewise_cudagraph_options(index, num_pieces),
                                   graph_backend=self.graph_backend)
        self.piece_wrappers.append(wrapper)
        return wrapper

    @property
    def cudagraph_mode(self) -> CUDAGraphMode:
        """The graph mode resolved at start-up (read-only; the planner owns it)."""
        return self.planner.cudagraph_mode

    @property
    def dispatcher(self) -> CudagraphDispatcher:
        """The planner's ``CudagraphDispatcher`` (graph keys)."""
        return self.planner.dispatcher

    # ------------------------------------------------------------------ one step
    @_router_bound
    @torch.inference_mode()
    def execute(self, batch: StepBatch, pad_to: int | None = None) -> torch.Tensor:
        """Run one step; return float32 logits ``[num sampled requests, vocab]``.

        Rows follow batch order over the requests whose ``batch.sample`` is True. An empty
        batch runs a dummy step when DP > 1 (collectives stay in lockstep) and returns no rows.
        ``pad_to`` forces an eager step padded to at least that many tokens (padding must
        never change results; tests use it to check that).
        """
        if batch.num_reqs == 0:
            if self.dp_size > 1:
                self.dummy_run(1, uniform_decode=True)
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        n = batch.num_tokens
        self.buffers.check_fits(n)
        if pad_to is not None and pad_to > self.max_num_tokens:
            raise ValueError(f"pad_to={pad_to} exceeds the input buffers "
                             f"({self.max_num_tokens} tokens)")
        # without cudagraph_specialize_lora every graph has the LoRA ops: every step keys them
        has_lora = self.lora_token_slots is not None and (
            batch.has_lora or not self.compilation_config.cudagraph_specialize_lora)
        plan = self.planner.plan(n, batch.num_reqs, batch.query_lens, batch.max_query_len,
                                 pad_to=pad_to, allow_microbatching=self._model_ran,
                                 has_lora=has_lora)
        mode, desc, across_dp = plan.cudagraph_mode, plan.batch_descriptor, plan.num_tokens_across_dp
        padded = desc.num_tokens
        self.buffers.check_fits(padded)
        input_ids, positions = self.buffers.fill(batch, padded)
        lora_plan = self._lora_step(batch, padded)
        if mode != CUDAGraphMode.NONE:
            lora_plan = None  # graphs replay what their capture recorded: no host plan
        with bind_plan(lora_plan):
            return self._run_step(batch, plan, mode, desc, across_dp, padded, input_ids, positions)

    def _run_step(self, batch: StepBatch, plan: StepPlan, mode: CUDAGraphMode,
                  desc: BatchDescriptor, across_dp: torch.Tensor | None, padded: int,
                  input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The forward of a planned step and its last-token logits."""
        n = batch.num_tokens
        slices = None
        if plan.should_ubatch:  # every DP rank agreed: dual-batch overlap
            hidden, slices = self.microbatched.run(self.model, batch.query_lens, batch.seq_lens,
                                                   batch.block_tables, input_ids, positions,
                                                   mode, desc, across_dp)
        else:
            attn_md = self._metadata(batch.query_lens, batch.seq_lens, batch.block_tables,
                                     padded, mode)
            with set_forward_context(attn_md, self.engine_config, num_tokens=padded,
                                     num_tokens_across_dp=across_dp, cudagraph_runtime_mode=mode,
                                     batch_descriptor=desc):
                hidden = self.model(input_ids, positions)
        self._model_ran = True
        self.last_step = StepInfo(mode, desc, n, across_dp, slices)
        self.last_hidden = hidden if self.keep_hidden else None
        if not self._served:  # start-up is over: what is not on huge pages yet moves from now on
            self._served = True
            if self.cpu_linear_router is not None:
                self.cpu_linear_router.huge_pages.start()
        rows = batch.logits_indices()
        if len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1:
            selected = hidden  # every row is a sampled last token (unpadded decode step)
        else:
            selected = hidden.index_select(0, int64_tensor(rows).to(hidden.device))
        return self.model.compute_logits(selected).float()

    def _metadata(self, query_lens: list[int], seq_lens: list[int],
                  block_tables: list[list[int]], padded: int, mode: CUDAGraphMode) -> AttnMetadataDict:
        """Per-layer attention metadata for a step padded to ``padded`` tokens.

        FULL graphs need fixed shapes: every padding row becomes a one-token dummy request
        on the scratch block and the block table has the model's full width; the values go
        into persistent tensors (``StaticMetadataPool``).
        """
        query_lens, seq_lens, block_tables = unfold_decodes(query_lens, seq_lens, block_tables,
                                                            self.unfold_query_len)
        if mode == CUDAGraphMode.FULL:
            md = self._full_metadata(query_lens, seq_lens, block_tables, padded, key=padded)
        else:
            md = self.attn_backend.build_metadata(query_lens, seq_lens, block_tables, padded,
                                                  self.block_size, self.device)
        return dict.fromkeys(self.attn_layer_names, md)

    def _full_metadata(self, query_lens: list[int], seq_lens: list[int],
                       block_tables: list[list[int]], padded: int, key: Hashable) -> StepAttentionMetadata:
        """Fixed-shape metadata of ``padded`` tokens kept in the persistent tensors of ``key``
        (a padded size, or (padded size, micro-batch index) for micro-batched graphs)."""
        extra = padded - sum(query_lens)
        query_lens = list(query_lens) + [1] * extra
        seq_lens = list(seq_lens) + [1] * extra
        block_tables = list(block_tables) + [[self.scratch_block]] * extra
        md = self.attn_backend.build_metadata(query_lens, seq_lens, block_tables, padded,
                                              self.block_size, self.device,
                                              self.max_blocks_per_req)
        return self.static_metadata.update(key, md)

    # ------------------------------------------------------------------ dummy runs, capture
    def _dummy_shapes(self, num_tokens: int, uniform_decode: bool) -> list[int]:
        """Per-request token counts of a dummy batch (decode query length 1)."""
        if uniform_decode:
            return [1] * min(self.max_num_seqs, num_tokens)
        reqs = min(num_tokens, self.max_num_seqs)
        lens = [num_tokens // reqs] * reqs
        lens[-1] += num_tokens - sum(lens)
        return lens

    @_router_bound
    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, runtime_mode: CUDAGraphMode | None = None,
                  uniform_decode: bool = False, force_attention: bool = False,
                  allow_microbatching: bool = False, has_lora: bool = False) -> None:
        """Run a batch of ``num_tokens`` zero tokens: warm-up, capture, or an idle DP rank.

        Goes through the same dispatch and DP coordination as ``execute``. Attention
        metadata is built only when ``force_attention`` or the mode is FULL (dummy requests
        on the scratch block); otherwise attention layers get None and output zeros.
        ``allow_microbatching`` lets this rank vote for micro-batching (capturing micro-batched
        graphs); by default its vote keeps every rank off it. ``has_lora``: the step's
        descriptor key (captures of the graphs with LoRA work).
        """
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"dummy run of {num_tokens} tokens exceeds max_num_tokens "
                             f"{self.max_num_tokens}")
        lens = self._dummy_shapes(num_tokens, uniform_decode)
        plan = self.planner.plan(num_tokens, len(lens), lens, max(lens),
                                 force_eager=runtime_mode == CUDAGraphMode.NONE,
                                 force_uniform_decode=uniform_decode,
                                 allow_microbatching=allow_microbatching and self._model_ran,
                                 has_lora=has_lora and self.lora_token_slots is not None)
        mode, desc, across_dp = plan.cudagraph_mode, plan.batch_descriptor, plan.num_tokens_across_dp
        if runtime_mode is not None:
            assert mode == runtime_mode, (
                f"Cudagraph runtime mode mismatch in dummy_run: requested {runtime_mode}, "
                f"dispatched {mode} for {num_tokens} tokens"
            )
        padded = desc.num_tokens
        input_ids, positions = self.buffers.dummy(padded)
        slices = None
        if plan.should_ubatch:
            _, slices = self.microbatched.run(self.model, lens, lens, self._scratch_tables(lens),
                                              input_ids, positions, mode, desc, across_dp)
        else:
            attn_md = None
            if force_attention or mode == CUDAGraphMode.FULL:
                attn_md = self._metadata(lens, lens, self._scratch_tables(lens), padded, mode)
            with set_forward_context(attn_md, self.engine_config, num_tokens=padded,
                                     num_tokens_across_dp=across_dp, cudagraph_runtime_mode=mode,
                                     batch_descriptor=desc):
                self.model(input_ids, positions)
        self._model_ran = True
        self.last_step = StepInfo(mode, desc, 0, across_dp, slices)

    def _scratch_tables(self, query_lens: list[int]) -> list[list[int]]:
        """Block tables of dummy requests: every block is the scratch block."""
        return [[self.scratch_block] * math.ceil(q / self.block_size) for q in query_lens]

    def warm_up_compile_ranges(self) -> list[int]:
        """Compile at start-up instead of on the first real step (vLLM's profile run): one
        eager dummy step per compile range, largest first (at the top of the range on a GPU,
        a small size inside it on a CPU).

        A no-op for eager models (mode NONE or ``enforce_eager``). Returns the sizes run.
        """
        if not self.engine_config.compiles_model:
            return []
        ranges = self.compilation_config.get_compile_ranges() or []
        if self.device.type == "cpu":
            # NOTE: any size inside a range compiles that range's piece (the token dimension is
            # dynamic); on a CPU a max-size dummy step of a 1B model costs seconds, so a small
            # one is run instead (2 tokens: not the 0/1 sizes Dynamo specialises, and few
            # enough rows that no bf16 weight gets packed before a batch needs it). On a GPU
            # the top of the range also sizes peak activations.
            # With sequence parallelism the graph holds tokens / TP rows: the trace and each
            # range's compile must see >= 2 of them, or the size-1 case is specialised.
            floor = _CPU_WARMUP_TOKENS * self.engine_config.sequence_parallel_multiple
            sizes = sorted({min(int(r.end), self.max_num_tokens, max(int(r.start), floor))
                            for r in ranges} or {1}, reverse=True)
        else:
            sizes = sorted({min(int(r.end), self.max_num_tokens) for r in ranges} or {1}, reverse=True)
        for size in sizes:
            self.dummy_run(size, CUDAGraphMode.NONE)
        return sizes

    def warm_up_compile_sizes(self) -> list[int]:
        """Run one eager dummy step per ``compile_sizes`` entry that is not a capture size,
        largest first, so those specialised compiles happen at start-up.

        Returns the sizes run.
        """
        if not self.engine_config.compiles_model:
            return []
        capture = set(self.compilation_config.cudagraph_capture_sizes or [])
        sizes = [s for s in (self.compilation_config.compile_sizes or [])
                 if isinstance(s, int) and s not in capture and s <= self.max_num_tokens]
        for size in sorted(set(sizes), reverse=True):
            self.dummy_run(size, CUDAGraphMode.NONE)
        return sorted(set(sizes), reverse=True)

    def capture_model(self) -> float:
        """Capture every CUDA graph the planner has keys for; returns seconds.

        A no-op (with a log line) when graphs are off. Mixed-batch sizes first, then the
        uniform-decode FULL sizes, largest first within each group. Afterwards
        :attr:`capture_stats` holds the graphs captured per runtime mode, the seconds taken
        and, on a GPU, the device memory the graphs took; one INFO line reports them.
        """
        if self.cudagraph_mode == CUDAGraphMode.NONE:
            logger.info_once("Skipping CUDA graph capture: cudagraph mode is NONE.")
            return 0.0
        start = time.perf_counter()
        before = dict(self.graph_backend.captured)
        free_before = self._free_device_memory()
        warmups = self.compilation_config.cudagraph_num_of_warmups
        keys: dict[str, int] = {}
        with monitor.capture_session():
            for mode, descs in self.planner.capture_descs():
                keys[mode.name] = keys.get(mode.name, 0) + len(descs)
                for desc in descs:
                    for _ in range(warmups):
                        self.dummy_run(desc.num_tokens, CUDAGraphMode.NONE, desc.uniform,
                                       force_attention=mode == CUDAGraphMode.FULL,
                                       has_lora=desc.has_lora)
                    self.dummy_run(desc.num_tokens, mode, desc.uniform, has_lora=desc.has_lora)
            for desc in (self.planner.microbatched_capture_descs() if self.ubatch_graphs is not None else []):
                keys[MICROBATCHED_FULL] = keys.get(MICROBATCHED_FULL, 0) + 1
                for _ in range(warmups):  # eager micro-batched steps of the same shape
                    self.dummy_run(desc.num_tokens, CUDAGraphMode.NONE, True,
                                   force_attention=True, allow_microbatching=True)
                self.dummy_run(desc.num_tokens, CUDAGraphMode.FULL, True, allow_microbatching=True)
                step = self.last_step
                assert step is not None and step.ubatch_slices is not None, (
                    f"the micro-batched capture of {desc.num_tokens} tokens was not micro-batched: "
                    "the DP ranks disagreed about micro-batching a start-up capture size"
                )
        sync = self.engine_config.platform.synchronize
        if sync is not None:
            sync()
        elapsed = time.perf_counter() - start
        free_after = self._free_device_memory()
        graph_bytes = None if free_before is None or free_after is None else free_before - free_after
        captured = {m: n - before.get(m, 0) for m, n in self.graph_backend.captured.items()
                    if n - before.get(m, 0) > 0}
        self.capture_stats = {"mode": self.cudagraph_mode.name, "keys": keys, "graphs": captured,
                              "seconds": elapsed, "graph_memory_bytes": graph_bytes}
        memory = "" if graph_bytes is None else f", took {graph_bytes / 2**30:.2f} GiB"
        logger.info("Graph capturing finished in %.0f secs%s", elapsed, memory)
        logger.info("cudagraph_mode %s: captured %s (graph keys per runtime mode: %s; %d "
                    "compiled pieces wrapped)", self.cudagraph_mode.name,
                    ", ".join(f"{n} {m} graphs" for m, n in sorted(captured.items())) or "nothing",
                    keys, len(self.piece_wrappers))
        return elapsed

    def _free_device_memory(self) -> int | None:
        """Free device memory in bytes on a GPU; None elsewhere."""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.mem_get_info(self.device)[0])
