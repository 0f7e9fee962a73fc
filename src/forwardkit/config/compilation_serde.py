"""``CompilationConfig`` as plain data: the dict behind ``to_dict``/``to_json`` and the
dict-style string behind ``repr``.

Both walk the dataclass fields in declaration order; ``to_dict`` keeps the user-settable ones
(so ``CompilationConfig(**d)`` rebuilds an equal config), ``repr`` leaves out runtime state.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

from forwardkit.config.utils import is_plain_json

if TYPE_CHECKING:
    from forwardkit.config.compilation import CompilationConfig

__all__ = ["compilation_config_repr", "compilation_config_to_dict"]

_REPR_EXCLUDED = frozenset(
    {
        "static_forward_context",
        "enabled_custom_ops",
        "disabled_custom_ops",
        "compilation_time",
        "bs_to_padded_graph_size",
        "traced_files",
    }
)


def compilation_config_to_dict(config: CompilationConfig) -> dict[str, Any]:
    """The user-settable fields as plain JSON-able values (see ``CompilationConfig.to_dict``)."""
    out: dict[str, Any] = {}
    for f in fields(config):
        if not f.init:
            continue
        value = getattr(config, f.name)  # every field, by name
        if f.name == "mode":
            value = None if value is None else int(value)
        elif f.name == "cudagraph_mode":
            value = None if value is None else value.name
        elif f.name == "debug_dump_path":
            value = None if value is None else str(value)
        elif f.name == "inductor_compile_config":
            value = {k: v for k, v in value.items()
                     if k not in config.inductor_passes and is_plain_json(v)}
        elif f.name in ("pass_config", "dynamic_shapes_config"):
            value = value.to_dict()
        elif isinstance(value, (list, dict)):
            value = type(value)(value)
        out[f.name] = value
    return out


def compilation_config_repr(config: CompilationConfig) -> str:
    """A dict-style string of the fields in declaration order (runtime state left out)."""
    shown: dict[str, Any] = {}
    for f in fields(config):
        if f.name in _REPR_EXCLUDED:
            continue
        value = getattr(config, f.name)  # every field, by name
        if f.name == "pass_config":
            value = value.non_default_items()
        elif f.name == "dynamic_shapes_config":
            value = {g.name: getattr(value, g.name) for g in fields(value)}
        elif f.name == "inductor_compile_config":
            value = {k: v for k, v in value.items() if k != "post_grad_custom_post_pass"}
        shown[f.name] = value
    return repr(shown)
