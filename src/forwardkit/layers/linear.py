"""Linear layers, vocabulary embedding and LM head (single device, no tensor parallelism).

Each parameter carries a ``weight_loader(param, tensor, shard_id=None)`` so model
``load_weights`` can copy Hugging Face tensors in, including into merged projections
(``q``/``k``/``v`` -> ``qkv_proj``; gate/up -> ``gate_up_proj``). A shape mismatch raises
:class:`WeightShapeError` naming the expected and given shapes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from forwardkit.layers import cpu_gemm
from forwardkit.logger import init_logger

__all__ = ["Linear", "LMHead", "MergedLinear", "VocabEmbedding", "WeightShapeError", "copy_weight",
           "prepack_weights"]

logger = init_logger(__name__)


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape of the parameter (slice) it is loaded into."""


def copy_weight(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``target`` (casting dtype); shapes must match exactly. ``loaded``
    may also be a lazily read source (``layers.parallel.TensorSource``), read here."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise WeightShapeError(f"expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}")
    if not isinstance(loaded, torch.Tensor):
        loaded = loaded.materialize()
    with torch.no_grad():
        target.copy_(loaded)
    cpu_gemm.refresh_packed(target)  # a packed copy of the weight is re-derived


def _default_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} takes no shard id, got {shard_id!r}")
    copy_weight(param.data, loaded)


class Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` [out, in] (HF layout)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.packed = False  # set by prepack_weights: run through the packed oneDNN copy

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        """Copy a whole HF tensor into ``param``."""
        _default_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the projection."""
        if self.packed:
            return torch.ops.forwardkit.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (one matmul).

    ``shards`` maps a shard id (e.g. ``"q"``, ``"k"``, ``"v"`` or ``0``, ``1``) to its output
    size, in output order; ``weight_loader(param, tensor, shard_id)`` fills one shard.
    """

    def __init__(self, input_size: int, shards: Sequence[tuple[Hashable, int]], bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        self.shard_offsets: dict[Hashable, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shards:
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        super().__init__(input_size, offset, bias=bias, dtype=dtype)
        self.output_sizes = [size for _, size in shards]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        """Copy one shard (``shard_id``) into its rows of ``param``."""
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard id {shard_id!r}; expected one of {list(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard_id]
        copy_weight(param.data.narrow(0, offset, size), loaded)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab, hidden]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = _default_loader  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Look up the embeddings of ``input_ids``."""
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Output projection to the vocabulary; ``tie_to`` shares the embedding table's weight."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tie_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
            self.weight.weight_loader = _default_loader  # type: ignore[attr-defined]
        self.packed = False  # set by prepack_weights

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits in float32."""
        if self.packed:
            return torch.ops.forwardkit.linear(hidden_states, self.weight, None).float()
        return F.linear(hidden_states, self.weight).float()


def prepack_weights(model: nn.Module) -> int:
    """Route every :class:`Linear` and :class:`LMHead` of ``model`` whose weight is float32, or
    bf16 on a CPU with bf16 instructions or the native kernel (AVX2), through ``cpu_gemm``'s fast
    paths (native kernel for 1-2 rows, a oneDNN-packed copy made at first use for more where
    oneDNN has the dtype, else plain ``F.linear``), unless a packed second copy of
    every weight would not fit in the memory available. In a small model (all routed weights
    within ``cpu_gemm.TUNE_MAX_BYTES``) each weight shape's paths are timed against plain
    ``F.linear`` per row bucket, and a weight for which ``F.linear`` wins at every row count is
    left unrouted. Returns the number of layers routed."""
    layers = [m for m in model.modules() if isinstance(m, (Linear, LMHead))]
    todo = [m for m in layers if cpu_gemm.route_supported(m.weight.dtype, m.weight.device)]
    if not todo:
        return 0
    need = sum(m.weight.numel() * m.weight.element_size() for m in todo)
    free = cpu_gemm.available_memory_bytes()
    if free is not None and need > 0.8 * free:
        logger.warning_once("Not prepacking %.1f GiB of linear weights: only %.1f GiB of memory "
                            "is available; linear layers use plain torch matmuls",
                            need / 2**30, free / 2**30)
        return 0
    for module in todo:
        cpu_gemm.register_weight(module.weight)
        module.packed = True
    if cpu_gemm.tuning_applies(need):  # a small model: keep plain F.linear where it is faster
        plain = 0
        for module in todo:
            if not any(cpu_gemm.tune(module.weight, getattr(module, "bias", None))):
                cpu_gemm.unpack_weight(module.weight)  # F.linear at every row count
                module.packed = False
                plain += 1
        logger.info_once("%d of %d small linear weights keep plain F.linear (faster here at "
                         "every row count, timed)", plain, len(todo))
        todo = [m for m in todo if m.packed]
    logger.info_once("%d bf16/float32 linear weights (%.2f GiB) use the native kernel for 1-2 rows and "
                     "oneDNN-packed copies (made at first use; plain F.linear where oneDNN lacks "
                     "the dtype) for more", len(todo), need / 2**30)
    return len(todo)
