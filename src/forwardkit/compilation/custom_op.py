"""``CustomOp``: layers with a pure-torch form and an optimised form, chosen once per instance.

A subclass implements :meth:`CustomOp.forward_native` (plain torch, what Inductor can trace and
fuse) and may implement ``forward_cuda`` / ``forward_cpu`` (optimised forms; in forwardkit they
call opaque ``torch.ops.forwardkit.*`` kernels). Which one runs is decided at construction from
the current engine config's ``compilation_config.custom_ops`` (vLLM semantics) and, for the
optimised form, its ``platform`` (``current_platform`` outside an engine config):

* ``"all"`` / ``"none"`` set the default; ``"+name"`` forces an op on, ``"-name"`` off;
* with neither ``"all"`` nor ``"none"`` present (an un-normalised config) the normalisation
  default is used: ``none`` when the mode compiles with the ``inductor`` backend, else ``all``
  (the reference asserts instead);
* the decision is counted into ``enabled_custom_ops`` / ``disabled_custom_ops`` of the config's
  run-time state (``compilation_config.compile_state``) under the op's registered name. Changing ``custom_ops`` after construction has no effect.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

from forwardkit.config.custom_ops import (
    CUSTOM_OP_REGISTRY,
    custom_ops_default_on,
    is_custom_op_enabled,
)
from forwardkit.config.engine import get_current_engine_config, get_current_engine_config_or_none
from forwardkit.logger import init_logger
from forwardkit.platforms import current_platform

__all__ = ["CustomOp"]

logger = init_logger(__name__)


def _current_compilation_config() -> Any:
    return get_current_engine_config().compilation_config


def _current_platform() -> Any:
    """The platform of the engine config the model is built under (its one owner of device
    facts), else ``current_platform``."""
    config = get_current_engine_config_or_none()
    platform = getattr(config, "platform", None) if config is not None else None
    return current_platform if platform is None else platform


class CustomOp(nn.Module):
    """Base class of layers with native and platform-optimised forwards (see module docstring).

    Subclasses are registered with ``@CustomOp.register("rms_norm")``; ``register_oot`` installs
    an out-of-tree replacement that is instantiated instead of the in-tree class.
    """

    name: str
    op_registry: dict[str, type[CustomOp]] = CUSTOM_OP_REGISTRY  # shared with the config layer
    op_registry_oot: dict[str, type[CustomOp]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> CustomOp:
        target = CustomOp.op_registry_oot.get(cls.__name__, cls)
        return super().__new__(target)

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__()
        self._enforce_enable = enforce_enable
        self.forward_form: str = "native"
        """The form this instance runs: "native", "cpu", "cuda" or "oot" (set by
        :meth:`dispatch_forward`; read it instead of the chosen method's name)."""
        self._forward_method: Callable[..., Any] = self.dispatch_forward()

    # -- the forms ------------------------------------------------------------------------
    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """Pure-torch implementation; every subclass must provide it."""
        raise NotImplementedError(f"{type(self).__name__} has no forward_native")

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        """Optimised CUDA form; defaults to the native one."""
        return self.forward_native(*args, **kwargs)

    def forward_hip(self, *args: Any, **kwargs: Any) -> Any:
        """ROCm form; defaults to the CUDA one."""
        return self.forward_cuda(*args, **kwargs)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        """Optimised CPU form; defaults to the native one."""
        return self.forward_native(*args, **kwargs)

    def forward_oot(self, *args: Any, **kwargs: Any) -> Any:
        """Out-of-tree platform form; defaults to the native one."""
        return self.forward_native(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the form chosen at construction."""
        return self._forward_method(*args, **kwargs)

    # -- selection ------------------------------------------------------------------------
    @property
    def is_enabled(self) -> bool:
        """Whether this instance runs its platform (optimised) form."""
        return self.forward_form != "native"

    def dispatch_forward(self) -> Callable[..., Any]:
        """Choose the forward for this instance and count the decision in the config."""
        config = _current_compilation_config()
        enabled = self._enforce_enable or type(self).enabled()
        op_name = getattr(type(self), "name", type(self).__name__)
        state = config.compile_state
        counter = state.enabled_custom_ops if enabled else state.disabled_custom_ops
        counter.update([op_name])
        if not enabled:
            self.forward_form = "native"
            return self.forward_native
        platform = _current_platform()
        if platform.is_cpu():
            self.forward_form = "cpu"
            return self.forward_cpu
        if platform.is_cuda_alike():
            self.forward_form = "cuda"
            return self.forward_cuda
        self.forward_form = "oot"
        return self.forward_oot

    @classmethod
    def enabled(cls) -> bool:
        """Whether ``custom_ops`` of the current config enables this class."""
        config = _current_compilation_config()
        name = getattr(cls, "name", None)
        if name is None:
            logger.warning_once(
                "Custom op %s was not registered; it follows the global default", cls.__name__
            )
            return cls.default_on()
        return is_custom_op_enabled(config.custom_ops, name, config.mode, config.backend)

    @staticmethod
    def default_on() -> bool:
        """Whether custom ops are on by default in the current config."""
        config = _current_compilation_config()
        return custom_ops_default_on(config.custom_ops, config.mode, config.backend)

    # -- registries -----------------------------------------------------------------------
    @classmethod
    def register(cls, name: str) -> Callable[[type[CustomOp]], type[CustomOp]]:
        """Class decorator: register a CustomOp subclass under ``name`` (unique)."""

        def decorator(op_cls: type[CustomOp]) -> type[CustomOp]:
            existing = CustomOp.op_registry.get(name)
            if existing is not None and existing.__qualname__ != op_cls.__qualname__:
                raise AssertionError(
                    f"Duplicate custom op name {name!r}: already registered by {existing.__qualname__}"
                )
            op_cls.name = name
            CustomOp.op_registry[name] = op_cls
            return op_cls

        return decorator

    @classmethod
    def register_oot(cls, name: str | None = None) -> Callable[[type[CustomOp]], type[CustomOp]]:
        """Class decorator: replace the in-tree op whose class name is ``name`` (default: own name)."""

        def decorator(op_cls: type[CustomOp]) -> type[CustomOp]:
            CustomOp.op_registry_oot[name or op_cls.__name__] = op_cls
            return op_cls

        return decorator
