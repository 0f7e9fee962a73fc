"""Tensor-parallel layers: each rank holds a slice of every weight and the layers communicate.

* :class:`ColumnParallelLinear` / :class:`MergedColumnParallelLinear` /
  :class:`QKVParallelLinear`: the output dim is split; no communication (the next layer takes
  the split activations). QKV gives each rank ``heads / tp`` query heads and
  ``max(1, kv_heads / tp)`` KV heads; with fewer KV heads than ranks each KV head is
  replicated on ``tp / kv_heads`` ranks.
* :class:`RowParallelLinear`: the input dim is split; the partial products are summed over the
  TP group (``forwardkit::all_reduce``), and the bias is added on TP rank 0 only, so it counts
  once.
* :class:`VocabParallelEmbedding` / :class:`ParallelLMHead`: each rank holds
  ``ceil(vocab / tp)`` rows (the last rank's tail is zero padding). The embedding looks up the
  ids inside its rows (others masked to zero) and sums over TP; the head's logits are
  gathered over TP and the padding columns dropped.

With ``tp_size == 1`` every class is its single-device base class (same parameters, same
graph: no collective op is emitted).

Every sharded parameter carries a :class:`ShardSpec` (``param.tp_shard``): which slices of
the full (unsharded) tensor it holds. Weight loaders, the seeded random fill and
``update_weights`` all go through it, so each takes a full Hugging Face tensor (or one shard
of a merged projection, or a lazily read safetensors slice) and copies only this rank's part.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn as nn

from forwardkit.config.engine import get_current_engine_config, get_current_engine_config_or_none
from forwardkit.config.model import embedding_quantization
from forwardkit.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from forwardkit.distributed.parallel_state import tp_rank_and_size
from forwardkit.kernels.cpu import router
from forwardkit.layers.linear import Linear, LMHead, MergedLinear, VocabEmbedding, WeightShapeError
from forwardkit.quantization.linear_method import QuantizedEmbeddingMethod, QuantizedLinearMethod

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RowParallelLinear",
    "ShardSpec",
    "TensorSource",
    "VocabParallelEmbedding",
    "copy_full",
    "copy_shard",
    "current_tp",
    "divide",
    "embedding_quant_methods",
    "full_shape",
    "materialize",
    "narrow",
    "projection_quant_method",
    "set_shard_spec",
    "shard_spec_of",
]


class TensorSource(Protocol):
    """A tensor to load that may not be read yet (a safetensors slice): shape, dtype, and the
    rows one rank needs, read on demand."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...

    def materialize(self) -> torch.Tensor: ...


def current_tp() -> tuple[int, int]:
    """``(tp_rank, tp_size)`` of the model being built: ``tensor_parallel_size`` of the
    current engine config and this process's place in the TP group."""
    return tp_rank_and_size(get_current_engine_config().parallel_config.tensor_parallel_size)


def projection_quant_method() -> QuantizedLinearMethod | None:
    """The quant method of the attention/MLP projections of the model being built: the current
    engine config's ``model_config.quantization`` (None: unquantized). The embedding and the LM
    head take theirs from :func:`embedding_quant_methods`; MoE router gates never take one."""
    config = get_current_engine_config_or_none()
    fmt = None if config is None or config.model_config is None else config.model_config.quantization
    return None if fmt is None else QuantizedLinearMethod(fmt)


def embedding_quant_methods() -> tuple[QuantizedEmbeddingMethod | None, QuantizedLinearMethod | None]:
    """``(token embedding's, LM head's)`` quant methods of the model being built: both in the
    format ``config.model.embedding_quantization`` gives for ``model_config.quantization``
    (None, None when unquantized)."""
    config = get_current_engine_config_or_none()
    quantization = None if config is None or config.model_config is None else config.model_config.quantization
    fmt = embedding_quantization(quantization)
    if fmt is None:
        return None, None
    return QuantizedEmbeddingMethod(fmt), QuantizedLinearMethod(fmt)


def materialize(t: torch.Tensor | TensorSource) -> torch.Tensor:
    """``t`` as a tensor (a lazily read source is read whole)."""
    return t if isinstance(t, torch.Tensor) else t.materialize()


def narrow(t: torch.Tensor | TensorSource, dim: int, start: int, length: int) -> torch.Tensor:
    """``t.narrow(dim, start, length)``; a lazily read source reads only that part."""
    return t.narrow(dim, start, length)


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, which must divide exactly (``what`` names the quantity)."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size="
                         f"{denominator}")
    return numerator // denominator


@dataclass(frozen=True)
class ShardSpec:
    """Which parts of a full tensor one rank's parameter holds, along one dimension.

    ``segments``: ``(full_start, local_start, length)`` triples for the whole (merged) tensor
    of ``full_size`` along ``dim``; ``by_shard``: per shard id of a merged projection, the size
    of that shard's own tensor along ``dim`` and its triples (``full_start`` relative to the
    shard's tensor). Local rows no segment covers (vocabulary padding) are zero.
    """

    dim: int
    full_size: int
    segments: tuple[tuple[int, int, int], ...]
    by_shard: dict[Hashable, tuple[int, tuple[tuple[int, int, int], ...]]] = field(
        default_factory=dict)


def set_shard_spec(param: torch.Tensor, spec: ShardSpec) -> None:
    """Attach ``spec`` to ``param`` (read by the loaders and the random fill)."""
    param.tp_shard = spec  # type: ignore[attr-defined]


def shard_spec_of(param: torch.Tensor) -> ShardSpec | None:
    """The parameter's :class:`ShardSpec`, or None for a full (replicated) parameter."""
    spec: ShardSpec | None = getattr(param, "tp_shard", None)
    return spec


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of the full tensor ``param`` is a shard of (its own shape when replicated)."""
    spec = shard_spec_of(param)
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] = spec.full_size
    return tuple(shape)


def _copy_segments(target: torch.Tensor, source: torch.Tensor | TensorSource, dim: int,
                   segments: Sequence[tuple[int, int, int]]) -> None:
    with torch.no_grad():
        for full_start, local_start, length in segments:
            if length > 0:
                target.narrow(dim, local_start, length).copy_(
                    narrow(source, dim, full_start, length))


def _check(target_shape: Sequence[int], dim: int, size: int, loaded: Any) -> None:
    want = list(target_shape)
    want[dim] = size
    if tuple(loaded.shape) != tuple(want):
        raise WeightShapeError(f"expected shape {tuple(want)}, got {tuple(loaded.shape)}")


def copy_full(param: torch.Tensor, loaded: torch.Tensor | TensorSource) -> None:
    """Copy this rank's part of the full tensor ``loaded`` into ``param`` (all of it when
    ``param`` is replicated). Rows no segment covers are zeroed."""
    spec = shard_spec_of(param)
    if spec is None:
        if tuple(param.shape) != tuple(loaded.shape):
            raise WeightShapeError(f"expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
        with torch.no_grad():
            param.data.copy_(materialize(loaded))
    else:
        _check(param.shape, spec.dim, spec.full_size, loaded)
        covered = sum(length for _, _, length in spec.segments)
        if covered < param.shape[spec.dim]:
            with torch.no_grad():
                param.data.zero_()
        _copy_segments(param.data, loaded, spec.dim, spec.segments)
    router.refresh_packed(param.data)


def copy_shard(param: torch.Tensor, loaded: torch.Tensor | TensorSource, shard_id: Hashable) -> None:
    """Copy this rank's part of merged-projection shard ``shard_id`` (its own full tensor)."""
    spec = shard_spec_of(param)
    if spec is None or shard_id not in spec.by_shard:
        known = list(spec.by_shard) if spec is not None else []
        raise ValueError(f"unknown shard id {shard_id!r}; expected one of {known}")
    size, segments = spec.by_shard[shard_id]
    _check(param.shape, spec.dim, size, loaded)
    _copy_segments(param.data, loaded, spec.dim, segments)
    router.refresh_packed(param.data)


def _split(size: int, tp_rank: int, tp_size: int, what: str) -> tuple[int, int]:
    """``(start, length)`` of rank ``tp_rank``'s equal part of ``size``."""
    part = divide(size, tp_size, what)
    return tp_rank * part, part


class ColumnParallelLinear(MergedLinear):
    """``y = x @ W.T + b`` with the output dim split over TP (merged shards split one by one).

    ``shards`` as for :class:`~forwardkit.layers.linear.MergedLinear` (full output sizes);
    ``tp_rank`` / ``tp_size`` place this rank. The output stays split.
    """

    def __init__(self, input_size: int, shards: Sequence[tuple[Hashable, int]], bias: bool = False,
                 dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1,
                 what: str = "output size") -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        parts = [(sid, size, *self._local(sid, size, tp_rank, tp_size, what))
                 for sid, size in shards]
        super().__init__(input_size, [(sid, length) for sid, _, _, length in parts], bias=bias,
                         dtype=dtype, quant_method=projection_quant_method())
        self.full_output_sizes = [size for _, size in shards]
        if tp_size == 1:
            return
        segments: list[tuple[int, int, int]] = []
        by_shard: dict[Hashable, tuple[int, tuple[tuple[int, int, int], ...]]] = {}
        full_off = local_off = 0
        for sid, size, start, length in parts:
            segments.append((full_off + start, local_off, length))
            by_shard[sid] = (size, ((start, local_off, length),))
            full_off, local_off = full_off + size, local_off + length
        spec = ShardSpec(0, full_off, tuple(segments), by_shard)
        set_shard_spec(self.weight, spec)
        if self.bias is not None:
            set_shard_spec(self.bias, spec)

    def _local(self, shard_id: Hashable, size: int, tp_rank: int, tp_size: int,
               what: str) -> tuple[int, int]:
        """``(start, length)`` of this rank's rows of one shard (equal split by default)."""
        return _split(size, tp_rank, tp_size, what)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Hashable | None = None) -> None:
        """Copy this rank's rows of the whole tensor (``shard_id`` None) or of one shard."""
        if self.tp_size == 1:
            super().weight_loader(param, materialize(loaded), shard_id)
        elif shard_id is None:
            copy_full(param, loaded)
        else:
            copy_shard(param, loaded, shard_id)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate/up: shard ids
    ``0`` and ``1``); each rank holds its slice of each."""


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections (shard ids ``"q"``, ``"k"``, ``"v"``) split by heads.

    Each rank holds ``num_heads / tp`` query heads and ``max(1, num_kv_heads / tp)`` KV heads;
    when ``tp > num_kv_heads`` rank ``r`` holds KV head ``r // (tp / num_kv_heads)``.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype | None = None, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        divide(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads >= tp_size:
            divide(num_kv_heads, tp_size, "num_key_value_heads")
        elif tp_size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size={tp_size} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads} (needed to replicate KV heads)")
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        super().__init__(hidden_size, [("q", num_heads * head_dim), ("k", num_kv_heads * head_dim),
                                       ("v", num_kv_heads * head_dim)],
                         bias=bias, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size)

    def _local(self, shard_id: Hashable, size: int, tp_rank: int, tp_size: int,
               what: str) -> tuple[int, int]:
        if shard_id == "q" or self.total_num_kv_heads >= tp_size:
            return _split(size, tp_rank, tp_size, "attention heads")
        head = tp_rank // (tp_size // self.total_num_kv_heads)
        return head * self.head_dim, self.head_dim


class RowParallelLinear(Linear):
    """``y = sum over TP of x_r @ W_r.T (+ b)``: the input dim is split; ``reduce_results``
    sums the partial outputs over the TP group. The bias is loaded on every rank and added on
    TP rank 0 only (before the sum), so it counts once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1,
                 reduce_results: bool = True, what: str = "input size") -> None:
        start, local = _split(input_size, tp_rank, tp_size, what)
        super().__init__(local, output_size, bias=bias, dtype=dtype,
                         quant_method=projection_quant_method())
        self.full_input_size = input_size
        self.tp_rank, self.tp_size, self.reduce_results = tp_rank, tp_size, reduce_results
        if tp_size > 1:
            set_shard_spec(self.weight, ShardSpec(1, input_size, ((start, 0, local),)))

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Hashable | None = None) -> None:
        """Copy this rank's columns of the weight (the bias is copied whole)."""
        if shard_id is not None:
            raise ValueError(f"parameter of shape {tuple(param.shape)} takes no shard id, got {shard_id!r}")
        copy_full(param, loaded)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The (summed) projection by ``F.linear`` (or the quant method)."""
        if self.tp_size == 1:
            return super().forward_native(x)
        return self._reduce(self.project(x, self.bias if self.tp_rank == 0 else None, op=False))

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The (summed) projection by the ``forwardkit::linear`` op (or the quant method)."""
        if self.tp_size == 1:
            return super().forward_cpu(x)
        return self._reduce(self.project(x, self.bias if self.tp_rank == 0 else None, op=True))

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(out, self.tp_size) if self.reduce_results else out


def _vocab_rows(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """``(rows per rank, first id, ids held)`` of rank ``tp_rank``: ``ceil(vocab / tp)`` rows,
    of which the last rank may hold fewer real ids (the rest is zero padding)."""
    per = -(-vocab_size // tp_size)
    start = min(tp_rank * per, vocab_size)
    return per, start, max(0, min(per, vocab_size - start))


def _vocab_spec(vocab_size: int, tp_rank: int, tp_size: int) -> ShardSpec:
    _, start, held = _vocab_rows(vocab_size, tp_rank, tp_size)
    return ShardSpec(0, vocab_size, ((start, 0, held),))


class VocabParallelEmbedding(VocabEmbedding):
    """Embedding table with the vocabulary split over TP (module docstring)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None,
                 tp_rank: int = 0, tp_size: int = 1,
                 quant_method: QuantizedEmbeddingMethod | None = None) -> None:
        per, start, held = _vocab_rows(num_embeddings, tp_rank, tp_size)
        super().__init__(per if tp_size > 1 else num_embeddings, embedding_dim, dtype, quant_method)
        self.org_vocab_size = num_embeddings
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.vocab_start, self.vocab_end = start, start + held
        if tp_size > 1:
            set_shard_spec(self.weight, _vocab_spec(num_embeddings, tp_rank, tp_size))
            self.weight.weight_loader = _full_loader  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``input_ids`` (summed over TP)."""
        if self.tp_size == 1:
            return super().forward(input_ids)
        inside = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(inside, input_ids - self.vocab_start, 0)
        rows = self.lookup(local)
        out = rows * inside.unsqueeze(-1).to(rows.dtype)
        return tensor_model_parallel_all_reduce(out, self.tp_size)


def _full_loader(param: torch.Tensor, loaded: Any, shard_id: Hashable | None = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} takes no shard id, got {shard_id!r}")
    copy_full(param, loaded)


class ParallelLMHead(LMHead):
    """LM head with the vocabulary split over TP; logits gathered over TP (module docstring).

    Tied to a :class:`VocabParallelEmbedding`, it shares that table's shard.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tie_to: VocabEmbedding | None = None, tp_rank: int = 0, tp_size: int = 1,
                 quant_method: QuantizedLinearMethod | None = None) -> None:
        per, _, _ = _vocab_rows(vocab_size, tp_rank, tp_size)
        super().__init__(per if tp_size > 1 else vocab_size, hidden_size, dtype, tie_to, quant_method)
        self.org_vocab_size = vocab_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        if tp_size > 1 and tie_to is None:
            set_shard_spec(self.weight, _vocab_spec(vocab_size, tp_rank, tp_size))
            self.weight.weight_loader = _full_loader  # type: ignore[attr-defined]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits over the whole vocabulary."""
        logits = super().forward(hidden_states)
        if self.tp_size == 1:
            return logits
        gathered = tensor_model_parallel_all_gather(logits, self.tp_size, dim=-1)
        return gathered[..., : self.org_vocab_size]


def tp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that are split over TP ranks."""
    kinds = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead)
    return [m for m in model.modules() if isinstance(m, kinds) and getattr(m, "tp_size", 1) > 1]
