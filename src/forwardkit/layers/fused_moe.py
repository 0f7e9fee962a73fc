"""Mixture-of-experts layer with top-k softmax routing and data-parallel expert parallelism.

Routing follows HF Mixtral: ``softmax(router_logits)`` in float32, top-k, renormalised to sum
to one. The expert computation is the opaque custom op ``forwardkit::moe_forward(hidden,
router_logits, layer_name)`` which finds the layer (registered in ``static_forward_context``
under its prefix) through the forward context, so data-dependent routing and the DP
collectives stay out of compiled graphs.

Tensor parallelism without expert parallelism: every rank holds every expert with its slice
of the intermediate dimension (gate/up rows, down columns); the partial outputs are summed over
the TP group by the caller (the model's MoE block).

Expert parallelism (``enable_expert_parallel`` with ``data_parallel_size x
tensor_parallel_size > 1``): the experts are split over the EP group of all ``dp x tp`` ranks
(EP rank ``dp_rank * tp + tp_rank`` holds a contiguous slice; only that slice is loaded). With
DP 1 every TP rank sees the same tokens, computes its experts' share and the caller sums the
shares over TP. With DP > 1, each step, in chunks
of at most ``FORWARDKIT_MOE_DP_CHUNK_SIZE`` rows per rank (``DPMetadata.chunked_sizes``), every
rank all-gathers all ranks' rows, computes its experts' share for every gathered row,
and an all-reduce sums the shares; each rank keeps its own rows. Ranks that ran out of rows (or
run a dummy step) still take part with one dummy row per chunk, so collectives stay in lockstep.

Sequence-parallel MoE (``ParallelConfig.use_sequence_parallel_moe``: expert parallel with
TP > 1 and DP > 1 on the ``allgather_reducescatter`` or ``naive`` backend): the model's MoE
block pads the step's tokens to a multiple of TP and hands each TP rank its contiguous slice
(``forwardkit::sequence_parallel_chunk``); the layer then exchanges slices over the EP group of all
``dp x tp`` ranks with the sizes ``DPMetadata.sp_local_sizes(tp)`` gives (or
``chunked_sizes`` per chunk): all-gather-v of every rank's rows, this rank's experts on all of
them, reduce-scatter-v of the partial sums back to their owners (``naive``: an all-reduce into
one buffer at the offsets ``cu_tokens_across_sp``, then this rank's rows). The block gathers
the slices over TP afterwards. gloo has no uneven all-gather; it is built from a padded one.

Quantized experts (``model_config.quantization`` ``q8_0`` / ``q4_0`` / ``q4_1``): each expert's
gate/up and down weights are packed in the block format (``uint8`` ``[E_local, rows, k / 32 *
block_bytes]``, the bytes of :mod:`forwardkit.quantization.formats`) and every expert product
runs ``forwardkit::quant_linear`` (the native quantized kernels on the CPU) while the
``cpu_linear`` custom op is on (the native linear kernels' one switch), else
dequantize-then-``F.linear`` in plain torch. A checkpoint's
experts are loaded at full precision one layer at a time and packed as soon as the layer's
last expert tensor arrived (its float copy freed), so the model is never held at full
precision; seeded random weights are packed after the fill (:meth:`FusedMoE.quantize_weights`).
The hidden size and each rank's intermediate slice must be whole 32-weight blocks (refused by
name otherwise). Packed experts cannot be written in place (``update_weights`` refuses them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from forwardkit import envs
from forwardkit.config.engine import get_current_engine_config
from forwardkit.distributed import get_dp_group, get_ep_group
from forwardkit.forward_context import get_forward_context
from forwardkit.layers.kernels import silu_and_mul_native
from forwardkit.layers.linear import CpuLinearLayer, copy_weight
from forwardkit.layers.parallel import ShardSpec, divide, narrow, set_shard_spec, tp_rank_and_size
from forwardkit.microbatching.overlap import dbo_enabled, dbo_register_recv_hook, dbo_yield
from forwardkit.quantization.formats import BLOCK, BlockShapeError, get_format, quantize
from forwardkit.quantization.linear_method import QuantizedWeightReloadError
from forwardkit.quantization.ops import reference_linear

__all__ = ["FusedMoE", "expert_slice", "moe_forward", "route_topk"]


def expert_slice(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """``(first_expert, count)`` held by ``ep_rank``: contiguous, the remainder to the first ranks."""
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} out of range for ep_size {ep_size}")
    if num_experts < ep_size:
        raise ValueError(
            f"{num_experts} experts cannot be split over {ep_size} expert-parallel ranks "
            "(need at least one expert per rank)"
        )
    base, rem = divmod(num_experts, ep_size)
    return ep_rank * base + min(ep_rank, rem), base + (1 if ep_rank < rem else 0)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing: ``(weights [T, k] float32, expert_ids [T, k])``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """The experts of one MoE block (the router lives in the caller).

    Parameters: ``w13_weight`` [E_local, 2*I, H] (gate rows then up rows) and ``w2_weight``
    [E_local, H, I]; packed ``uint8`` blocks along the last dim once quantized (module doc).
    ``forward(hidden[T, H], router_logits[T, E]) -> [T, H]``.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool = True,
        dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..num_experts={num_experts}, got {top_k}")
        if not prefix:
            raise ValueError("FusedMoE needs a non-empty, unique prefix (its layer name)")
        config = get_current_engine_config()
        pc = config.parallel_config
        self.tp_rank, self.tp_size = tp_rank_and_size(pc.tensor_parallel_size)
        dp_size = pc.data_parallel_size
        self.use_ep = pc.enable_expert_parallel and dp_size * self.tp_size > 1
        self.ep_size = dp_size * self.tp_size if self.use_ep else 1
        self.ep_rank = pc.data_parallel_rank * self.tp_size + self.tp_rank if self.use_ep else 0
        # DP exchange of tokens (DP > 1 with EP); TP ranks of one replica hold the same tokens,
        # or with sequence-parallel MoE each its slice of them (exchanged over the EP group)
        self.is_sequence_parallel = pc.use_sequence_parallel_moe
        self.sp_size = self.tp_size if self.is_sequence_parallel else 1
        self.all2all_backend = pc.all2all_backend
        self.use_dp_exchange = self.use_ep and dp_size > 1
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.expert_start, self.num_local_experts = expert_slice(num_experts, self.ep_size, self.ep_rank)
        # without EP, TP splits each expert's intermediate dim
        self.inter_tp = 1 if self.use_ep else self.tp_size
        self.local_intermediate = divide(intermediate_size, self.inter_tp, "intermediate_size")
        self.inter_start = (0 if self.use_ep else self.tp_rank) * self.local_intermediate
        self.layer_name = prefix
        local_inter = self.local_intermediate
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * local_inter, hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, local_inter, dtype=dtype),
            requires_grad=False,
        )
        if self.ep_size > 1:
            experts = ((self.expert_start, 0, self.num_local_experts),)
            set_shard_spec(self.w13_weight, ShardSpec(0, num_experts, experts))
            set_shard_spec(self.w2_weight, ShardSpec(0, num_experts, experts))
        elif self.inter_tp > 1:
            start, inter = self.inter_start, intermediate_size
            set_shard_spec(self.w13_weight, ShardSpec(
                1, 2 * inter, ((start, 0, local_inter), (inter + start, local_inter, local_inter))))
            set_shard_spec(self.w2_weight, ShardSpec(2, inter, ((start, 0, local_inter),)))
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        mc = config.model_config
        self.quant_format: str | None = None if mc is None else mc.quantization
        if self.quant_format is not None:
            get_format(self.quant_format)
            for what, k in (("hidden_size", hidden_size), ("per-rank intermediate size", local_inter)):
                if k % BLOCK:
                    raise BlockShapeError(
                        f"cannot quantize the experts of {prefix} to {self.quant_format}: their "
                        f"{what} {k} is not a multiple of the {BLOCK}-weight block; run this "
                        "model without quantization")
        # packed experts run the quantized kernels exactly when the cpu_linear op is on
        self.quant_kernel = CpuLinearLayer.enabled()
        # expert tensors loaded so far (3 per local expert: w1, w3, w2); at the count the
        # layer's experts are packed and their float copies freed
        self._parts_loaded = 0
        context = config.compilation_config.compile_state.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    # -- loading ----------------------------------------------------------------------------
    def is_local_expert(self, expert_id: int) -> bool:
        """Whether global expert ``expert_id`` lives on this rank."""
        return self.expert_start <= expert_id < self.expert_start + self.num_local_experts

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        """Load expert weights. ``shard_id``: ``(expert_id, "w1"|"w3"|"w2")`` for one expert's
        HF tensor, or ``"w13"``/``"w2"`` for a stacked ``[E, ...]`` tensor of all experts.
        Experts of other EP ranks are skipped (not read), and under TP without EP only this
        rank's intermediate slice is read. With quantized experts the layer is packed once its
        last expert tensor is loaded."""
        if param.dtype == torch.uint8:
            raise QuantizedWeightReloadError(
                f"the experts of {self.layer_name} are quantized (packed shape "
                f"{tuple(param.shape)}); they cannot be written in place: load the model again")
        self._load_part(param, loaded, shard_id)
        if self.quant_format is None:
            return
        if shard_id in ("w13", "w2"):
            self._parts_loaded += self.num_local_experts * (2 if shard_id == "w13" else 1)
        elif self.is_local_expert(shard_id[0]):
            self._parts_loaded += 1
        if self._parts_loaded >= 3 * self.num_local_experts:
            self.quantize_weights()

    def quantize_weights(self) -> None:
        """Pack the experts' float weights in ``quant_format`` and free the float copies (a
        no-op when unquantized or packed already)."""
        fmt = self.quant_format
        if fmt is None or self.w13_weight.dtype == torch.uint8:
            return
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(self, name).data
            experts, rows, k = weight.shape
            packed = quantize(weight.reshape(experts * rows, k), fmt,
                              f"{self.layer_name}.{name}").reshape(experts, rows, -1)
            param = nn.Parameter(packed, requires_grad=False)
            param.quant_format = fmt  # type: ignore[attr-defined]
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            setattr(self, name, param)

    def local_packed(self, packed: torch.Tensor, kind: str, fmt: str) -> torch.Tensor:
        """This rank's part of a stacked packed expert tensor ``[E, rows, k / 32 * block
        bytes]`` of kind ``w1`` / ``w3`` (rows: the intermediate dim) or ``w2`` (blocks along
        the intermediate dim): its experts, and under TP without EP its intermediate slice
        (ValueError when that slice cuts a block)."""
        block_bytes = get_format(fmt).block_bytes
        mine = packed.narrow(0, self.expert_start, self.num_local_experts)
        if self.inter_tp == 1:
            return mine.contiguous()
        start, length = self.inter_start, self.local_intermediate
        if kind in ("w1", "w3"):
            return mine.narrow(1, start, length).contiguous()
        if start % BLOCK or length % BLOCK:
            raise ValueError(f"this rank's intermediate columns [{start}, {start + length}) cut a "
                             f"{BLOCK}-weight block; use a tensor_parallel_size that leaves a "
                             f"multiple of {BLOCK} per rank")
        return mine.narrow(2, start // BLOCK * block_bytes, length // BLOCK * block_bytes).contiguous()

    def install_packed(self, name: str, packed: torch.Tensor, fmt: str) -> None:
        """Set ``w13_weight`` / ``w2_weight`` to already packed blocks (a GGUF file's) of
        ``fmt``, shape ``[E_local, rows, k / 32 * block bytes]`` checked against the layer."""
        current = getattr(self, name)
        experts, rows, k = current.shape
        want = (experts, rows, k // BLOCK * get_format(fmt).block_bytes)
        if current.dtype == torch.uint8 or tuple(packed.shape) != want:
            raise ValueError(f"{self.layer_name}.{name}: packed {fmt} shape {tuple(packed.shape)}, "
                             f"expected {want} (from the float shape {(experts, rows, k)})")
        param = nn.Parameter(packed, requires_grad=False)
        param.quant_format = fmt  # type: ignore[attr-defined]
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        setattr(self, name, param)

    def _load_part(self, param: torch.Tensor, loaded: Any, shard_id: Any) -> None:
        start, local_inter, inter = self.inter_start, self.local_intermediate, self.intermediate_size
        if shard_id in ("w13", "w2"):
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"stacked expert tensor has {loaded.shape[0]} experts, expected {self.num_experts}")
            mine = narrow(loaded, 0, self.expert_start, self.num_local_experts)
            if self.inter_tp == 1:
                copy_weight(param.data, mine)
            elif shard_id == "w2":
                copy_weight(param.data, mine.narrow(2, start, local_inter))
            else:
                if mine.shape[1] != 2 * inter:
                    raise ValueError(f"stacked gate/up tensor has {mine.shape[1]} rows per "
                                     f"expert, expected {2 * inter}")
                copy_weight(param.data, torch.cat([mine.narrow(1, start, local_inter),
                                                   mine.narrow(1, inter + start, local_inter)], 1))
            return
        expert_id, which = shard_id
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range 0..{self.num_experts - 1}")
        if not self.is_local_expert(expert_id):
            return
        local = param.data[expert_id - self.expert_start]
        if which in ("w1", "w3"):
            if tuple(loaded.shape) != (inter, self.hidden_size):
                copy_weight(local[:local_inter], loaded)  # raises the shape error
            rows = narrow(loaded, 0, start, local_inter) if self.inter_tp > 1 else loaded
            copy_weight(local[:local_inter] if which == "w1" else local[local_inter:], rows)
        elif which == "w2":
            if tuple(loaded.shape) != (self.hidden_size, inter):
                copy_weight(local, loaded)
            copy_weight(local, narrow(loaded, 1, start, local_inter) if self.inter_tp > 1 else loaded)
        else:
            raise ValueError(f"unknown expert shard {which!r}; expected 'w1', 'w2' or 'w3'")

    # -- compute ----------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Run the opaque MoE op for this layer (needs a forward context)."""
        return torch.ops.forwardkit.moe_forward(hidden_states, router_logits, self.layer_name)

    def compute_local(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor, dense: bool | None = None
    ) -> torch.Tensor:
        """Sum over this rank's experts of ``weight * expert(x)`` for every row (float32).

        The sparse form gathers each expert's rows (data-dependent shapes, a host sync); the
        dense form runs every local expert on every row with fixed shapes, which is what a
        CUDA-graph capture needs. ``dense=None`` picks dense only while a capture is running.
        """
        weights, ids = route_topk(router_logits, self.top_k, self.renormalize)
        if dense is None:
            dense = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
        f13, f2 = _packed_format(self.w13_weight), _packed_format(self.w2_weight)
        if dense and (f13 is not None or f2 is not None):
            raise RuntimeError(f"the quantized experts of {self.layer_name} have no fixed-shape "
                               "(CUDA-graph) form; run with cudagraph_mode NONE or PIECEWISE")
        if dense:
            return self._compute_dense(hidden_states, weights, ids)
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        local_ids = ids - self.expert_start
        for e in range(self.num_local_experts):
            token_idx, k_pos = torch.where(local_ids == e)
            if token_idx.numel() == 0:
                continue
            x = hidden_states[token_idx]
            h = silu_and_mul_native(self._product(x, self.w13_weight[e], f13))
            y = self._product(h, self.w2_weight[e], f2)
            out.index_add_(0, token_idx, y.float() * weights[token_idx, k_pos, None])
        return out

    def _product(self, x: torch.Tensor, weight: torch.Tensor, fmt: str | None) -> torch.Tensor:
        """``x @ W.T`` for one expert weight: ``F.linear``, or for packed blocks of ``fmt`` the
        op (native kernels) or its plain-torch reference."""
        if fmt is None:
            return F.linear(x, weight)
        if self.quant_kernel:
            return torch.ops.forwardkit.quant_linear(x, weight, None, fmt)
        return reference_linear(x, weight, None, fmt)

    def _compute_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        combine = torch.zeros((x.shape[0], self.num_experts), dtype=torch.float32, device=x.device)
        combine.scatter_(1, ids, weights)  # [T, E]: routing weight of each (row, expert), 0 if unused
        combine = combine[:, self.expert_start : self.expert_start + self.num_local_experts]
        h = silu_and_mul_native(torch.einsum("th,eih->eti", x, self.w13_weight))
        y = torch.einsum("eti,ehi->eth", h, self.w2_weight)
        return torch.einsum("eth,te->th", y.float(), combine)

    def forward_impl(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The op body: local experts only, or the DP expert-parallel exchange. Under TP the
        result is this rank's share; the caller sums it over the TP group."""
        if not self.use_dp_exchange:
            return self.compute_local(hidden_states, router_logits).to(hidden_states.dtype)
        dp_metadata = get_forward_context().dp_metadata
        if dp_metadata is None:
            raise RuntimeError(
                f"MoE layer {self.layer_name!r} runs expert-parallel over {self.ep_size} DP ranks "
                "but the forward context has no dp_metadata; pass num_tokens (and "
                "num_tokens_across_dp) to set_forward_context on every DP rank"
            )
        if self.is_sequence_parallel:
            return _sp_exchange(self, hidden_states, router_logits, dp_metadata)
        return _dp_exchange(self, hidden_states, router_logits, dp_metadata)


def _packed_format(param: torch.Tensor) -> str | None:
    """The block format of a packed expert weight; None for a float one."""
    if param.dtype != torch.uint8:
        return None
    fmt: str = param.quant_format  # type: ignore[attr-defined]
    return fmt


def _dp_exchange(
    layer: FusedMoE, hidden: torch.Tensor, logits: torch.Tensor, dp_metadata: Any
) -> torch.Tensor:
    group = get_dp_group()
    rank, world = group.rank, group.world_size
    if world * layer.tp_size != layer.ep_size:
        raise RuntimeError(f"DP group has {world} ranks but MoE layer {layer.layer_name!r} expects "
                           f"{layer.ep_size // layer.tp_size}")
    num_local, hidden_size = hidden.shape
    payload = torch.cat([hidden.float(), logits.float()], dim=1)
    use_cpu = hidden.device.type != group.device.type
    comm_device = torch.device("cpu") if use_cpu else hidden.device
    out = torch.zeros((num_local, hidden_size), dtype=torch.float32, device=hidden.device)
    chunk = envs.FORWARDKIT_MOE_DP_CHUNK_SIZE
    if chunk <= 0:
        raise ValueError(f"FORWARDKIT_MOE_DP_CHUNK_SIZE must be positive, got {chunk}")
    max_tokens = dp_metadata.max_tokens_across_dp

    overlap = dbo_enabled()  # a micro-batch of a DBO step: yield while collectives fly

    def run_chunk(start: int, sizes: list[int], offsets: list[int]) -> None:
        mine = min(sizes[rank], max(0, num_local - start))  # real rows this rank sends
        buf = torch.zeros((max(sizes), payload.shape[1]), dtype=torch.float32, device=comm_device)
        buf[:mine] = payload[start : start + mine].to(comm_device)
        # dispatch: start; in a DBO micro-batch the sibling computes meanwhile; finish
        gathered = _finish(group.start_all_gather(buf, use_cpu=use_cpu), overlap)
        rows = torch.cat([gathered[r, : sizes[r]] for r in range(world)]).to(hidden.device)
        x, lg = rows[:, :hidden_size].to(hidden.dtype), rows[:, hidden_size:]
        partial = layer.compute_local(x, lg).to(comm_device)
        _finish(group.start_all_reduce(partial, use_cpu=use_cpu), overlap)  # combine
        out[start : start + mine] = partial[offsets[rank] : offsets[rank] + mine].to(hidden.device)

    if max_tokens <= chunk:
        # One exchange; row ranges straight from the cumulative counts.
        cu = [0, *dp_metadata.cu_tokens_across_sp(1).tolist()]
        with dp_metadata.sp_local_sizes(1) as sizes:
            run_chunk(0, list(sizes), cu[:-1])
    else:
        for chunk_idx, start in enumerate(range(0, max_tokens, chunk)):
            with dp_metadata.chunked_sizes(1, chunk, chunk_idx) as sizes:
                offsets = [sum(sizes[:r]) for r in range(world)]
                run_chunk(start, list(sizes), offsets)
    return out.to(hidden.dtype)


def _sp_exchange(
    layer: FusedMoE, hidden: torch.Tensor, logits: torch.Tensor, dp_metadata: Any
) -> torch.Tensor:
    """Sequence-parallel expert exchange over the EP group (module docstring): this rank's
    ``hidden`` rows are its slice of its replica's tokens."""
    group = get_ep_group()
    rank, sp = group.rank, layer.sp_size
    if group.world_size != layer.ep_size or rank != layer.ep_rank:
        raise RuntimeError(f"EP group rank {rank} of {group.world_size}, but MoE layer "
                           f"{layer.layer_name!r} is EP rank {layer.ep_rank} of {layer.ep_size}")
    num_local, hidden_size = hidden.shape
    payload = torch.cat([hidden.float(), logits.float()], dim=1)
    use_cpu = hidden.device.type != group.device.type
    comm_device = torch.device("cpu") if use_cpu else hidden.device
    out = torch.zeros((num_local, hidden_size), dtype=torch.float32, device=hidden.device)
    chunk = envs.FORWARDKIT_MOE_DP_CHUNK_SIZE
    if chunk <= 0:
        raise ValueError(f"FORWARDKIT_MOE_DP_CHUNK_SIZE must be positive, got {chunk}")
    max_tokens = -(-dp_metadata.max_tokens_across_dp // sp)  # rows of the largest slice
    naive = layer.all2all_backend == "naive"
    overlap = dbo_enabled()  # a micro-batch of a DBO step: yield while collectives fly

    def run_chunk(start: int, sizes: list[int], offsets: list[int]) -> None:
        mine = min(sizes[rank], max(0, num_local - start))  # real rows this rank sends
        send = torch.zeros((sizes[rank], payload.shape[1]), dtype=torch.float32, device=comm_device)
        send[:mine] = payload[start : start + mine].to(comm_device)
        if naive:  # every rank's rows at their offset in one buffer, summed
            rows = torch.zeros((sum(sizes), payload.shape[1]), dtype=torch.float32,
                               device=comm_device)
            rows[offsets[rank] : offsets[rank] + sizes[rank]] = send
            rows = _finish(group.start_all_reduce(rows, use_cpu=use_cpu), overlap)
        else:
            rows = _finish(group.start_all_gather_v(send, sizes, use_cpu=use_cpu), overlap)
        rows = rows.to(hidden.device)
        x, lg = rows[:, :hidden_size].to(hidden.dtype), rows[:, hidden_size:]
        partial = layer.compute_local(x, lg).to(comm_device)
        if naive:
            partial = _finish(group.start_all_reduce(partial, use_cpu=use_cpu), overlap)
            back = partial[offsets[rank] : offsets[rank] + sizes[rank]]
        else:
            back = _finish(group.start_reduce_scatter_v(partial, sizes, use_cpu=use_cpu), overlap)
        out[start : start + mine] = back[:mine].to(hidden.device)

    if max_tokens <= chunk:
        with dp_metadata.sp_local_sizes(sp):
            sizes = list(dp_metadata.get_chunk_sizes_across_dp_rank())
            offsets = [0, *dp_metadata.cu_tokens_across_sp(sp).tolist()][:-1]
            run_chunk(0, sizes, offsets)
    else:
        for chunk_idx, start in enumerate(range(0, max_tokens, chunk)):
            with dp_metadata.chunked_sizes(sp, chunk, chunk_idx):
                sizes = list(dp_metadata.get_chunk_sizes_across_dp_rank())
                run_chunk(start, sizes, [sum(sizes[:r]) for r in range(len(sizes))])
    return out.to(hidden.dtype)


def _finish(pending: Any, overlap: bool) -> Any:
    """The result of a started collective; in a DBO micro-batch, first let the sibling
    micro-batch compute while it is in flight (its wait is the registered receive hook)."""
    if overlap:
        dbo_register_recv_hook(pending.wait)
        dbo_yield()
    return pending.wait()


def _lookup_layer(layer_name: str) -> FusedMoE:
    layers = get_forward_context().no_compile_layers
    layer = layers.get(layer_name)
    if not isinstance(layer, FusedMoE):
        raise KeyError(f"MoE layer {layer_name!r} is not registered in the forward context")
    return layer


@torch.library.custom_op("forwardkit::moe_forward", mutates_args=())
def moe_forward(hidden_states: torch.Tensor, router_logits: torch.Tensor, layer_name: str) -> torch.Tensor:
    """Opaque MoE: routed experts of layer ``layer_name`` (see module docstring)."""
    return _lookup_layer(layer_name).forward_impl(hidden_states, router_logits)


@moe_forward.register_fake
def _(hidden_states, router_logits, layer_name) -> torch.Tensor:
    return torch.empty_like(hidden_states)
