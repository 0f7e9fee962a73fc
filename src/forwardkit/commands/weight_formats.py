"""The format each weight of a model is held in, as ``forwardkit config`` shows it: for a model
quantized on load (``--quantization``) and for a GGUF file, grouped so that decoder layers with
the same formats print as one line (``layers 0-15``).

The facts come from where the load decides them, never from a second copy of the rules: a
model quantized on load is built on the meta device (no weight memory) and each parameter's
format read from its layer's quant method; a GGUF file's tensors go through the GGUF loader's
own plan (``models.gguf_loader.gguf_tensor_plan``: which tensors stay packed, in which format).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig

__all__ = ["LayerGroup", "WeightFormats", "weight_formats"]

_LAYER = re.compile(r"^(?:model\.layers|blk)\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class LayerGroup:
    """Consecutive decoder layers ``first``..``last`` whose weights have the same formats."""

    first: int
    last: int
    formats: tuple[tuple[str, str], ...]  # (name inside the layer, format), in model order

    def by_format(self) -> str:
        """``"q4_0: a, b; bfloat16: c"``: the layer's weights grouped by format."""
        grouped: dict[str, list[str]] = {}
        for name, fmt in self.formats:
            grouped.setdefault(fmt, []).append(name)
        return "; ".join(f"{fmt}: {', '.join(names)}" for fmt, names in grouped.items())


@dataclass(frozen=True)
class WeightFormats:
    """The formats of a model's weights: the ones outside the decoder layers, and the layers in
    groups."""

    source: str  # "quantized on load" or "GGUF file"
    outside: tuple[tuple[str, str], ...]
    layers: tuple[LayerGroup, ...]

    def to_dict(self) -> dict[str, object]:
        """JSON-able form."""
        return {"source": self.source, "outside_layers": dict(self.outside),
                "layers": [{"layers": [g.first, g.last], "formats": dict(g.formats)}
                           for g in self.layers]}

    def text_rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` rows for the text output."""
        rows = [("weights", f"{self.source}: " + "; ".join(f"{n} {f}" for n, f in self.outside))]
        for g in self.layers:
            label = f"  layer {g.first}" if g.first == g.last else f"  layers {g.first}-{g.last}"
            rows.append((label, g.by_format()))
        return rows


def _group(named: list[tuple[str, str]], source: str) -> WeightFormats:
    outside: list[tuple[str, str]] = []
    per_layer: dict[int, list[tuple[str, str]]] = {}
    for name, fmt in named:
        match = _LAYER.match(name)
        if match is None:
            outside.append((name, fmt))
        else:
            per_layer.setdefault(int(match.group(1)), []).append((match.group(2), fmt))
    groups: list[LayerGroup] = []
    for index in sorted(per_layer):
        formats = tuple(per_layer[index])
        last = groups[-1] if groups else None
        if last is not None and last.last == index - 1 and last.formats == formats:
            groups[-1] = LayerGroup(last.first, index, formats)
        else:
            groups.append(LayerGroup(index, index, formats))
    return WeightFormats(source, tuple(outside), tuple(groups))


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _quantized_on_load(cfg: EngineConfig) -> WeightFormats:
    import torch

    from forwardkit.config.engine import set_current_engine_config
    from forwardkit.config.frozen import thawed_copy
    from forwardkit.layers.fused_moe import FusedMoE
    from forwardkit.layers.linear import VocabEmbedding, quantized_layers
    from forwardkit.models import get_model_class
    from forwardkit.quantization.formats import BlockShapeError
    from forwardkit.quantization.linear_method import (
        QuantizedEmbeddingMethod,
        QuantizedLinearMethod,
    )

    model_config = cfg.require_model_config()
    copy = thawed_copy(cfg)  # building registers layers in the config's run-time state
    with set_current_engine_config(copy), torch.device("meta"):
        model = get_model_class(model_config.architectures)(copy)
    packed: dict[int, str] = {}
    for name, layer in quantized_layers(model):
        method = layer.quant_method
        assert method is not None
        packed[id(layer.weight)] = method.format.name
        try:
            if isinstance(layer, VocabEmbedding):
                assert isinstance(method, QuantizedEmbeddingMethod)
                method.check_shape(layer, name)
            else:
                assert isinstance(method, QuantizedLinearMethod)
                method.check_shape(layer, name)
        except BlockShapeError:  # the load refuses it, naming it
            packed[id(layer.weight)] = f"{method.format.name} refused (rows not whole 32-weight blocks)"
    for module in model.modules():  # MoE experts: packed in the projections' format on load
        if isinstance(module, FusedMoE) and module.quant_format is not None:
            packed[id(module.w13_weight)] = packed[id(module.w2_weight)] = module.quant_format
    seen: dict[int, str] = {}
    named: list[tuple[str, str]] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        fmt = packed.get(id(param), _dtype_name(param.dtype))
        if id(param) in seen:
            fmt = f"{fmt} (the table of {seen[id(param)]})"
        else:
            seen[id(param)] = name
        named.append((name, fmt))
    return _group(named, f"quantized on load ({model_config.quantization})")


def _gguf(cfg: EngineConfig) -> WeightFormats:
    from forwardkit.config.gguf import open_gguf
    from forwardkit.models.gguf_loader import gguf_tensor_plan

    model_config = cfg.require_model_config()
    assert model_config.model is not None
    plans = gguf_tensor_plan(open_gguf(model_config.model), model_config.hf_config)
    dtype = _dtype_name(model_config.dtype)
    tied = bool(model_config.hf_config.get("tie_word_embeddings"))
    named: list[tuple[str, str]] = []
    for plan in plans:
        held = plan.packed_format or dtype
        named.append((plan.tensor.name, plan.type_name if held.upper() == plan.type_name
                      else f"{plan.type_name} as {held}"))
        if plan.tensor.name == "token_embd.weight" and tied:  # the head shares the table
            named.append(("output (tied)", f"the table of token_embd.weight ({named[-1][1]})"))
    return _group(named, "GGUF file")


def weight_formats(cfg: EngineConfig) -> WeightFormats | None:
    """The weight formats of ``cfg``'s model when it is quantized on load or a GGUF file;
    None otherwise (every weight in the model's dtype)."""
    from forwardkit.config.gguf import is_gguf_path

    model_config = cfg.require_model_config()
    if is_gguf_path(model_config.model):
        return _gguf(cfg)
    if model_config.quantization is not None:
        return _quantized_on_load(cfg)
    return None
