"""Per-step attention metadata for the torch-native paged-attention backend.

Everything that is per step rather than per layer is computed here, once, so the attention
op of each layer only runs tensor kernels: the slot mapping, the block table, the rows of
the decode requests grouped into length buckets (see :func:`plan_decode_buckets`), and for
each multi-token request its block ids and (when it has a cached prefix) its causal mask.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Literal

import torch

from forwardkit.forward_context import StepAttentionMetadata
from forwardkit.kernels.cpu.native_attention import DecodeIndex

__all__ = [
    "AttentionMetadata",
    "DecodeBucket",
    "PrefillChunk",
    "build_attention_metadata",
    "plan_decode_buckets",
]

# Fixed cost of one more decode bucket (one more gather + SDPA call per layer), in KV blocks
# of padding it is worth. Tuned on the bench's decode steps (2 CPU threads; 8 does as well on
# one): a call costs ~30-60 us, a 16-token block of 4 KV heads x 32 dims ~3 us.
_CPU_BUCKET_OVERHEAD_BLOCKS = 16
# Largest number of distinct decode widths the bucket planner considers (quadratic search).
_MAX_PLAN_WIDTHS = 64


@dataclass
class DecodeBucket:
    """Decode requests of similar length that run as one SDPA call.

    Each request attends to the first ``key_len`` keys of its ``width`` gathered blocks;
    ``key_mask`` hides keys past a request's own sequence length (None when every request in
    the bucket has exactly ``key_len`` tokens). Masks are built on first use, once per step.
    """

    rows: torch.Tensor  # [n] int64 token rows
    block_ids: torch.Tensor  # [n * width] int64, 0 past a request's own blocks
    width: int
    key_len: int
    seq_lens: torch.Tensor | None  # [n, 1] int64 when they differ, else None
    _masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def key_mask(self) -> torch.Tensor | None:
        """[n, 1, 1, key_len] bool: key position < the request's sequence length."""
        if self.seq_lens is None:
            return None
        mask = self._masks.get(torch.bool)
        if mask is None:
            pos = torch.arange(self.key_len, device=self.seq_lens.device)
            mask = self._masks[torch.bool] = (pos < self.seq_lens)[:, None, None, :]
        return mask

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``key_mask`` as an additive mask (0 / -inf) of ``dtype``, built once per step.

        SDPA turns a bool mask into this form on every call; the layers of a step share it.
        """
        if self.seq_lens is None:
            return None
        mask = self._masks.get(dtype)
        if mask is None:
            pos = torch.arange(self.key_len, device=self.seq_lens.device)
            mask = torch.zeros(self.seq_lens.shape[0], self.key_len, dtype=dtype,
                               device=self.seq_lens.device)
            mask = self._masks[dtype] = mask.masked_fill_(pos >= self.seq_lens, float("-inf"))[
                :, None, None, :]
        return mask


@dataclass
class PrefillChunk:
    """One multi-token request: its rows, its blocks and its mask against the cached prefix."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [q_len, seq_len] bool; None when there is no prefix (causal)

    @property
    def prefix_len(self) -> int:
        """Tokens already in the cache before this step."""
        return self.seq_len - (self.end - self.start)


@dataclass
class AttentionMetadata(StepAttentionMetadata):
    """Everything the paged-attention kernel needs for one (padded) step.

    Tensors live on the step's device; the ``*_cpu`` lists and the bucket/chunk plans drive the
    per-layer loops (the native CPU decode attention needs no bucket plan: it reads
    ``decode_token_idx``, ``decode_block_table``, ``decode_seq_lens`` and ``slot_mapping``). ``decode_buckets`` is None for fixed-shape metadata (built with
    ``max_num_blocks_per_req``, e.g. for a full CUDA graph): decodes then run as one call over
    ``decode_block_table`` with ``decode_key_mask``.
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
    decode_seq_lens: torch.Tensor  # [Rd] int64: sequence lengths of the decode requests
    prefill_reqs: list[int] = field(default_factory=list)  # requests with query length > 1
    decode_buckets: list[DecodeBucket] | None = None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    # the decode requests' indices as the native CPU decode attention takes them, made by the
    # first layer that calls it (``attention_backend``), shared by the step's other layers;
    # False when they do not fit the kernel
    native_decode_index: DecodeIndex | Literal[False] | None = field(
        default=None, init=False, repr=False, compare=False)

    @property
    def num_decodes(self) -> int:
        """Number of single-token (decode) requests."""
        return int(self.decode_token_idx.shape[0])


def plan_decode_buckets(widths: list[int], overhead: int) -> list[int]:
    """Split ascending per-request block counts into buckets; return each bucket's end index.

    A bucket of ``n`` requests whose widest needs ``w`` blocks costs ``overhead + n * w``
    (blocks gathered and attended, padding included, plus a fixed cost per call); the
    partition into contiguous runs minimises the total (dynamic programming over the distinct
    widths, coarsened to at most 64 candidate cuts).
    """
    if any(b < a for a, b in zip(widths, widths[1:])):
        raise ValueError(f"plan_decode_buckets needs ascending widths, got {widths}")
    n = len(widths)
    if n == 0:
        return []
    cuts = [i + 1 for i in range(n - 1) if widths[i + 1] != widths[i]] + [n]
    if len(cuts) > _MAX_PLAN_WIDTHS:
        step = -(-len(cuts) // _MAX_PLAN_WIDTHS)
        cuts = cuts[step - 1 :: step] + ([] if (len(cuts) % step == 0) else [n])
    best = [0] + [0] * len(cuts)
    choice = [0] * (len(cuts) + 1)
    for j, end in enumerate(cuts, start=1):
        w = widths[end - 1]
        best_cost, best_i = -1, 0
        for i in range(j):
            begin = cuts[i - 1] if i else 0
            cost = best[i] + overhead + w * (end - begin)
            if best_cost < 0 or cost < best_cost:
                best_cost, best_i = cost, i
        best[j], choice[j] = best_cost, best_i
    ends, j = [], len(cuts)
    while j:
        ends.append(cuts[j - 1])
        j = choice[j]
    return ends[::-1]


def _validate(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              num_padded_tokens: int, block_size: int) -> int:
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
    for i, (q, s, bt) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if q < 1 or s < q:
            raise ValueError(f"request {i}: need 1 <= query_len <= seq_len, got query_len={q}, seq_len={s}")
        if len(bt) * block_size < s:
            raise ValueError(
                f"request {i}: block table {bt} holds {len(bt) * block_size} tokens < seq_len {s} "
                f"(block_size {block_size})"
            )
        if bt and min(bt) < 0:
            raise ValueError(f"request {i}: negative block id in block table {bt}")
    return num_actual


def _ints(data: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A CPU tensor of ``data`` through a typed buffer (several times faster than
    ``torch.tensor`` on a list)."""
    if not data:
        return torch.empty(0, dtype=dtype)
    code = "q" if dtype == torch.int64 else "i"
    return torch.frombuffer(array.array(code, data), dtype=dtype)


def _slots(q: int, s: int, bt: list[int], block_size: int, out: list[int]) -> None:
    """Append the cache slots of positions ``s - q .. s - 1`` (one range per block)."""
    pos = s - q
    while pos < s:
        j, off = divmod(pos, block_size)
        run = min(block_size - off, s - pos)
        base = bt[j] * block_size + off
        out.extend(range(base, base + run))
        pos += run


def _padded_table(block_tables: list[list[int]], width: int) -> torch.Tensor:
    """The block tables as one [num_reqs, width] tensor, rows padded with block 0."""
    flat_table: list[int] = []
    zeros = [0] * width
    for bt in block_tables:
        flat_table += bt
        flat_table += zeros[: width - len(bt)]
    return _ints(flat_table).view(len(block_tables), width)


def _prefill_chunks(prefill_reqs: list[int], query_lens: list[int], seq_lens: list[int],
                    starts: list[int], table: torch.Tensor, block_size: int,
                    device: torch.device) -> list[PrefillChunk]:
    """One :class:`PrefillChunk` per multi-token request, with its causal mask over a cached
    prefix (None when it has none)."""
    chunks = []
    for i in prefill_reqs:
        q, s = query_lens[i], seq_lens[i]
        mask = None
        if s > q:
            # query row r (position s - q + r) sees keys 0 .. s - q + r
            mask = torch.ones(q, s, dtype=torch.bool).tril_(s - q).to(device)
        blocks = table[i, : -(-s // block_size)].to(device)
        chunks.append(PrefillChunk(starts[i], starts[i + 1], s, blocks, mask))
    return chunks


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
    width and keeps every decode in one fixed-shape call (use it when the metadata feeds a
    captured CUDA graph); without it, decodes are grouped into length buckets.
    """
    num_actual = _validate(query_lens, seq_lens, block_tables, num_padded_tokens, block_size)
    width = max([len(bt) for bt in block_tables] + [1])
    if max_num_blocks_per_req is not None:
        if max_num_blocks_per_req < width:
            raise ValueError(
                f"max_num_blocks_per_req={max_num_blocks_per_req} < longest block table ({width})"
            )
        width = max_num_blocks_per_req
    device = torch.device(device)
    slots: list[int] = []
    starts = [0]
    decode_reqs: list[int] = []
    prefill_reqs: list[int] = []
    for i, (q, s, bt) in enumerate(zip(query_lens, seq_lens, block_tables)):
        _slots(q, s, bt, block_size, slots)
        (decode_reqs if q == 1 else prefill_reqs).append(i)
        starts.append(starts[-1] + q)
    slots.extend([-1] * (num_padded_tokens - num_actual))

    table = _padded_table(block_tables, width)
    decode_seq = _ints([seq_lens[i] for i in decode_reqs]).unsqueeze(1)
    all_decode = len(decode_reqs) == len(block_tables)
    cpu = {
        "query_start_loc": _ints(starts, torch.int32),
        "seq_lens": _ints(list(seq_lens), torch.int32),
        "block_table": table,
        "slot_mapping": _ints(slots),
        "decode_token_idx": _ints([starts[i] for i in decode_reqs]),
        "decode_block_table": table if all_decode else table[decode_reqs],
        "decode_key_mask": torch.arange(width * block_size).unsqueeze(0) < decode_seq,
        "decode_seq_lens": decode_seq.view(-1),
    }
    buckets = None
    if max_num_blocks_per_req is None:
        buckets = _decode_buckets(decode_reqs, seq_lens, starts, block_tables, block_size, device)
    chunks = _prefill_chunks(prefill_reqs, query_lens, seq_lens, starts, table, block_size, device)
    tensors = {k: v.to(device) for k, v in cpu.items()} if device.type != "cpu" else cpu
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
        prefill_reqs=prefill_reqs,
        decode_buckets=buckets,
        prefill_chunks=chunks,
        **tensors,
    )


def _decode_buckets(decode_reqs: list[int], seq_lens: list[int], starts: list[int],
                    block_tables: list[list[int]], block_size: int,
                    device: torch.device) -> list[DecodeBucket]:
    """Group the decode requests by length (see :func:`plan_decode_buckets`).

    Every per-bucket tensor is a slice of one tensor per kind (rows, flat block ids, lengths),
    so the cost is a handful of tensor constructions per step, not per bucket.
    """
    if not decode_reqs:
        return []
    order = sorted(decode_reqs, key=seq_lens.__getitem__)
    seqs = [seq_lens[i] for i in order]
    widths = [-(-s // block_size) for s in seqs]
    # NOTE: on an accelerator one more kernel launch costs more than gathering padding.
    overhead = _CPU_BUCKET_OVERHEAD_BLOCKS if device.type == "cpu" else 1 << 30
    ends = plan_decode_buckets(widths, overhead)
    flat: list[int] = []
    spans, begin = [], 0
    for end in ends:
        w = widths[end - 1]
        first = len(flat)
        for i in order[begin:end]:
            bt = block_tables[i]
            flat.extend(bt[:w] if len(bt) >= w else list(bt) + [0] * (w - len(bt)))
        spans.append((begin, end, first, len(flat)))
        begin = end
    rows_all = _ints([starts[i] for i in order]).to(device)
    blocks_all = _ints(flat).to(device)
    seq_all = _ints(seqs).unsqueeze(1).to(device) if seqs[0] < seqs[-1] else None
    buckets = []
    for begin, end, first, last in spans:
        key_len = seqs[end - 1]
        seq = seq_all[begin:end] if seq_all is not None and seqs[begin] < key_len else None
        buckets.append(DecodeBucket(rows_all[begin:end], blocks_all[first:last],
                                    widths[end - 1], key_len, seq))
    return buckets
