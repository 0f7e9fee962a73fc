"""The ``Attention`` layer and the opaque attention custom ops that read the forward context.

The model graph only ever sees ``torch.ops.forwardkit.unified_attention_with_output(q, k, v,
output, layer_name)`` (or ``unified_attention``): plain tensors and a layer-name string. The
per-step state is looked up at run time:

1. ``ctx = get_forward_context()``;
2. ``md = ctx.attn_metadata[layer_name]`` (None, or no metadata: profile / warm-up run -> zeros);
3. ``layer = ctx.no_compile_layers[layer_name]``;
4. ``kv_cache = layer.kv_cache[ctx.virtual_engine]``;
5. ``layer.backend.forward(layer, q, k, v, kv_cache, md, output)`` runs (the layer's
   :class:`~forwardkit.layers.attention_backend.AttentionBackend`, chosen at construction by
   ``get_attention_backend``).

So nothing per-step is baked into a compiled graph. Both ops are tagged
``torch.Tag.cudagraph_unsafe`` and have fake implementations for tracing.

``Attention`` is the ``cpu_attention`` custom op: built on the CPU with it on (on unless
``compilation_config.custom_ops`` has ``"-cpu_attention"``, like ``cpu_linear``; see
``config/custom_ops.py``), its ``native_decode`` is True and the backend attends its decode
requests with the native CPU kernel (``kernels/cpu/native_attention.py``) where that applies.
Both forms call the same opaque op, so the traced graph is the same; the decision is made once,
at construction, and ``custom_ops`` is part of the compile hash.
"""

from __future__ import annotations

import torch

from forwardkit.compilation.custom_op import CustomOp
from forwardkit.config.engine import get_current_engine_config
from forwardkit.forward_context import StepAttentionMetadata, get_forward_context
from forwardkit.layers.attention_backend import (
    AttentionBackend,
    AttentionMetadata,
    build_attention_metadata,
    get_attention_backend,
)

__all__ = [
    "Attention",
    "AttentionMetadata",
    "build_attention_metadata",
    "unified_attention",
    "unified_attention_with_output",
]

_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _lookup(layer_name: str) -> tuple[Attention, StepAttentionMetadata | None, torch.Tensor]:
    ctx = get_forward_context()
    try:
        layer = ctx.no_compile_layers[layer_name]
    except KeyError:
        raise KeyError(
            f"attention layer {layer_name!r} is not registered in the forward context's "
            f"no_compile_layers ({len(ctx.no_compile_layers)} layers); was the model built under "
            "this engine config?"
        ) from None
    raw: object = ctx.attn_metadata
    md: StepAttentionMetadata | None
    if isinstance(raw, dict):
        md = raw.get(layer_name)
    elif raw is None or isinstance(raw, layer.backend.metadata_cls):
        md = raw
    else:
        raise TypeError(
            f"attn_metadata must be a dict of layer name -> {layer.backend.metadata_cls.__name__} "
            f"or None, got {type(raw).__name__}"
        )
    kv_cache = layer.kv_cache[ctx.virtual_engine]
    return layer, md, kv_cache


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    layer, md, kv_cache = _lookup(layer_name)
    if md is None:
        output.zero_()
        return
    if kv_cache.numel() == 0:
        raise RuntimeError(
            f"KV cache of attention layer {layer_name!r} is not bound; call "
            "forwardkit.layers.kv_cache.bind_kv_cache(...) before running with attention metadata"
        )
    t = q.shape[0]
    layer.backend.forward(
        layer,
        q.view(t, layer.num_heads, layer.head_size),
        k.view(t, layer.num_kv_heads, layer.head_size),
        v.view(t, layer.num_kv_heads, layer.head_size),
        kv_cache,
        md,
        output.view(t, layer.num_heads, layer.head_size),
    )


# NOTE: defined through ``torch.library.Library`` rather than ``torch.library.custom_op``: the
# latter wraps a mutating op in Python autograd / alias-check layers that cost ~15 us per call
# (once per layer per step); this registration dispatches straight to the kernel (~2 us).
_LIB = torch.library.Library("forwardkit", "FRAGMENT")
_LIB.define(
    "unified_attention_with_output(Tensor q, Tensor k, Tensor v, Tensor(a!) output, str layer_name) -> ()",
    tags=_TAGS,
)
_LIB.define("unified_attention(Tensor q, Tensor k, Tensor v, str layer_name) -> Tensor", tags=_TAGS)


def _with_output_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor,
                        layer_name: str) -> None:
    _run(q, k, v, output, layer_name)


def _functional_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_name: str) -> torch.Tensor:
    output = torch.empty_like(q)
    _run(q, k, v, output, layer_name)
    return output


_LIB.impl("unified_attention_with_output", _with_output_kernel, "CompositeExplicitAutograd")
_LIB.impl("unified_attention", _functional_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("forwardkit::unified_attention_with_output", lib=_LIB)
def _(q, k, v, output, layer_name) -> None:
    return None


@torch.library.register_fake("forwardkit::unified_attention", lib=_LIB)
def _(q, k, v, layer_name) -> torch.Tensor:
    return torch.empty_like(q)


def unified_attention_with_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer_name: str
) -> None:
    """Attention of ``q`` [T, Hq*D] over the layer's paged cache, written into ``output``.

    Calls the registered op ``torch.ops.forwardkit.unified_attention_with_output``.
    """
    torch.ops.forwardkit.unified_attention_with_output(q, k, v, output, layer_name)


def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_name: str) -> torch.Tensor:
    """Functional form of :func:`unified_attention_with_output`: returns [T, Hq*D]."""
    return torch.ops.forwardkit.unified_attention(q, k, v, layer_name)


@CustomOp.register("cpu_attention")
class Attention(CustomOp):
    """Decoder self-attention over a paged KV cache, registered under its ``prefix``.

    ``forward(q[T, Hq*D], k[T, Hk*D], v[T, Hk*D]) -> [T, Hq*D]``. Rotary embedding is applied
    by the caller. ``kv_cache`` holds one placeholder until ``bind_kv_cache`` sets ``[tensor]``.
    ``backend``: the attention backend class; None = the one the current engine config selects
    (``EngineConfig.attention_backend``: ``FORWARDKIT_ATTENTION_BACKEND``, else ``TORCH_NATIVE``).
    ``native_decode``: whether the backend may attend this layer's decode requests with the
    native CPU kernel (the ``cpu_attention`` custom op, chosen at construction; module doc).
    """

    backend: type[AttentionBackend]

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        prefix: str = "",
        use_output: bool = True,
        backend: type[AttentionBackend] | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or head_size <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"invalid attention shape: num_heads={num_heads}, num_kv_heads={num_kv_heads}, "
                f"head_size={head_size} (need positive sizes and num_heads % num_kv_heads == 0)"
            )
        if not prefix:
            raise ValueError("Attention needs a non-empty, unique prefix (its layer name)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = float(scale)
        self.layer_name = prefix
        self.use_output = use_output
        self.attn_type = "decoder"
        self.kv_cache: list[torch.Tensor] = [torch.tensor([])]
        config = get_current_engine_config()
        # the backend the engine config selected (its support level decided the graph mode)
        self.backend = get_attention_backend(config.attention_backend) if backend is None else backend
        # the cpu_attention custom op: on, on the CPU (CustomOp chose forward_cpu)
        self.native_decode = self.forward_form == "cpu"

        context = config.compilation_config.compile_state.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def forward_native(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Run the opaque attention op for this layer (decodes by the torch ops)."""
        return self._attention_op(query, key, value)

    def forward_cpu(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Run the opaque attention op for this layer (decodes by the native kernel where it
        applies: the op's backend reads ``native_decode``)."""
        return self._attention_op(query, key, value)

    def _attention_op(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if self.use_output:
            output = torch.empty_like(query)
            torch.ops.forwardkit.unified_attention_with_output(query, key, value, output, self.layer_name)
            return output
        return torch.ops.forwardkit.unified_attention(query, key, value, self.layer_name)

    def extra_repr(self) -> str:
        return (
            f"name={self.layer_name}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}"
        )
