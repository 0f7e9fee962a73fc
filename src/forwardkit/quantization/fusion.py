"""The quant fusions of ``PassConfig.fuse_norm_quant`` and ``fuse_act_quant`` on the CPU's
int8-activation path.

A quantized projection (``forwardkit::quant_linear``) rounds its activations per block of 32
to int8 inside the native kernel (a float32 copy of the activations, then a pass over them, per
projection and step). When those activations come straight from an RMSNorm
(``fuse_norm_quant``) or a SiLU-and-mul (``fuse_act_quant``), this pass puts the rounding into
the graph instead: ``quant_linear(x, W)`` becomes
``quant_linear_q8(*quantize_activations(x), W)``, the rounding traced to plain torch ops, so
Inductor computes it in the kernel that computes the norm or the activation (reading ``x``
once, never writing it in float) and the projection reads int8 blocks. Several projections of
the same activations share one rounding. The rounding is the kernels' own
(:func:`~forwardkit.quantization.formats.quantize_activations`, checked bit for bit against
them when a build loads), so the products are those of the unfused op on the same activations
(bf16 activations taken at bf16 precision, as eager holds them). Off by default (the level
table decides, as vLLM's does): measured slower than the kernels' own rounding from 16 rows.

Where no native build serves, the unfused op does not round activations, so the pass leaves
the graph alone. It lives in this layer, beside the kernels it feeds; the compilation layer's
pass manager runs it through ``compilation.pass_registry.FLAG_PASSES``, where the quantized
linear method's module registers a factory that imports this module only when a flag asks for
the pass. Fusions are counted in
``compilation_counter.num_norm_quant_fusions`` / ``num_act_quant_fusions``.
"""

from __future__ import annotations

import operator
from collections import deque

import torch
import torch.fx
from torch._ops import OpOverload

from forwardkit.compilation.counters import compilation_counter
from forwardkit.compilation.fusion import InlineOpaqueOpPass
from forwardkit.compilation.inductor_pass import InductorPass
from forwardkit.kernels.cpu import native_quant
from forwardkit.logger import init_logger
from forwardkit.quantization import formats
from forwardkit.quantization import ops as _ops  # noqa: F401  (registers the ops this pass writes)

__all__ = ["QuantFusionPass", "producer_kind"]

logger = init_logger(__name__)

aten = torch.ops.aten
_NORM = {aten.rsqrt.default}
# SiLU as Inductor's decomposition leaves it: x / (1 + exp(-x))
_ACT = {aten.sigmoid.default, aten.silu.default, aten.exp.default}
_NORM_OPS = ("rms_norm", "fused_add_rms_norm")
_ACT_OPS = ("silu_and_mul",)
_SEARCH = 12  # nodes looked at behind the activations


def _forwardkit_op(target: object) -> str | None:
    if isinstance(target, OpOverload) and target.namespace == "forwardkit":
        return target._opname
    return None


def producer_kind(x: torch.fx.Node) -> str | None:
    """``"norm"`` when the nearest op behind ``x`` that decides it is an RMSNorm (its
    ``rsqrt``, or the opaque ``forwardkit::rms_norm`` / ``fused_add_rms_norm``), ``"act"`` for
    a SiLU-and-mul (``sigmoid`` / ``silu``, or ``forwardkit::silu_and_mul``), else None. The
    search walks back through at most a few nodes and stops at graph inputs and at other
    opaque ops (a projection's output is not its input's norm)."""
    queue, seen = deque([x]), {x}
    while queue and len(seen) <= _SEARCH:
        node = queue.popleft()
        if node.op != "call_function":
            continue
        if node.target in _NORM:
            return "norm"
        if node.target in _ACT:
            return "act"
        name = _forwardkit_op(node.target)
        if name in _NORM_OPS:
            return "norm"
        if name in _ACT_OPS:
            return "act"
        if name is not None:
            continue
        for arg in node.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                queue.append(arg)
    return None


class _InlineQuantize(InlineOpaqueOpPass):
    OPS = ("forwardkit::quantize_activations",)


class QuantFusionPass(InductorPass):
    """``fuse_norm_quant`` (``norm``) and ``fuse_act_quant`` (``act``): see the module doc."""

    def __init__(self, norm: bool, act: bool) -> None:
        self.norm, self.act = norm, act
        self.fired = {"norm": 0, "act": 0}

    def uuid(self) -> str:
        return self.hash_dict({"source": self.hash_source(type(self), producer_kind,
                                                          formats.quantize_activations),
                               "norm": self.norm, "act": self.act})

    def __call__(self, graph: torch.fx.Graph) -> None:
        linear = torch.ops.forwardkit.quant_linear.default
        nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is linear]
        if not nodes or not native_quant.available():
            return
        rounded: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for node in nodes:
            kind = self._fusable(node)
            if kind is None:
                continue
            x = node.args[0]
            assert isinstance(x, torch.fx.Node)
            if x not in rounded:
                rounded[x] = self._round(graph, x, before=node)
            q, d, s = rounded[x]
            _, packed, bias, fmt = node.args
            out = node.meta["val"]
            with graph.inserting_before(node):
                fused = graph.call_function(torch.ops.forwardkit.quant_linear_q8.default,
                                            (q, d, s, packed, bias, fmt))
                fused.meta["val"] = out.to(torch.float32)
                result = fused
                if out.dtype != torch.float32:  # the float call's cast of its float32 result
                    result = graph.call_function(torch.ops.prims.convert_element_type.default,
                                                 (fused, out.dtype))
                    result.meta["val"] = out
            node.replace_all_uses_with(result)
            graph.erase_node(node)
            self.fired[kind] += 1
            if kind == "norm":
                compilation_counter.num_norm_quant_fusions += 1
            else:
                compilation_counter.num_act_quant_fusions += 1
        if rounded:
            _InlineQuantize()(graph)
        logger.debug("quant fusions: %s", self.fired)

    def _fusable(self, node: torch.fx.Node) -> str | None:
        if len(node.args) != 4 or node.kwargs:  # the model calls it positionally
            return None
        x, fmt = node.args[0], node.args[3]
        if not isinstance(x, torch.fx.Node):
            return None
        val = x.meta.get("val")
        # float32 or bf16 (whose rounding the traced quantizer redoes in integers: see
        # formats.quantize_activations); an fp16 intermediate Inductor keeps wider is not
        if (not isinstance(val, torch.Tensor) or val.device.type != "cpu"
                or val.dtype not in (torch.float32, torch.bfloat16)
                or fmt not in native_quant.FORMATS):
            return None
        k = val.shape[-1]
        if not isinstance(k, int) or k % formats.BLOCK:
            return None
        kind = producer_kind(x)
        if (kind == "norm" and self.norm) or (kind == "act" and self.act):
            return kind
        return None

    @staticmethod
    def _round(graph: torch.fx.Graph, x: torch.fx.Node, before: torch.fx.Node) -> list[torch.fx.Node]:
        """``forwardkit::quantize_activations(x)`` before ``before``: its three outputs."""
        val = x.meta["val"]
        fake_mode = torch._guards.detect_fake_mode([val])
        if fake_mode is None:
            raise RuntimeError(f"{x}: no fake tensor mode on the activations")
        with fake_mode:
            outs = torch.ops.forwardkit.quantize_activations.default(val)
        with graph.inserting_before(before):
            call = graph.call_function(torch.ops.forwardkit.quantize_activations.default, (x,))
            call.meta["val"] = outs
            parts = []
            for i, out in enumerate(outs):
                part = graph.call_function(operator.getitem, (call, i))
                part.meta["val"] = out
                parts.append(part)
        return parts
