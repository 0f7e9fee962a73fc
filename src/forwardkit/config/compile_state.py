"""``CompileRuntimeState``: what the model build and the compile backend record at run time.

vLLM keeps this state on ``CompilationConfig`` as ``init=False`` fields; forwardkit keeps the
resolved config read-only (:mod:`.frozen`), so the state lives in this one mutable object
instead. Each ``CompilationConfig`` is created with its own (``dataclasses.replace`` and the
copies a new resolution makes get a fresh one, as vLLM's ``init=False`` fields are reset),
and the config's vLLM-named properties (``static_forward_context``, ``enabled_custom_ops``,
``disabled_custom_ops``, ``traced_files``, ``compilation_time``, ``local_cache_dir``) read and
write it. The runner exposes the state of its engine config as ``ModelRunner.compile_state``.

None of it is configuration: it is not hashed, not in ``to_dict``/``to_json`` and (except
``local_cache_dir``, which vLLM prints) not in the config's ``repr``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

__all__ = ["RUNTIME_STATE_NAMES", "CompileRuntimeState"]


@dataclasses.dataclass(eq=False)
class CompileRuntimeState:
    """Mutable run-time state of one compilation config (see the module docstring)."""

    static_forward_context: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Layer name -> layer object that the forward context exposes (attention, MoE, ...);
    the layers register here while the model is built."""
    enabled_custom_ops: Counter[str] = dataclasses.field(default_factory=Counter)
    """Custom ops seen enabled while the model was built."""
    disabled_custom_ops: Counter[str] = dataclasses.field(default_factory=Counter)
    """Custom ops seen disabled while the model was built."""
    traced_files: set[str] = dataclasses.field(default_factory=set)
    """Source files traced by Dynamo (hashed into the compile-cache key by the backend)."""
    compilation_time: float = 0.0
    """Seconds spent compiling."""
    local_cache_dir: str | None = None
    """Per-rank compile-cache directory, set by the compile backend."""

    def __repr__(self) -> str:
        return (f"CompileRuntimeState(layers={len(self.static_forward_context)}, "
                f"enabled_custom_ops={dict(self.enabled_custom_ops)}, "
                f"disabled_custom_ops={dict(self.disabled_custom_ops)}, "
                f"traced_files={len(self.traced_files)}, "
                f"compilation_time={self.compilation_time:.3f}, "
                f"local_cache_dir={self.local_cache_dir!r})")


RUNTIME_STATE_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CompileRuntimeState))
"""The vLLM ``CompilationConfig`` attribute names that forward to a ``CompileRuntimeState``."""
