"""The one rule for "is custom op X enabled?", and the registry of custom-op names.

``CompilationConfig.custom_ops`` holds at most one of ``"all"`` / ``"none"`` (the default for
every op) plus ``"+name"`` / ``"-name"`` entries that force one op on or off. Everything that
asks whether an op is on goes through :func:`is_custom_op_enabled`: the compilation config's
method of the same name, the optimisation-level defaults, the engine config's resolution (which
appends the default) and ``forwardkit.compilation.custom_op.CustomOp``.

The rule is pure: it reads only the list, the compilation mode and the backend. When the list
has neither ``"all"`` nor ``"none"`` (it was not resolved by an ``EngineConfig`` yet), the
default the resolution would add decides: ``"none"`` for a compiling mode with the
``inductor`` backend (Inductor fuses the native forms), ``"all"`` otherwise.

The ops in :data:`ON_UNLESS_DISABLED` ignore that default: they are on unless ``"-name"``
disables them. ``cpu_linear`` (linear layers on the CPU calling ``forwardkit::linear``, a
GEMM/GEMV kernel) is one: the ``"none"`` default exists so that Inductor can fuse the native
forms of elementwise ops, but a matrix product gains nothing from Inductor's fusion (it calls
an extern GEMM either way), while the kernel behind the op streams decode weights 1.5-6x
faster. ``cpu_attention`` (the ``Attention`` layer on the CPU attending its decode requests
with the native paged decode-attention kernel, one call per layer instead of a dozen torch ops)
is the other: attention is an opaque op Inductor never sees into, so the default has nothing
to fuse there either. Forwardkit extensions: in vLLM GEMMs are not custom ops at all, and its
attention backends are chosen elsewhere.

:data:`CUSTOM_OP_REGISTRY` maps each registered op name to its class. It lives here, in the
config layer, so that ``CompilationConfig.custom_op_log_check`` can tell a misspelt name from an
op that this model does not use without importing the compilation layer; ``CustomOp.register``
fills it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "CUSTOM_OP_REGISTRY",
    "ON_UNLESS_DISABLED",
    "custom_ops_default",
    "custom_ops_default_on",
    "is_custom_op_enabled",
]

CUSTOM_OP_REGISTRY: dict[str, Any] = {}
"""Registered custom-op name -> class (filled by ``CustomOp.register``)."""

ON_UNLESS_DISABLED: frozenset[str] = frozenset({"cpu_attention", "cpu_linear"})
"""Custom ops on whatever ``"all"`` / ``"none"`` say, unless ``"-name"`` (module doc)."""


def custom_ops_default(mode: Any, backend: str | None) -> str:
    """The entry resolution adds to a ``custom_ops`` list without ``"all"`` / ``"none"``.

    ``"none"`` when ``mode`` compiles (not None / 0) with the ``inductor`` backend (an empty
    backend means ``inductor``), else ``"all"``.
    """
    mode_value = int(getattr(mode, "value", mode)) if mode is not None else 0
    compiles_with_inductor = mode_value != 0 and (backend or "inductor") == "inductor"
    return "none" if compiles_with_inductor else "all"


def custom_ops_default_on(custom_ops: Sequence[str], mode: Any = None,
                          backend: str | None = "inductor") -> bool:
    """Whether ops not named with ``+``/``-`` are on: the list's ``"all"`` / ``"none"``, or
    :func:`custom_ops_default` when it has neither. ValueError when it has both or repeats one.
    """
    n_all, n_none = list(custom_ops).count("all"), list(custom_ops).count("none")
    if n_all + n_none > 1:
        raise ValueError(
            f"custom_ops={list(custom_ops)!r}: can only specify one of 'none' or 'all', exactly once"
        )
    if n_all + n_none == 1:
        return n_all == 1
    return custom_ops_default(mode, backend) == "all"


def is_custom_op_enabled(custom_ops: Sequence[str], name: str, mode: Any = None,
                         backend: str | None = "inductor") -> bool:
    """``(default on or "+name") and not "-name"`` for the op registered as ``name``; for the
    ops in :data:`ON_UNLESS_DISABLED` the default is on.

    ValueError when the list both enables and disables ``name`` (or has both ``"all"`` and
    ``"none"``): such a list has no meaning, so it is refused rather than read one way.
    """
    plus, minus = f"+{name}" in custom_ops, f"-{name}" in custom_ops
    if plus and minus:
        raise ValueError(f"custom_ops={list(custom_ops)!r} both enables and disables {name!r}")
    default_on = custom_ops_default_on(custom_ops, mode, backend) or name in ON_UNLESS_DISABLED
    return (default_on or plus) and not minus
