"""Torch-native paged attention: per-step metadata and the kernel over a paged KV cache.

Batch layout (as in vLLM v1): the tokens of request ``i`` occupy rows
``[query_start_loc[i], query_start_loc[i+1])`` of the flat ``[T, ...]`` inputs, in position
order; rows ``num_actual_tokens..T-1`` are padding (slot -1). A request with query length
``q`` and sequence length ``s`` has ``s - q`` tokens already cached (its prefix) and attends to
the prefix plus its own tokens causally, so one batch mixes prefill, chunked prefill and decode.

KV cache layout per layer: ``[2, num_blocks + 1, block_size, num_kv_heads, head_size]``; the
extra last block is a scratch block that absorbs the writes of padding rows, so the write is
one fixed-shape ``index_copy_`` (no data-dependent masking, CUDA-graph safe).

Decode requests (query length 1) run as one batched, fixed-shape gather + masked softmax;
multi-token requests run one SDPA call each. The backend's CUDA-graph support level is
therefore ``UNIFORM_SINGLE_TOKEN_DECODE``: full graphs are safe for pure decode batches only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = [
    "AttentionCGSupport",
    "AttentionMetadata",
    "TorchNativeAttentionBackend",
    "build_attention_metadata",
    "paged_attention",
    "write_kv_cache",
]


class AttentionCGSupport(enum.IntEnum):
    """How much of a batch an attention backend can run inside a full CUDA graph."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass
class AttentionMetadata:
    """Everything the paged-attention kernel needs for one (padded) step.

    Tensors live on the step's device; the ``*_cpu`` lists drive the per-request prefill loop.
    """

    num_actual_tokens: int
    num_padded_tokens: int
    num_reqs: int
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, W] int64 (unused entries 0)
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding rows
    decode_token_idx: torch.Tensor  # [Rd] rows of the decode requests
    decode_block_table: torch.Tensor  # [Rd, W]
    decode_key_mask: torch.Tensor  # [Rd, W * block_size] bool: key position < seq_len
    prefill_reqs: list[int] = field(default_factory=list)  # requests with query length > 1

    @property
    def num_decodes(self) -> int:
        """Number of single-token (decode) requests."""
        return int(self.decode_token_idx.shape[0])


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    num_padded_tokens: int,
    block_size: int,
    device: torch.device | str = "cpu",
    max_num_blocks_per_req: int | None = None,
) -> AttentionMetadata:
    """Build :class:`AttentionMetadata` for a padded batch.

    ``query_lens[i]`` new tokens of request ``i`` are scheduled at positions
    ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``; ``block_tables[i]`` lists its KV blocks
    (at least ``ceil(seq_lens[i] / block_size)``). Rows past ``sum(query_lens)`` up to
    ``num_padded_tokens`` are padding (slot -1). ``max_num_blocks_per_req`` pads the block table
    width (keep it fixed when the metadata feeds a captured CUDA graph).
    """
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError(
            "query_lens, seq_lens and block_tables must have one entry per request; got lengths "
            f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_actual = sum(query_lens)
    if num_padded_tokens < num_actual:
        raise ValueError(
            f"num_padded_tokens={num_padded_tokens} is smaller than the {num_actual} scheduled tokens"
        )
    width = max([len(bt) for bt in block_tables] + [1])
    if max_num_blocks_per_req is not None:
        if max_num_blocks_per_req < width:
            raise ValueError(
                f"max_num_blocks_per_req={max_num_blocks_per_req} < longest block table ({width})"
            )
        width = max_num_blocks_per_req
    slots: list[int] = []
    table: list[list[int]] = []
    starts = [0]
    decode_rows, decode_reqs, prefill_reqs = [], [], []
    for i, (q, s, bt) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if q < 1 or s < q:
            raise ValueError(f"request {i}: need 1 <= query_len <= seq_len, got query_len={q}, seq_len={s}")
        if len(bt) * block_size < s:
            raise ValueError(
                f"request {i}: block table {bt} holds {len(bt) * block_size} tokens < seq_len {s} "
                f"(block_size {block_size})"
            )
        if any(b < 0 for b in bt):
            raise ValueError(f"request {i}: negative block id in block table {bt}")
        for pos in range(s - q, s):
            slots.append(bt[pos // block_size] * block_size + pos % block_size)
        table.append(list(bt) + [0] * (width - len(bt)))
        if q == 1:
            decode_rows.append(starts[-1])
            decode_reqs.append(i)
        else:
            prefill_reqs.append(i)
        starts.append(starts[-1] + q)
    slots.extend([-1] * (num_padded_tokens - num_actual))

    def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=device)

    block_table = tensor(table, torch.int64).reshape(len(table), width)
    seq_lens_t = tensor(list(seq_lens), torch.int32)
    decode_seq = tensor([seq_lens[i] for i in decode_reqs], torch.int64)
    key_pos = torch.arange(width * block_size, device=device)
    return AttentionMetadata(
        num_actual_tokens=num_actual,
        num_padded_tokens=num_padded_tokens,
        num_reqs=len(query_lens),
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        query_start_loc_cpu=starts,
        query_start_loc=tensor(starts, torch.int32),
        seq_lens=seq_lens_t,
        block_table=block_table,
        slot_mapping=tensor(slots, torch.int64),
        decode_token_idx=tensor(decode_rows, torch.int64),
        decode_block_table=block_table[decode_reqs] if decode_reqs else block_table[:0],
        decode_key_mask=key_pos.unsqueeze(0) < decode_seq.unsqueeze(1),
        prefill_reqs=prefill_reqs,
    )


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` [T, Hk, D] at ``slot_mapping`` (slot -1 -> the scratch block)."""
    num_blocks_total, block_size = kv_cache.shape[1], kv_cache.shape[2]
    scratch = (num_blocks_total - 1) * block_size
    slots = torch.where(slot_mapping >= 0, slot_mapping, scratch)
    n = slots.shape[0]
    flat = kv_cache.view(2, num_blocks_total * block_size, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slots, key[:n].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value[:n].to(kv_cache.dtype))


def _decode(
    query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float, output: torch.Tensor
) -> None:
    rows = md.decode_token_idx
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    q = query.index_select(0, rows)  # [Rd, Hq, D]
    rd, hq = q.shape[0], q.shape[1]
    k = kv_cache[0][md.decode_block_table].reshape(rd, -1, num_kv_heads, head_size).transpose(1, 2)
    v = kv_cache[1][md.decode_block_table].reshape(rd, -1, num_kv_heads, head_size).transpose(1, 2)
    # NOTE: one query token per request, so the query heads that share a KV head can stand in
    # the "sequence" dim: [Rd, Hk, group, D] against [Rd, Hk, S, D], no K/V repeat needed.
    q = q.view(rd, num_kv_heads, hq // num_kv_heads, head_size)
    mask = md.decode_key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    output.index_copy_(0, rows, out.reshape(rd, hq, head_size).to(output.dtype))


def _prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    output: torch.Tensor,
    req: int,
) -> None:
    start, end = md.query_start_loc_cpu[req], md.query_start_loc_cpu[req + 1]
    q_len, seq_len = end - start, md.seq_lens_cpu[req]
    num_blocks = -(-seq_len // md.block_size)
    blocks = md.block_table[req, :num_blocks]
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    k = kv_cache[0][blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
    v = kv_cache[1][blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
    q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
    k = k.transpose(0, 1).unsqueeze(0).to(q.dtype)
    v = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
    group = q.shape[1] // num_kv_heads
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    prefix = seq_len - q_len
    if prefix == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(q_len, device=q.device).unsqueeze(1) + prefix
        mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    output[start:end] = out.squeeze(0).transpose(0, 1).to(output.dtype)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    output: torch.Tensor,
) -> None:
    """Write the step's K/V into ``kv_cache`` and attend; fills ``output`` [T, Hq, D] in place.

    Padding rows (past ``md.num_actual_tokens``) are set to zero.
    """
    write_kv_cache(key, value, kv_cache, md.slot_mapping)
    if md.num_actual_tokens < output.shape[0]:
        output[md.num_actual_tokens :].zero_()
    if md.num_decodes:
        _decode(query, kv_cache, md, scale, output)
    for req in md.prefill_reqs:
        _prefill(query, kv_cache, md, scale, output, req)


class TorchNativeAttentionBackend:
    """The reference attention backend: pure torch over the paged cache (see module doc)."""

    name = "TORCH_NATIVE"
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Per-layer cache shape; one extra scratch block absorbs padding-row writes."""
        return (2, num_blocks + 1, block_size, num_kv_heads, head_size)

    build_metadata = staticmethod(build_attention_metadata)
    forward = staticmethod(paged_attention)
