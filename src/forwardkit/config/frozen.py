"""Resolved configs are read-only.

Constructing an ``EngineConfig`` resolves it and its sub-configs together; at the end of a
successful resolution every config in the tree is frozen: assigning or deleting one of its
attributes raises :class:`FrozenConfigError`, naming the class and field. Before resolution
(a ``CompilationConfig`` on its own, a ``ModelConfig`` being built) configs stay mutable, as in
vLLM, so construction and resolution work as they always did.

The guard covers every attribute; no field is exempt. Run-time state (the layers registered
while the model is built, custom-op counters, traced files, compile time, the per-rank cache
directory) is no config field: it lives in a separate mutable object linked to the config
(``CompileRuntimeState``, :mod:`.compile_state`; a config names such attributes in
``RUNTIME_STATE``). A property the config class defines with a setter (vLLM's names for that
state, e.g. ``compilation_config.static_forward_context``) writes through to that object, so
assigning it is not a write of the config.

Passing an already resolved (frozen) sub-config to a new ``EngineConfig`` resolves a copy of it
(:func:`thawed_copy`, which gives the copy fresh run-time state); the original is never changed. :func:`unfrozen` lifts the guard for a
block, for tests that emulate a state resolution would not produce.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

__all__ = ["FreezableConfig", "FrozenConfigError", "freeze", "is_frozen", "thawed_copy", "unfrozen"]

_FLAG = "_fk_frozen"

T = TypeVar("T")


class FrozenConfigError(AttributeError):
    """A field of a resolved (read-only) config was written. An ``AttributeError``, like
    ``dataclasses.FrozenInstanceError``."""


class FreezableConfig:
    """Mixin of the config dataclasses: read-only once :func:`freeze` marks the instance."""

    RUNTIME_STATE: ClassVar[dict[str, Callable[[], Any]]] = {}
    """Instance attributes (not fields) holding the mutable run-time state linked to the config,
    each with the factory of a fresh one (:func:`thawed_copy` gives a copy fresh state)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get(_FLAG, False) and not _writes_through(type(self), name):
            raise FrozenConfigError(_message(self, name, "set"))
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get(_FLAG, False):
            raise FrozenConfigError(_message(self, name, "delete"))
        super().__delattr__(name)


def _writes_through(cls: type, name: str) -> bool:
    """Whether ``name`` is a property of ``cls`` with a setter: it stores into the linked
    run-time state, not into the config."""
    attr = getattr(cls, name, None)
    return isinstance(attr, property) and attr.fset is not None


def _message(config: object, name: str, verb: str) -> str:
    cls = type(config).__name__
    return (f"cannot {verb} {cls}.{name}: the config is resolved and read-only; build a new "
            f"config instead (e.g. dataclasses.replace(config, {name}=...), or "
            "build_engine_config(...) for an engine config)")


def _children(config: object) -> Iterator[FreezableConfig]:
    """The configs held directly in ``config``'s dataclass fields."""
    if not dataclasses.is_dataclass(config):
        return
    for f in dataclasses.fields(config):
        value = config.__dict__.get(f.name)
        if isinstance(value, FreezableConfig):
            yield value


def _tree(config: object) -> list[FreezableConfig]:
    found: list[FreezableConfig] = []
    stack = [config]
    while stack:
        node = stack.pop()
        if isinstance(node, FreezableConfig) and all(node is not f for f in found):
            found.append(node)
            stack.extend(_children(node))
    return found


def freeze(config: object) -> None:
    """Make ``config`` and every config in its fields (recursively) read-only."""
    for node in _tree(config):
        object.__setattr__(node, _FLAG, True)


def is_frozen(config: object) -> bool:
    """Whether ``config`` has been frozen (is a resolved config)."""
    return bool(getattr(config, "__dict__", {}).get(_FLAG, False))


def thawed_copy(config: T) -> T:
    """A mutable copy of ``config`` for a new resolution: sub-configs are copied the same way,
    run-time state (``RUNTIME_STATE``) is fresh, lists, dicts and sets are copied one level
    deep (resolution edits them in place), other values are shared."""
    new = copy.copy(config)
    state = new.__dict__
    state.pop(_FLAG, None)
    fresh = getattr(type(config), "RUNTIME_STATE", {})
    for key, value in list(state.items()):
        if key in fresh:
            state[key] = fresh[key]()
        elif isinstance(value, FreezableConfig):
            state[key] = thawed_copy(value)
        elif isinstance(value, (list, dict, set)):
            state[key] = copy.copy(value)
    return new


@contextlib.contextmanager
def unfrozen(config: T) -> Iterator[T]:
    """Lift the read-only guard of ``config``'s tree for the block, then restore it.

    Nothing is re-resolved: meant for tests that emulate a state resolution would not produce
    (a config resolved for CUDA run on the CPU, say), never for engine code.
    """
    frozen = [node for node in _tree(config) if is_frozen(node)]
    for node in frozen:
        object.__setattr__(node, _FLAG, False)
    try:
        yield config
    finally:
        for node in frozen:
            object.__setattr__(node, _FLAG, True)
