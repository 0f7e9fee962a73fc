"""Torch-native paged attention: the kernel over a paged KV cache.

Batch layout (as in vLLM v1): the tokens of request ``i`` occupy rows
``[query_start_loc[i], query_start_loc[i+1])`` of the flat ``[T, ...]`` inputs, in position
order; rows ``num_actual_tokens..T-1`` are padding (slot -1). A request with query length
``q`` and sequence length ``s`` has ``s - q`` tokens already cached (its prefix) and attends to
the prefix plus its own tokens causally, so one batch mixes prefill, chunked prefill and decode.

KV cache layout per layer: ``[2, num_blocks + 1, block_size, num_kv_heads, head_size]``; the
extra last block is a scratch block that absorbs the writes of padding rows, so the write is
one fixed-shape ``index_put_`` (no data-dependent masking, CUDA-graph safe).

Decode requests (query length 1) run as SDPA calls over their gathered blocks, the query
heads that share a KV head standing in the query-length dim (no K/V repeat). With variable-
shape metadata they are grouped into length buckets so a short request does not gather the
widest block table of the batch; fixed-shape metadata (``max_num_blocks_per_req``) runs them
as one call. On the CPU, a layer built with the ``cpu_attention`` custom op on (the default;
``"-cpu_attention"`` turns it off) instead stores the step's K/V and attends all its decode
requests with one call of the native kernel (``kernels/cpu/native_attention.py``: online softmax
over each request's own blocks, no gathers, no bucket plan) whenever it applies (variable-shape
metadata, one dtype for query, cache and output, rows contiguous); otherwise the torch ops
above serve the step. Multi-token requests run one SDPA call each (grouped-query, no K/V repeat).
Every row's K/V is stored before any row attends, so a request of ``q`` tokens may also be
given as ``q`` one-token requests of growing sequence lengths (the runner does that for
speculative decoding's ``1 + k``-token decodes: ``runner.model_runner.unfold_decodes``): a
uniform decode batch of any query length is then decode rows only, at fixed shapes. The
backend's CUDA-graph support level is therefore ``UNIFORM_BATCH``: full graphs are safe for
uniform decode batches (1 or ``1 + k`` tokens per request). The per-step metadata lives in
``attention_metadata``.

The interface every backend implements is :class:`AttentionBackend`: a metadata builder (the
runner calls it once per step), ``forward`` (the opaque attention op calls it per layer), the
KV-cache shape and the CUDA-graph support level. Backends are registered by name
(:func:`register_attention_backend`); :func:`get_attention_backend` selects one by name, by
default ``FORWARDKIT_ATTENTION_BACKEND`` or ``TORCH_NATIVE``. A second backend is one subclass
plus one ``register_attention_backend`` call. The registry, :class:`AttentionCGSupport` and the
selection rule live in ``config/attention.py`` (re-exported here): the engine config reads the
selected backend's support level to decide the graph mode the runner serves.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, cast

import torch
import torch.nn.functional as F

from forwardkit.config.attention import (
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION_BACKEND,
    AttentionCGSupport,
    selected_attention_backend,
)
from forwardkit.forward_context import StepAttentionMetadata
from forwardkit.kernels.cpu import native_attention
from forwardkit.layers.attention_metadata import (
    AttentionMetadata,
    DecodeBucket,
    PrefillChunk,
    build_attention_metadata,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_ATTENTION_BACKEND",
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionLayerSpec",
    "AttentionMetadata",
    "DecodeBucket",
    "PrefillChunk",
    "TorchNativeAttentionBackend",
    "build_attention_metadata",
    "get_attention_backend",
    "paged_attention",
    "register_attention_backend",
    "write_kv_cache",
]


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` [T, Hk, D] at ``slot_mapping`` (slot -1 -> the scratch block).

    ``index_put_`` wraps slot -1 to the last slot of the cache, which is in the scratch block,
    so padding rows need no remapping (which of them lands there last does not matter).
    """
    n = slot_mapping.shape[0]
    flat = kv_cache.view(2, kv_cache.shape[1] * kv_cache.shape[2], *kv_cache.shape[3:])
    flat[0].index_put_((slot_mapping,), key[:n].to(kv_cache.dtype))
    flat[1].index_put_((slot_mapping,), value[:n].to(kv_cache.dtype))


def _decode_call(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 rows: torch.Tensor, block_ids: torch.Tensor, key_len: int | None,
                 mask: torch.Tensor | None, scale: float, output: torch.Tensor) -> None:
    """One SDPA call for the decode requests at ``rows`` over their flat ``block_ids``.

    ``k_cache``/``v_cache`` are one layer's ``[num_blocks + 1, block_size, Hk, D]`` halves.
    """
    num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
    q = query.index_select(0, rows)  # [n, Hq, D]
    n, hq = q.shape[0], q.shape[1]
    # NOTE: two gathers along dim 0, not one along dim 1 of the whole cache: index_select
    # only splits the dim-0 form across threads on CPU.
    k = k_cache.index_select(0, block_ids).view(n, -1, num_kv_heads, head_size)
    v = v_cache.index_select(0, block_ids).view(n, -1, num_kv_heads, head_size)
    if key_len is not None and key_len < k.shape[1]:
        k, v = k[:, :key_len], v[:, :key_len]
    # NOTE: one query token per request, so the query heads that share a KV head can stand in
    # the "sequence" dim: [n, Hk, group, D] against [n, Hk, S, D], no K/V repeat needed.
    q = q.view(n, num_kv_heads, hq // num_kv_heads, head_size)
    k = k.transpose(1, 2).to(q.dtype)  # no-ops when the cache has the query's dtype
    v = v.transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    output.index_copy_(0, rows, out.view(n, hq, head_size).to(output.dtype))


def _decode(query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
            output: torch.Tensor) -> None:
    k_cache, v_cache = kv_cache.unbind(0)
    if md.decode_buckets is None:  # fixed shapes: one call over the full-width block table
        _decode_call(query, k_cache, v_cache, md.decode_token_idx, md.decode_block_table.reshape(-1),
                     None, md.decode_key_mask[:, None, None, :], scale, output)
        return
    bucket: DecodeBucket
    for bucket in md.decode_buckets:
        _decode_call(query, k_cache, v_cache, bucket.rows, bucket.block_ids, bucket.key_len,
                     bucket.additive_mask(query.dtype), scale, output)


def _native_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                   output: torch.Tensor) -> bool:
    """Store the step's K/V and attend every decode request in one native call
    (``kernels/cpu/native_attention.py``); False, having done nothing, when it does not apply
    (fixed-shape metadata, no decode requests, the kernel unavailable or declining the
    tensors): the torch path then serves the step."""
    if md.decode_buckets is None or not md.decode_token_idx.shape[0]:
        return False
    index = md.native_decode_index
    if index is None:  # the step's first layer: its indices, checked once
        index = native_attention.decode_index(md.decode_token_idx, md.decode_block_table,
                                              md.decode_seq_lens, md.slot_mapping)
        md.native_decode_index = False if index is None else index
    if index is None or index is False:
        return False
    return native_attention.paged_decode(query, key, value, kv_cache, index, scale, output)


def _prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             chunk: PrefillChunk, scale: float, output: torch.Tensor) -> None:
    start, end, seq_len = chunk.start, chunk.end, chunk.seq_len
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    if chunk.mask is None:
        # No cached prefix: the keys are exactly this step's (as stored, i.e. in the cache dtype).
        k = key[start:end].to(kv_cache.dtype)
        v = value[start:end].to(kv_cache.dtype)
    else:
        k = kv_cache[0].index_select(0, chunk.block_ids).view(-1, num_kv_heads, head_size)[:seq_len]
        v = kv_cache[1].index_select(0, chunk.block_ids).view(-1, num_kv_heads, head_size)[:seq_len]
    q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
    k = k.transpose(0, 1).unsqueeze(0).to(q.dtype)
    v = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
    gqa = q.shape[1] != num_kv_heads
    if chunk.mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale,
                                             enable_gqa=gqa)
    output[start:end] = out.squeeze(0).transpose(0, 1).to(output.dtype)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    output: torch.Tensor,
    native_decode: bool = False,
) -> None:
    """Write the step's K/V into ``kv_cache`` and attend; fills ``output`` [T, Hq, D] in place.

    Padding rows (past ``md.num_actual_tokens``) are set to zero. ``native_decode``: store the
    K/V and attend the decode requests with one call of the native CPU kernel when it applies
    (else, and for the multi-token requests, the torch ops).
    """
    if not (native_decode and _native_decode(query, key, value, kv_cache, md, scale, output)):
        write_kv_cache(key, value, kv_cache, md.slot_mapping)
        if md.decode_token_idx.shape[0]:
            _decode(query, kv_cache, md, scale, output)
    if md.num_actual_tokens < output.shape[0]:
        output[md.num_actual_tokens :].zero_()
    for chunk in md.prefill_chunks:
        _prefill(query, key, value, kv_cache, chunk, scale, output)


class AttentionLayerSpec(Protocol):
    """What a backend's ``forward`` may read from the attention layer it runs for."""

    layer_name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float


class AttentionBackend:
    """The interface between the runner, the attention op and an attention implementation.

    A backend is a class (never instantiated) with:

    - ``name``: its registry key;
    - ``cudagraph_support``: an :class:`AttentionCGSupport`; the engine config lowers the
      configured CUDA-graph mode to it (``EngineConfig.served_cudagraph_mode``);
    - ``metadata_cls``: the type ``build_metadata`` returns (the op checks it);
    - ``get_kv_cache_shape``: the per-layer KV-cache tensor shape;
    - ``build_metadata``: the per-step metadata, built once per step by the runner and shared
      by every layer through the forward context;
    - ``forward``: one layer's attention, called by the opaque attention op.
    """

    name: ClassVar[str] = ""
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    metadata_cls: ClassVar[type[StepAttentionMetadata]] = AttentionMetadata

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Per-layer cache shape; block id ``num_blocks`` must be a usable scratch block."""
        raise NotImplementedError

    @classmethod
    def build_metadata(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        num_padded_tokens: int,
        block_size: int,
        device: torch.device | str = "cpu",
        max_num_blocks_per_req: int | None = None,
    ) -> StepAttentionMetadata:
        """Metadata of one padded step (see :func:`build_attention_metadata` for the inputs).

        ``max_num_blocks_per_req`` set means fixed shapes per padded size (FULL graphs).
        """
        raise NotImplementedError

    @classmethod
    def forward(
        cls,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: StepAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        """Store this step's K/V [T, Hk, D] and write the attention of ``query`` [T, Hq, D]
        into ``output`` [T, Hq, D] (padding rows zero)."""
        raise NotImplementedError


# What every registered backend must define itself (register_attention_backend checks).
_REQUIRED_METHODS = ("get_kv_cache_shape", "build_metadata", "forward")

# name -> backend class: the registry lives in the config layer (config/attention.py), which
# reads a selected backend's cudagraph_support to resolve the served graph mode.


def register_attention_backend(backend: type[AttentionBackend]) -> type[AttentionBackend]:
    """Register ``backend`` under ``backend.name`` (usable as a class decorator)."""
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise TypeError(f"an attention backend must subclass AttentionBackend, got {backend!r}")
    if not backend.name:
        raise ValueError(f"attention backend {backend.__name__} has no name")
    if not isinstance(backend.cudagraph_support, AttentionCGSupport):
        raise TypeError(
            f"attention backend {backend.name}: cudagraph_support must be an AttentionCGSupport, "
            f"got {backend.cudagraph_support!r}"
        )
    missing = [m for m in _REQUIRED_METHODS  # defined by the base class, not the backend
               if next(k for k in backend.__mro__ if m in vars(k)) is AttentionBackend]
    if missing:  # the base class's methods only describe the interface
        raise TypeError(f"attention backend {backend.name} does not implement {missing}")
    ATTENTION_BACKENDS[backend.name] = backend
    return backend


def get_attention_backend(name: str | None = None) -> type[AttentionBackend]:
    """The registered backend called ``name``; None: ``FORWARDKIT_ATTENTION_BACKEND`` if set,
    else ``TORCH_NATIVE`` (``config.attention.selected_attention_backend``)."""
    name = selected_attention_backend(name)
    try:
        backend: type[AttentionBackend] = ATTENTION_BACKENDS[name]
        return backend
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; registered: {sorted(ATTENTION_BACKENDS)}"
        ) from None


@register_attention_backend
class TorchNativeAttentionBackend(AttentionBackend):
    """The reference attention backend: pure torch over the paged cache (see module doc)."""

    name = "TORCH_NATIVE"
    cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
    metadata_cls = AttentionMetadata

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Per-layer cache shape; one extra scratch block absorbs padding-row writes."""
        return (2, num_blocks + 1, block_size, num_kv_heads, head_size)

    # the torch-native metadata builder, as is
    build_metadata = staticmethod(build_attention_metadata)

    @classmethod
    def forward(
        cls,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: StepAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        # the attention op checked the type against metadata_cls already (no per-layer check);
        # the layer chose at construction whether its decodes may take the native CPU kernel
        # (the "cpu_attention" custom op)
        paged_attention(query, key, value, kv_cache, cast(AttentionMetadata, metadata), layer.scale,
                        output, getattr(layer, "native_decode", False))
