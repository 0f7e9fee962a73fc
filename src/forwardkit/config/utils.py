"""Helpers shared by the config classes: hashing, field access, overrides.

The hash helpers turn a config into a JSON-able structure of plain values
(:func:`normalize_value`, :func:`get_hash_factors`) and digest it with SHA-256
(:func:`hash_factors`), so equal configs give equal hashes across processes.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import re
import reprlib
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from forwardkit.logger import init_logger

__all__ = [
    "ConfigAssertionError",
    "ConfigAttributeError",
    "ConfigIndexError",
    "ConfigTypeError",
    "MAX_CONFIG_DEPTH",
    "assert_hashable",
    "check_nesting",
    "config",
    "contains_object_print",
    "get_field",
    "get_hash_factors",
    "getattr_iter",
    "handle_deprecated",
    "is_plain_json",
    "json_object",
    "hash_factors",
    "normalize_value",
    "short_repr",
    "update_config",
]

logger = init_logger(__name__)

T = TypeVar("T")

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    DataclassT = TypeVar("DataclassT", bound=DataclassInstance)


def config(cls: T) -> T:
    """Mark a class as a config class; returns it unchanged.

    Convention (checked by review, not at runtime): every field has a default and a docstring.
    """
    return cls


def _qualname(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def normalize_value(x: Any) -> Any:
    """Turn ``x`` into a stable, JSON-serialisable value for config hashing.

    Rules (first match wins): scalars (and int/str subclasses such as IntEnum / str enums)
    unchanged; other enums -> ``("<module>.<Class>", normalised value)``; classes -> their
    qualified name; objects with a callable ``uuid()`` -> ``uuid()``; other callables ->
    ``TypeError``; torch dtypes -> ``str``; bytes -> hex; paths -> resolved string;
    dataclasses -> ``("<module>.<Class>", ((field, value), ...))`` sorted by field name;
    mappings -> sorted ``(str(key), value)`` pairs; sets -> sorted reprs; sequences -> tuples;
    objects with ``to_json_string()`` -> that string. Anything else -> ``TypeError``.
    """
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, (int, float, str)):
        # int/str subclasses (IntEnum, str enums) hash as their plain value, without a type tag.
        return x.value if isinstance(x, enum.Enum) else x
    if isinstance(x, enum.Enum):
        return (_qualname(type(x)), normalize_value(x.value))
    if isinstance(x, type):
        return _qualname(x)
    uuid = getattr(x, "uuid", None)
    if callable(uuid):
        return uuid()
    if callable(x):
        raise TypeError(f"normalize_value: function or callable instance unsupported: {x!r}")
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, (bytes, bytearray)):
        return bytes(x).hex()
    if isinstance(x, Path):
        try:
            return str(x.expanduser().resolve())
        except Exception:  # noqa: BLE001 - a path that cannot be resolved still hashes
            return str(x)
    if dataclasses.is_dataclass(x):
        items = sorted((f.name, normalize_value(getattr(x, f.name))) for f in dataclasses.fields(x))
        return (_qualname(type(x)), tuple(items))
    if isinstance(x, Mapping):
        return tuple(sorted((str(k), normalize_value(v)) for k, v in x.items()))
    if isinstance(x, Set):
        return tuple(sorted(repr(normalize_value(v)) for v in x))
    if isinstance(x, Sequence):
        return tuple(normalize_value(v) for v in x)
    to_json = getattr(x, "to_json_string", None)
    if callable(to_json):
        return to_json()
    raise TypeError(
        f"normalize_value: unsupported type '{type(x).__name__}' ({x!r}); give it a uuid() "
        "method or convert it to a plain value"
    )


def get_hash_factors(cfg: Any, ignored: Iterable[str] = ()) -> dict[str, Any]:
    """Normalised values of every dataclass field of ``cfg`` not in ``ignored``, in field order."""
    ignored = set(ignored)
    factors: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        if f.name in ignored:
            continue
        value = getattr(cfg, f.name, None)
        try:
            factors[f.name] = normalize_value(value)
        except TypeError as e:
            raise TypeError(
                f"get_hash_factors: unsupported type for key '{f.name}' ({type(value).__name__}): {e}"
            ) from e
    return factors


def hash_factors(factors: Mapping[str, Any]) -> str:
    """SHA-256 hex digest of ``json.dumps(factors, sort_keys=True)``."""
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode("utf-8")).hexdigest()


def get_field(cls: type, name: str) -> dataclasses.Field:
    """A fresh ``dataclasses.field`` with the same default (or factory) as ``cls.<name>``.

    Used to reuse one config's default inside another config's field list.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"The given class is not a dataclass: {cls!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise ValueError(f"Field '{name}' not found in {cls.__name__}; fields are {sorted(fields)}.")
    f = fields[name]
    default: Any = f.default  # a plain default, MISSING, or a pydantic Field(...) object
    # pydantic's Field(...) objects carry their own default/default_factory.
    if hasattr(default, "default_factory") and hasattr(default, "is_required"):
        if default.default_factory is not None:
            return dataclasses.field(default_factory=default.default_factory)
        if not default.is_required():
            return dataclasses.field(default=default.default)
    elif f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory)
    elif default is not dataclasses.MISSING:
        return dataclasses.field(default=default)
    raise ValueError(f"{cls.__name__}.{name} must have a default value or default factory.")


def update_config(cfg: DataclassT, overrides: Mapping[str, Any]) -> DataclassT:
    """A new config built from ``cfg`` with ``overrides`` applied (nested dicts recurse).

    The original is not changed. ``__post_init__`` runs again on the new object, so
    ``init=False`` fields are back at their defaults.
    """
    processed: dict[str, Any] = {}
    for key, value in overrides.items():
        if not hasattr(cfg, key):
            raise AssertionError(f"{type(cfg).__name__} has no field `{key}`")
        current = getattr(cfg, key)
        if (dataclasses.is_dataclass(current) and not isinstance(current, type)
                and not dataclasses.is_dataclass(value)):
            if not isinstance(value, dict):
                raise AssertionError(
                    f"Overrides for {type(cfg).__name__}.{key} must be a dict or a "
                    f"{type(current).__name__}, got {type(value).__name__}"
                )
            value = update_config(current, value)
        processed[key] = value
    return dataclasses.replace(cfg, **processed)


_OBJECT_PRINT = re.compile(r"at 0x[a-fA-F0-9]{2,16}>")


def contains_object_print(text: str) -> bool:
    """True when ``text`` holds a default object repr such as ``<Foo object at 0x7f..>``."""
    return _OBJECT_PRINT.search(text) is not None


def assert_hashable(text: str) -> bool:
    """True, or ``AssertionError`` when ``text`` contains an object print (unstable across runs)."""
    if contains_object_print(text):
        raise AssertionError(
            f"{text!r} contains an object address, so it is not stable across processes; "
            "give the object a __repr__ or a uuid()"
        )
    return True


def handle_deprecated(cfg: Any, old_name: str, new_names: str | list[str], removal_version: str) -> None:
    """If ``cfg.<old_name>`` is set, warn and copy its value to each new name."""
    old_value = getattr(cfg, old_name)
    if old_value is None:
        return
    names = [new_names] if isinstance(new_names, str) else list(new_names)
    logger.warning(
        "%s is deprecated and will be removed in %s; use %s instead.",
        old_name,
        removal_version,
        ", ".join(names),
    )
    for name in names:
        setattr(cfg, name, old_value)


def getattr_iter(
    obj: Any,
    names: Iterable[str],
    default: Any = None,
    default_factory: Callable[[], Any] | None = None,
    warn: bool = False,
) -> Any:
    """The first attribute of ``obj`` found among ``names``; else ``default_factory()``/``default``."""
    names = list(names)
    for i, name in enumerate(names):
        if hasattr(obj, name):
            if warn and i > 0:
                logger.warning_once("%s has no %r; using %r instead", type(obj).__name__, names[0], name)
            return getattr(obj, name)
    return default_factory() if default_factory is not None else default


class ConfigAssertionError(ValueError, AssertionError):
    """A config check that failed. Both a ``ValueError`` (forwardkit's rule: invalid input is a
    ValueError) and an ``AssertionError`` (what vLLM raises for the same check), so callers
    written against either keep working, also under ``python -O``."""


class ConfigIndexError(ValueError, IndexError):
    """An out-of-range config value (vLLM raises a bare ``IndexError`` for the same input)."""


class ConfigTypeError(ValueError, TypeError):
    """A config value of the wrong kind (vLLM raises a bare ``TypeError`` for the same input)."""


class ConfigAttributeError(ValueError, AttributeError):
    """A config field that must be set first is still None (vLLM: a bare ``AttributeError``)."""


MAX_CONFIG_DEPTH = 16
"""Deepest nesting of lists/dicts accepted in a config value (deeper input is a ValueError
raised before any recursive code, such as ``repr`` or validation, can hit Python's limit)."""

_SHORT = reprlib.Repr()
_SHORT.maxlevel = 3
_SHORT.maxstring = 60
_SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6


def short_repr(value: Any, limit: int = 100) -> str:
    """A ``repr`` of ``value`` for error messages: depth- and length-limited, never raises."""
    try:
        text = _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_nesting(value: Any, name: str, max_depth: int = MAX_CONFIG_DEPTH) -> Any:
    """Return ``value``, or raise ``ValueError`` naming ``name`` when its lists/tuples/sets/dicts
    nest deeper than ``max_depth`` (walked iteratively, so any depth is safe to check)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Iterable[Any] = list(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            children = item
        else:
            continue
        if depth >= max_depth:
            raise ValueError(
                f"{name}: value nested deeper than {max_depth} levels (or self-referencing): "
                f"{short_repr(value)}; accepted: plain values, lists and objects nested at most "
                f"{max_depth} deep"
            )
        stack.extend((child, depth + 1) for child in children)
    return value


def is_plain_json(value: Any) -> bool:
    """True for values ``json.dumps`` writes as they are (nesting is bounded by validation)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain_json(v) for k, v in value.items())
    return False


def json_object(text: str, what: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object (ValueError naming ``what`` otherwise; depth bounded)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"Invalid JSON for {what}: {short_repr(text)} ({e})") from None
    except RecursionError:
        raise ValueError(f"Invalid JSON for {what}: nested too deeply ({short_repr(text)})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {short_repr(text)}")
    return check_nesting(value, what)
