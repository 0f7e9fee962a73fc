"""Collectives as registered torch ops, so compiled graphs keep them as nodes.

``torch.ops.forwardkit.all_reduce(x, group_name)``, ``all_gather(x, dim, world_size,
group_name)`` and ``reduce_scatter(x, dim, world_size, group_name)`` run the collective over
the named group (``"tp"``, ``"dp"``, ``"ep"``, ``"world"``; see
:mod:`forwardkit.distributed.parallel_state`), bounded by the group's timeout. Their fake
implementations give the output shape, so Dynamo traces through them, Inductor leaves them as
extern calls, the piecewise split keeps them inside the pieces, and the sequence-parallelism
pass can find and rewrite them (``all_reduce`` -> ``reduce_scatter`` + ``all_gather``).

The Python helpers (``tensor_model_parallel_all_reduce`` ...) skip the op when the group has
one rank, so a TP-1 model's graph contains no collective at all.
"""

from __future__ import annotations

import torch

from forwardkit.distributed.parallel_state import RankGroup, get_group

__all__ = [
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "sequence_parallel_chunk",
    "sp_all_gather",
    "sp_slice",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]


def _comm_args(group: RankGroup, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(x on the group's communication device, use_cpu)``: the device group for tensors on
    its device, else the CPU (gloo) group."""
    use_cpu = x.device.type != group.device.type
    return (x.cpu() if use_cpu else x), use_cpu


@torch.library.custom_op("forwardkit::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group_name`` (a new tensor)."""
    group = get_group(group_name)
    buf, use_cpu = _comm_args(group, x)
    buf = buf.clone() if buf is x else buf
    group.all_reduce(buf, use_cpu=use_cpu)
    return buf.to(x.device)


@all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("forwardkit::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (equal shapes)."""
    group = get_group(group_name)
    if group.world_size != world_size:
        raise ValueError(f"all_gather over {group_name!r}: the graph was traced for "
                         f"{world_size} ranks, the group has {group.world_size}")
    buf, use_cpu = _comm_args(group, x)
    stacked = group.all_gather(buf, use_cpu=use_cpu).to(x.device)
    dim = dim % x.dim()
    return torch.cat(list(stacked.unbind(0)), dim=dim) if dim else stacked.flatten(0, 1)


@all_gather.register_fake
def _(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    shape = list(x.shape)
    dim = dim % x.dim()
    shape[dim] = shape[dim] * world_size
    return x.new_empty(shape)


@torch.library.custom_op("forwardkit::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """This rank's ``1/world_size`` part (along ``dim``, in rank order) of the sum of ``x``
    over the group; ``x.shape[dim]`` must divide evenly."""
    group = get_group(group_name)
    if group.world_size != world_size:
        raise ValueError(f"reduce_scatter over {group_name!r}: the graph was traced for "
                         f"{world_size} ranks, the group has {group.world_size}")
    dim = dim % x.dim()
    if x.shape[dim] % world_size:
        raise ValueError(f"reduce_scatter: size {x.shape[dim]} along dim {dim} is not a "
                         f"multiple of {world_size} ranks")
    buf, use_cpu = _comm_args(group, x.movedim(dim, 0))
    part = x.shape[dim] // world_size
    out = group.reduce_scatter_v(buf, [part] * world_size, use_cpu=use_cpu)
    return out.to(x.device).movedim(0, dim).contiguous()


@reduce_scatter.register_fake
def _(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    shape = list(x.shape)
    dim = dim % x.dim()
    shape[dim] = shape[dim] // world_size
    return x.new_empty(shape)


@torch.library.custom_op("forwardkit::sequence_parallel_chunk", mutates_args=())
def sequence_parallel_chunk(x: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s slice of ``x``'s rows: ``x`` padded with zero rows to a multiple of
    ``tp_size``, cut into ``tp_size`` equal contiguous parts (``ceil(rows / tp)`` rows each).
    An op (not traced) so a compiled graph keeps one shape rule for every token count."""
    rows = -(-x.shape[0] // tp_size)
    out = x.new_zeros((rows, *x.shape[1:]))
    part = x[tp_rank * rows : (tp_rank + 1) * rows]
    out[: part.shape[0]] = part
    return out


@sequence_parallel_chunk.register_fake
def _(x: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    return x.new_empty(((x.shape[0] + tp_size - 1) // tp_size, *x.shape[1:]))


@torch.library.custom_op("forwardkit::sp_slice", mutates_args=())
def sp_slice(x: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s ``1/tp_size`` of ``x``'s rows (the row count must divide): the
    rows a reduce-scatter would leave on this rank, without communicating."""
    if x.shape[0] % tp_size:
        raise ValueError(f"sp_slice: {x.shape[0]} rows are not a multiple of {tp_size} (token "
                         "counts are padded to a multiple of TP with sequence parallelism)")
    rows = x.shape[0] // tp_size
    return x[tp_rank * rows : (tp_rank + 1) * rows].clone()


@sp_slice.register_fake
def _(x: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    return x.new_empty((x.shape[0] // tp_size, *x.shape[1:]))


@torch.library.custom_op("forwardkit::sp_all_gather", mutates_args=())
def sp_all_gather(x: torch.Tensor, rows: int, world_size: int, group_name: str) -> torch.Tensor:
    """Every rank's rows of ``x`` concatenated along dim 0: the inverse of a reduce-scatter or
    a :func:`sequence_parallel_chunk` of a ``rows``-row tensor (``rows`` a multiple of
    ``world_size``). ``rows`` is the full tensor's row count, so a compiled graph keeps the
    full tensor's (symbolic) size."""
    out = all_gather(x, 0, world_size, group_name)
    if out.shape[0] != rows:
        raise ValueError(f"sp_all_gather: gathered {out.shape[0]} rows, expected {rows} (token "
                         f"counts must be a multiple of {world_size} with sequence parallelism)")
    return out


@sp_all_gather.register_fake
def _(x: torch.Tensor, rows: int, world_size: int, group_name: str) -> torch.Tensor:
    return x.new_empty((rows, *x.shape[1:]))


def tensor_model_parallel_all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum ``x`` over the TP group (``x`` itself when ``tp_size`` is 1)."""
    if tp_size == 1:
        return x
    return torch.ops.forwardkit.all_reduce(x, "tp")


def tensor_model_parallel_all_gather(x: torch.Tensor, tp_size: int, dim: int = -1) -> torch.Tensor:
    """The TP ranks' ``x`` concatenated along ``dim`` (``x`` itself when ``tp_size`` is 1)."""
    if tp_size == 1:
        return x
    return torch.ops.forwardkit.all_gather(x, dim, tp_size, "tp")
