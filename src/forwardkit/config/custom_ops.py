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

**One switch per native CPU kernel.** Each native kernel of ``kernels/cpu/`` is switched by
exactly one custom op, decided once when a layer is built; the kernels themselves never read a
switch:

* the native few-row linear (``native_linear``) by ``cpu_linear``: a layer built with the op on
  calls ``forwardkit::linear``, whose router takes the kernel where it applies (and oneDNN's
  packed copies elsewhere); ``"-cpu_linear"`` gives plain ``F.linear``;
* the native quantized linear (``native_quant``) by ``cpu_linear`` too: a quantized projection
  is a ``cpu_linear`` layer whose weight is packed; with the op on it calls
  ``forwardkit::quant_linear`` (the native kernels), with ``"-cpu_linear"`` its native form
  (dequantize, then ``F.linear``, in plain torch). One switch for every linear kernel, as one
  projection is either packed or not;
* the native paged decode attention (``native_attention``) by ``cpu_attention``.

The old environment variables ``FORWARDKIT_CPU_NATIVE_LINEAR`` / ``FORWARDKIT_CPU_NATIVE_ATTENTION``
are deprecated: :func:`apply_kernel_switch_env` reads them once, at engine-config resolution,
into this list (``=0`` adds ``"-cpu_linear"`` / ``"-cpu_attention"`` unless the list already
names the op, which then wins), with a warning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from forwardkit import envs
from forwardkit.logger import init_logger

__all__ = [
    "CUSTOM_OP_REGISTRY",
    "KERNEL_SWITCH_ENV",
    "ON_UNLESS_DISABLED",
    "apply_kernel_switch_env",
    "custom_ops_default",
    "custom_ops_default_on",
    "is_custom_op_enabled",
]

logger = init_logger(__name__)

CUSTOM_OP_REGISTRY: dict[str, Any] = {}
"""Registered custom-op name -> class (filled by ``CustomOp.register``)."""

ON_UNLESS_DISABLED: frozenset[str] = frozenset({"cpu_attention", "cpu_linear"})
"""Custom ops on whatever ``"all"`` / ``"none"`` say, unless ``"-name"`` (module doc)."""

KERNEL_SWITCH_ENV: dict[str, str] = {
    "FORWARDKIT_CPU_NATIVE_LINEAR": "cpu_linear",
    "FORWARDKIT_CPU_NATIVE_ATTENTION": "cpu_attention",
}
"""Deprecated environment variable -> the custom op that is its native kernels' one switch."""


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


def apply_kernel_switch_env(custom_ops: list[str]) -> None:
    """Read the deprecated kernel switches of :data:`KERNEL_SWITCH_ENV` into ``custom_ops`` (in
    place; engine-config resolution calls it once per config, so a variable changed later
    reaches the next config, never a cached kernel). A variable set to a false value appends
    ``"-name"``; one set to a true value changes nothing (the op is on by default). When the
    list already names the op (``"+name"`` / ``"-name"``), the list wins. Each case logs one
    deprecation warning naming the variable, its value and the ``custom_ops`` entry that
    replaces it; a list that already says what the variable says (a resolved config resolved
    again) logs nothing."""
    for var, name in KERNEL_SWITCH_ENV.items():
        if not envs.is_set(var):
            continue
        on = bool(envs.environment_variables[var]())  # a malformed value: ValueError naming it
        named_on, named_off = f"+{name}" in custom_ops, f"-{name}" in custom_ops
        if named_on or named_off:
            if named_on != on:
                logger.warning_once(
                    "%s=%s is deprecated and ignored here: compilation_config.custom_ops has %r, "
                    "the one switch of the native kernels behind the %s custom op",
                    var, "1" if on else "0", f"+{name}" if named_on else f"-{name}", name)
            continue
        if on:
            logger.warning_once(
                "%s=1 is deprecated and changes nothing: the %s custom op (and its native "
                "kernels) is on unless compilation_config.custom_ops has %r", var, name, f"-{name}")
            continue
        custom_ops.append(f"-{name}")
        logger.warning_once(
            "%s=0 is deprecated: read as compilation_config.custom_ops entry %r (the one switch "
            "of the native kernels behind the %s custom op); set that instead", var, f"-{name}", name)
