"""The registry of post-grad passes that live in a layer below the compilation layer.

A pass behind a ``PassConfig`` flag whose code lives in a lower layer (the kernels layer's
quant fusions, ``quantization/fusion.py``) cannot be imported by the pass manager
(:mod:`forwardkit.compilation.passes`); that layer registers a factory here instead, and the
manager asks every factory for its pass. Kept apart from the manager so that registering
imports nothing heavy (``from forwardkit import LLM`` loads no compiler).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forwardkit.config.pass_config import PassConfig

__all__ = ["FLAG_PASSES", "register_flag_pass"]

# name -> factory(pass_config) giving the pass (a callable on torch.fx.Graph), or None when the
# config does not ask for it. A model that never imports the registering layer has nothing such
# a pass would rewrite.
FLAG_PASSES: dict[str, Callable[[PassConfig], Any]] = {}


def register_flag_pass(name: str, factory: Callable[[PassConfig], Any]) -> None:
    """Add (or replace) the factory ``name`` in :data:`FLAG_PASSES`."""
    FLAG_PASSES[name] = factory
