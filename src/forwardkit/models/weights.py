"""Copying Hugging Face-named tensors into a model's parameters, with complete error reports."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Hashable, Iterable
from typing import Any, cast

import torch
import torch.nn as nn

from forwardkit.layers.fused_moe import FusedMoE
from forwardkit.layers.linear import (
    Linear,
    LMHead,
    MergedLinear,
    VocabEmbedding,
    WeightShapeError,
    quantized_layers,
)
from forwardkit.layers.parallel import TensorSource, materialize, set_shard_spec, shard_spec_of

__all__ = [
    "WeightLoadError", "check_named_weights", "expected_shards", "load_named_weights", "missing_parameters",
    "quantize_remaining",
]

_LIST_LIMIT = 20


class WeightLoadError(ValueError):
    """The checkpoint does not fit the model: names the missing, unexpected and mis-shaped tensors."""

    def __init__(
        self,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        mismatched: list[str] | None = None,
        source: str = "checkpoint",
    ) -> None:
        self.missing, self.unexpected, self.mismatched = missing or [], unexpected or [], mismatched or []
        parts = []
        for label, items in (
            ("missing tensors", self.missing),
            ("unexpected tensors", self.unexpected),
            ("tensors with the wrong shape", self.mismatched),
        ):
            if items:
                shown = ", ".join(items[:_LIST_LIMIT]) + (f", ... ({len(items)} in all)" if len(items) > _LIST_LIMIT else "")
                parts.append(f"{label}: {shown}")
        super().__init__(f"{source} does not match the model: " + "; ".join(parts))


def expected_shards(module: nn.Module, param_name: str) -> set[Hashable] | None:
    """Shard ids that must all be loaded for ``param_name`` of ``module`` to be complete.

    None means "one whole tensor". Expert weights also accept one stacked tensor.
    """
    if isinstance(module, MergedLinear):
        return set(module.shard_offsets)
    if isinstance(module, FusedMoE):
        local = range(module.expert_start, module.expert_start + module.num_local_experts)
        if param_name == "w13_weight":
            return {(e, w) for e in local for w in ("w1", "w3")}
        return {(e, "w2") for e in local}
    return None


def _is_complete(module: nn.Module, leaf: str, got: set[Hashable]) -> bool:
    need = expected_shards(module, leaf)
    if need is None:
        return None in got
    if isinstance(module, FusedMoE) and (leaf.removesuffix("_weight") in got):
        return True  # one stacked tensor held every expert
    return need <= got


def _meta_twin(tensor: torch.Tensor | TensorSource) -> torch.Tensor:
    """A storage-less tensor of the same shape and dtype (loaders run on it without copying)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def _param_twin(param: torch.Tensor) -> torch.Tensor:
    """A meta twin of a parameter that keeps its tensor-parallel shard layout."""
    twin = _meta_twin(param)
    spec = shard_spec_of(param)
    if spec is not None:
        set_shard_spec(twin, spec)
    return twin


def check_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    map_name: Callable[[str], tuple[str, Any] | None],
) -> set[str]:
    """Dry run of :func:`load_named_weights`: same name mapping and ``weight_loader`` calls, but
    on storage-less (meta) twins of the parameters, so nothing in ``model`` changes.

    Raises :class:`WeightLoadError` for unknown names and wrong shapes; returns the parameter
    names a real load would complete.
    """
    return load_named_weights(model, weights, map_name, dry_run=True)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    map_name: Callable[[str], tuple[str, Any] | None],
    dry_run: bool = False,
) -> set[str]:
    """Copy each ``(hf_name, tensor)`` to the parameter ``map_name`` names (None: skip).

    Returns the names of parameters that are now completely loaded. Unexpected names and shape
    mismatches are collected and raised together as :class:`WeightLoadError`. The weight of a
    layer with a quant method is quantized as soon as all of it is loaded (one projection at a
    time at full precision). ``dry_run``
    (see :func:`check_named_weights`) runs every loader on meta twins and copies nothing.
    """
    real: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    params = real
    caught: tuple[type[Exception], ...] = (WeightShapeError,)
    if dry_run:
        twins = {id(p): _param_twin(p) for p in real.values()}
        params = {name: twins[id(p)] for name, p in real.items()}
        caught = (WeightShapeError, ValueError)  # a real load would stop at any loader error
    owners = {name: model.get_submodule(name.rpartition(".")[0]) for name in params}
    coverage: dict[str, set[Hashable]] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    for hf_name, tensor in weights:
        mapped = map_name(hf_name)
        if mapped is None:
            continue
        name, shard = mapped
        param = params.get(name)
        if param is None:
            unexpected.append(hf_name)
            continue
        loader = getattr(real[name], "weight_loader", None)
        if dry_run:
            tensor = _meta_twin(tensor)
        try:
            if loader is None:
                if shard is not None:
                    raise WeightShapeError(f"parameter takes no shard, got {shard!r}")
                if tuple(param.shape) != tuple(tensor.shape):
                    raise WeightShapeError(f"expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
                with torch.no_grad():
                    param.data.copy_(materialize(tensor))
            else:
                loader(param, tensor, shard) if shard is not None else loader(param, tensor)
        except caught as exc:
            mismatched.append(f"{hf_name} ({exc})")
            continue
        coverage.setdefault(name, set()).add(shard)
        owner = owners[name]
        if (not dry_run and isinstance(owner, (Linear, LMHead, VocabEmbedding))
                and owner.quant_method is not None and name.rpartition(".")[2] == "weight"
                and _is_complete(owner, "weight", coverage[name])):
            # quantize each projection (and the embedding / head) as soon as it is whole, point
            # every layer sharing the weight (a tied head) at the packed one, and drop this
            # function's references to the full-precision staging weight so it is freed now
            packed = _quantize(owner, name)
            for alias in [n for n, p in real.items() if p is param]:
                real[alias] = params[alias] = packed
                setattr(owners[alias], alias.rpartition(".")[2], packed)
            param = tensor = packed  # the last references to the staging weight and the read tensor
            return_freed_memory()
    if unexpected or mismatched:
        raise WeightLoadError(unexpected=unexpected, mismatched=mismatched)
    return {
        name
        for name, got in coverage.items()
        if _is_complete(owners[name], name.rpartition(".")[2], got)
    }


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)  # glibc only
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return cast(Callable[[int], int], trim)


def return_freed_memory() -> None:
    """Give the memory of freed tensors back to the system. glibc keeps freed blocks below its
    (dynamically raised) mmap threshold in the heap, resident, so the freed full-precision
    staging weights of a quantized load would stay in the process's resident set; trimming
    after each quantized weight keeps the load's peak near the packed model's size."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _quantize(layer: Linear | LMHead | VocabEmbedding, name: str) -> nn.Parameter:
    """Pack ``layer``'s loaded weight by its quant method; returns the packed parameter."""
    if isinstance(layer, VocabEmbedding):
        assert layer.quant_method is not None
        return layer.quant_method.process_weights_after_loading(layer, name)
    assert layer.quant_method is not None
    return layer.quant_method.process_weights_after_loading(layer, name)


def quantize_remaining(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Quantize every weight of ``model`` whose layer has a quant method and which is still at
    full precision (seeded random weights; a checkpoint's were packed as they loaded), one at a
    time; a weight shared by several layers (a tied head and its embedding) is packed once, by
    its first layer's method, and every sharing layer points at it. Returns ``(name, packed
    weight)`` of every distinct packed weight of the model's quantized layers."""
    layers = quantized_layers(model)
    done: dict[int, nn.Parameter] = {}
    out: list[tuple[str, nn.Parameter]] = []
    for name, layer in layers:
        staging = layer.weight
        if id(staging) in done:
            layer.weight = done[id(staging)]
            continue
        packed = _quantize(layer, f"{name}.weight")
        done[id(staging)] = done[id(packed)] = packed
        out.append((f"{name}.weight", packed))
    return out


def missing_parameters(model: nn.Module, loaded: set[str]) -> list[str]:
    """Parameters of ``model`` not in ``loaded`` (a tied parameter counts once, under any name)."""
    loaded_ids = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in loaded}
    return [n for n, p in model.named_parameters() if id(p) not in loaded_ids]
