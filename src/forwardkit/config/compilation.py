"""``CompilationConfig``: how forwardkit compiles the model and captures CUDA graphs.

Behaviour follows vLLM 0.14.0's ``vllm.config.CompilationConfig``,
with these deliberate fixes of reference defects:

* a bad ``cudagraph_mode`` name raises ``ValueError`` naming it and the accepted names
  (the reference raises a bare ``KeyError``);
* ``level`` outside 0-3 is rejected and ``mode = level`` is converted to the enum (the
  reference copied any int);
* ``custom_ops=[""]`` is a ``ValueError`` (reference: ``IndexError``);
* ``inductor_passes`` names resolve with ``importlib`` (``"os.path.join"`` works);
* negative ``cudagraph_capture_sizes`` / ``max_cudagraph_capture_size`` /
  ``cudagraph_num_of_warmups`` are rejected;
* ``compile_sizes`` keeps a deterministic order without duplicates; ``"+rotary_embedding"`` is
  not appended twice;
* capture sizes and ``compile_sizes`` entries must be >= 1 (and capture sizes <= 65536);
  ``compile_sizes`` strings other than ``"cudagraph_capture_sizes"`` are rejected up front;
* every field's value is nested at most ``MAX_CONFIG_DEPTH`` deep, and
  ``inductor_compile_config`` values must be JSON values or pass objects, so an accepted
  config always prints, serialises and hashes.

Checks that the reference writes as ``assert`` raise :class:`ConfigAssertionError`, which is
both a ``ValueError`` and an ``AssertionError``. The enums and ``Range`` are defined in
:mod:`.compilation_enums`, ``PassConfig``/``DynamicShapesConfig`` in :mod:`.pass_config`,
the methods in :mod:`.compilation_methods`; all are importable from here. ``to_dict`` and
``repr`` walk the fields with the functions at the end of this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import InitVar, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import ConfigDict, TypeAdapter, field_validator, model_validator
from pydantic.dataclasses import dataclass
from pydantic_core import ArgsKwargs

from forwardkit import envs
from forwardkit.config.compilation_enums import (
    CompilationMode,
    CUDAGraphMode,
    DynamicShapesType,
    Range,
)
from forwardkit.config.compilation_methods import STATE_ATTR, CompilationMethods
from forwardkit.config.compilation_sizes import MAX_CAPTURE_SIZE
from forwardkit.config.compile_state import CompileRuntimeState
from forwardkit.config.frozen import FreezableConfig
from forwardkit.config.pass_config import DynamicShapesConfig, PassConfig, resolve_inductor_pass
from forwardkit.config.utils import ConfigAssertionError, check_nesting, short_repr
from forwardkit.config.utils import is_plain_json as _is_plain_json
from forwardkit.config.utils import json_object as _json_object
from forwardkit.logger import init_logger
from forwardkit.platforms import Platform, current_platform

__all__ = [
    "CUDAGraphMode",
    "CompilationConfig",
    "CompilationMode",
    "DynamicShapesConfig",
    "DynamicShapesType",
    "PassConfig",
    "Range",
    "compilation_config_adapter",
]

logger = init_logger(__name__)

CompileCacheSaveFormat = Literal["binary", "unpacked"]
_SAVE_FORMATS = ("binary", "unpacked")

# Fields that hold "not decided yet" as None; validation is skipped for None.
_DELAYED_FIELDS = (
    "level",
    "mode",
    "debug_dump_path",
    "splitting_ops",
    "compile_sizes",
    "compile_ranges_split_points",
    "cudagraph_mode",
    "cudagraph_capture_sizes",
    "use_inductor_graph_partition",
    "max_cudagraph_capture_size",
)


def _default_save_format() -> CompileCacheSaveFormat:
    # Read at every construction; an invalid env value raises ValueError naming the variable.
    return envs.FORWARDKIT_COMPILE_CACHE_SAVE_FORMAT


def _torch_at_least(version: str) -> bool:
    return torch.__version__ >= version


@dataclass(config=ConfigDict(extra="forbid", use_attribute_docstrings=True))
class CompilationConfig(CompilationMethods, FreezableConfig):
    """Configuration for compilation and CUDA-graph capture.

    Three parts: top-level control (``mode``, ``backend``, ``custom_ops``,
    ``splitting_ops``, caches), CUDA-graph capture (``cudagraph_mode``, capture sizes,
    warm-ups) and Inductor compilation (``compile_sizes``, compile ranges,
    ``inductor_compile_config``, passes). Fields left ``None`` are decided by the engine
    config (``forwardkit.config.engine.EngineConfig``); used standalone, some stay unset.
    CUDA graphs need exact sizes (every captured size is a separate graph); Inductor can
    compile one graph for a range of sizes and optionally specialise for a few sizes.

    Build it from keywords, a dict (``CompilationConfig(**d)``), JSON
    (:meth:`from_cli`) or pydantic's ``TypeAdapter``; :meth:`to_dict`/:meth:`to_json`
    give back the user-settable fields.
    """

    ATTENTION_OPS: ClassVar[tuple[str, ...]] = (
        "forwardkit::unified_attention",
        "forwardkit::unified_attention_with_output",
    )
    """Attention ops used as default splitting ops (callers get a list copy)."""

    RUNTIME_STATE: ClassVar[dict[str, Callable[[], Any]]] = {STATE_ATTR: CompileRuntimeState}
    """The run-time state linked to each config (``compile_state``; config/compile_state.py)."""

    level: int | None = None
    """Deprecated alias of ``mode`` (0-3)."""
    mode: CompilationMode | None = None
    """Compilation approach: NONE(0), STOCK_TORCH_COMPILE(1), DYNAMO_TRACE_ONCE(2),
    VLLM_COMPILE(3); None lets the engine config decide."""
    debug_dump_path: Path | None = None
    """Where to dump debug artefacts (the engine config makes it absolute)."""
    cache_dir: str = ""
    """Compiled-artefact cache dir; empty means derived under FORWARDKIT_CACHE_ROOT."""
    compile_cache_save_format: CompileCacheSaveFormat = field(default_factory=_default_save_format)
    """Compile cache layout: 'binary' or 'unpacked' (default from
    FORWARDKIT_COMPILE_CACHE_SAVE_FORMAT)."""
    backend: str = ""
    """torch.compile backend name or dotted qualified name; empty -> platform default."""
    custom_ops: list[str] = field(default_factory=list)
    """Custom-op switches: 'all', 'none', '+name', '-name'."""
    splitting_ops: list[str] | None = None
    """Ops at which the graph is split for piecewise graphs; None -> attention ops; [] -> none."""
    compile_mm_encoder: bool = False
    """Also compile the multimodal encoder."""
    compile_sizes: list[int | str] | None = None
    """Sizes to specialise Inductor for; 'cudagraph_capture_sizes' expands to the capture list."""
    compile_ranges_split_points: list[int] | None = None
    """Split points of the Inductor compile ranges (the engine adds max_num_batched_tokens)."""
    inductor_compile_config: dict[str, Any] = field(default_factory=dict)
    """Extra Inductor options (config patches)."""
    inductor_passes: dict[str, str] = field(default_factory=dict)
    """Pass name -> dotted qualified name of a pass function."""
    cudagraph_mode: CUDAGraphMode | None = None
    """CUDA-graph strategy; None lets the engine config decide."""
    cudagraph_num_of_warmups: int = 0
    """Eager warm-up runs before capturing a graph."""
    cudagraph_capture_sizes: list[int] | None = None
    """Batch sizes to capture; None -> derived from max_num_seqs."""
    cudagraph_copy_inputs: bool = False
    """Copy inputs into internal buffers (piecewise graphs only)."""
    cudagraph_specialize_lora: bool = True
    """Capture separate graphs with and without active LoRA."""
    use_inductor_graph_partition: bool | None = None
    """Split at Inductor codegen time instead of at FX level (needs torch >= 2.9)."""
    pass_config: PassConfig = field(default_factory=PassConfig)
    """Custom Inductor pass switches."""
    max_cudagraph_capture_size: int | None = None
    """Largest capture size; None -> derived."""
    dynamic_shapes_config: DynamicShapesConfig = field(default_factory=DynamicShapesConfig)
    """Dynamic-shape options for Dynamo."""
    platform: InitVar[Any] = None
    """Construction only (not a field, not kept): the ``Platform`` whose defaults apply (the
    default backend, combo kernels, the pass flags a dict ``pass_config`` is checked
    against); None = ``current_platform``, as in vLLM. An engine config passes its own, so
    resolving for another platform swaps nothing process-wide."""

    # A resolution result, not a constructor argument (run-time state lives in
    # ``compile_state``, see config/compile_state.py).
    bs_to_padded_graph_size: list[int] | None = field(default=None, init=False)
    """Batch size -> padded capture size (see compute_bs_to_padded_graph_size)."""

    # ------------------------------------------------------------------ validators

    @model_validator(mode="before")
    @classmethod
    def _pass_platform_to_pass_config(cls, data: Any) -> Any:
        """With an explicit ``platform``, a ``pass_config`` given as a dict or JSON object is
        checked against that platform too (``PassConfig(platform=...)``)."""
        kwargs = data.kwargs if isinstance(data, ArgsKwargs) else data
        if not isinstance(kwargs, dict) or kwargs.get("platform") is None:
            return data
        value = kwargs.get("pass_config")
        if isinstance(value, str):
            value = _json_object(value, "pass_config")
        if not isinstance(value, dict) or "platform" in value:
            return data
        kwargs = {**kwargs, "pass_config": {**value, "platform": kwargs["platform"]}}
        return ArgsKwargs(data.args, kwargs) if isinstance(data, ArgsKwargs) else kwargs

    @field_validator(*_DELAYED_FIELDS, mode="wrap")
    @classmethod
    def _skip_none_validation(cls, value: Any, handler: Any) -> Any:
        """Skip validation if the value is ``None`` (the engine config decides later)."""
        return None if value is None else handler(value)

    @field_validator("mode", mode="before")
    @classmethod
    def validate_mode_before(cls, value: Any) -> Any:
        """Parse ``mode`` from a member name (any case, not numeric strings) or an int 0-3."""
        if value is None:
            return None
        return CompilationMode.parse(value)

    @field_validator("level", mode="before")
    @classmethod
    def _validate_level_before(cls, value: Any) -> Any:
        # Deliberate fix: the reference accepted any int here (level=7 gave mode == 7).
        if value is None:
            return None
        return int(CompilationMode.parse(value))

    @field_validator("cudagraph_mode", mode="before")
    @classmethod
    def validate_cudagraph_mode_before(cls, value: Any) -> Any:
        """Parse ``cudagraph_mode`` from a name (any case) or a value (``2``, ``(2, 1)``)."""
        if value is None:
            return None
        return CUDAGraphMode.parse(value)

    @field_validator("pass_config", mode="before")
    @classmethod
    def validate_pass_config_before(cls, value: Any) -> Any:
        """Accept a ``PassConfig``, a dict or a JSON object string for ``pass_config``."""
        if isinstance(value, str):
            value = _json_object(value, "pass_config")
        return value

    @field_validator("dynamic_shapes_config", mode="before")
    @classmethod
    def _validate_dynamic_shapes_before(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = _json_object(value, "dynamic_shapes_config")
        return value

    @field_validator("compile_cache_save_format", mode="before")
    @classmethod
    def validate_compile_cache_save_format(cls, value: Any) -> Any:
        """``compile_cache_save_format`` must be 'binary' or 'unpacked' (case-sensitive)."""
        if value not in _SAVE_FORMATS:
            raise ValueError(
                f"Invalid compile_cache_save_format {value!r}. Valid options: {list(_SAVE_FORMATS)}"
            )
        return value

    @field_validator("inductor_compile_config")
    @classmethod
    def _check_inductor_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Option values must be plain JSON values or pass objects with a ``uuid()``, so that
        every accepted config prints, serialises and hashes."""
        for key, option in value.items():
            if not _is_plain_json(option) and not callable(getattr(option, "uuid", None)):
                raise ValueError(
                    f"inductor_compile_config[{key!r}] = {short_repr(option)} "
                    f"({type(option).__name__}) is not accepted; values must be JSON values "
                    "(bool, int, float, str, None, lists and objects of them) or a pass object "
                    "with a uuid() method (use inductor_passes for plain functions)"
                )
        return value

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _check_capture_sizes(cls, value: list[int] | None) -> list[int] | None:
        # Deliberate fix: a size of 0 (the reference accepts it) captures nothing and made a
        # resolved config invalid input for a second resolution.
        if value is not None and any(s < 1 or s > MAX_CAPTURE_SIZE for s in value):
            bad = next(s for s in value if s < 1 or s > MAX_CAPTURE_SIZE)
            raise ValueError(f"cudagraph_capture_sizes entries must be in 1..{MAX_CAPTURE_SIZE}, "
                             f"got {bad} in {short_repr(value)}")
        return value

    @field_validator("compile_sizes")
    @classmethod
    def _check_compile_sizes(cls, value: list[int | str] | None) -> list[int | str] | None:
        for entry in value or []:
            if isinstance(entry, str) and entry != "cudagraph_capture_sizes":
                raise ValueError(f"compile_sizes entries must be sizes >= 1 or the string "
                                 f"'cudagraph_capture_sizes', got {short_repr(entry)}")
            if isinstance(entry, int) and entry < 1:
                raise ValueError(f"compile_sizes entries must be sizes >= 1 or the string "
                                 f"'cudagraph_capture_sizes', got {entry}")
        return value

    @field_validator("max_cudagraph_capture_size", "cudagraph_num_of_warmups")
    @classmethod
    def _check_non_negative(cls, value: int | None, info: Any) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"{info.field_name} must be >= 0, got {value}")
        if info.field_name == "max_cudagraph_capture_size" and value is not None and value > MAX_CAPTURE_SIZE:
            raise ValueError(f"max_cudagraph_capture_size must be <= {MAX_CAPTURE_SIZE} (one CUDA "
                             f"graph per capture size), got {value}")
        return value

    # Defined last so that pydantic runs it before every other validator of each field.
    @field_validator("*", mode="before")
    @classmethod
    def _bound_nesting(cls, value: Any, info: Any) -> Any:
        """Reject values nested deeper than ``MAX_CONFIG_DEPTH`` before anything recurses."""
        return check_nesting(value, info.field_name)

    # ------------------------------------------------------------------ construction

    def __post_init__(self, platform: Platform | None = None) -> None:
        """Normalise fields for ``platform`` (None: ``current_platform``). Raises
        ``ValueError`` on bad input."""
        target = current_platform if platform is None else platform
        # the run-time state this config's vLLM-named properties forward to (a fresh one per
        # construction, as vLLM's init=False fields)
        object.__setattr__(self, STATE_ATTR, CompileRuntimeState())
        if self.level is not None:
            logger.warning("Level is deprecated and will be removed in a future release; use mode.")
            if self.mode is None:
                self.mode = CompilationMode(self.level)

        special = [op for op in self.custom_ops if op in ("all", "none")]
        if len(special) > 1:
            raise ConfigAssertionError(
                f"custom_ops: Can only specify 'none' or 'all' once in total, got "
                f"{self.custom_ops}"
            )
        for op in self.custom_ops:
            if op not in ("all", "none") and not op.startswith(("+", "-")):
                raise ValueError(
                    f"custom_ops: Invalid syntax {op!r} for custom op, must be 'all', 'none', "
                    "'+op' or '-op' (where 'op' is the registered op name)"
                )

        if _torch_at_least("2.6") and "enable_auto_functionalized_v2" not in self.inductor_compile_config:
            # Custom passes match auto-functionalised v1 graphs.
            self.inductor_compile_config["enable_auto_functionalized_v2"] = False

        for name, value in self.inductor_passes.items():
            self.inductor_compile_config[name] = resolve_inductor_pass(name, value)

        if self.pass_config.enable_qk_norm_rope_fusion and "+rotary_embedding" not in self.custom_ops:
            self.custom_ops.append("+rotary_embedding")

        combo_keys = ("combo_kernels", "benchmark_combo_kernel")
        if (
            _torch_at_least("2.9.0.dev")
            and not any(k in self.inductor_compile_config for k in combo_keys)
            and not target.is_cpu()
        ):
            for key in combo_keys:
                self.inductor_compile_config[key] = True

        if self.use_inductor_graph_partition and not _torch_at_least("2.9.0.dev"):
            raise ValueError(
                "use_inductor_graph_partition=True is only supported with torch>=2.9.0.dev, "
                f"but the installed torch is {torch.__version__}. Set it to False."
            )

        if self.mode == CompilationMode.VLLM_COMPILE and self.backend not in ("", "eager", "inductor"):
            raise ValueError(
                f"Invalid backend for piecewise compilation: {self.backend}. With mode "
                "VLLM_COMPILE, backend must be '', 'eager' or 'inductor'."
            )
        if self.backend == "":
            self.backend = target.default_compile_backend()

    # ------------------------------------------------------------------ (de)serialisation

    @classmethod
    def from_cli(cls, cli_value: str, platform: Platform | None = None) -> CompilationConfig:
        """Build from a CLI string: a JSON object, or a bare mode (``"3"``, ``"VLLM_COMPILE"``);
        ``platform`` as for the constructor."""
        text = cli_value.strip()
        if text.isdigit() or (text.isidentifier() and text.upper() in CompilationMode.__members__):
            return cls(mode=CompilationMode.parse(int(text) if text.isdigit() else text),
                       platform=platform)
        return cls(**_json_object(text, "compilation config"), platform=platform)

    def to_dict(self) -> dict[str, Any]:
        """The user-settable fields as plain JSON-able values; ``CompilationConfig(**d)``
        rebuilds an equal config. Pass objects resolved from ``inductor_passes`` are left
        out of ``inductor_compile_config`` (they are re-resolved from ``inductor_passes``)."""
        return compilation_config_to_dict(self)

    def to_json(self) -> str:
        """:meth:`to_dict` as a JSON string (``from_cli`` reads it back). Pass objects placed
        directly in ``inductor_compile_config`` are not JSON and are left out."""
        return json.dumps(self.to_dict())

    def __repr__(self) -> str:
        """A dict-style string of the fields in declaration order (runtime state left out)."""
        return compilation_config_repr(self)

    __str__ = __repr__


# Validates dicts and JSON into CompilationConfig with pydantic (``.validate_json(s)``).
compilation_config_adapter: TypeAdapter[CompilationConfig] = TypeAdapter(CompilationConfig)


# ------------------------------------------------------------------ as plain data
# The dict behind ``to_dict``/``to_json`` and the dict-style string behind ``repr``. Both walk
# the dataclass fields in declaration order; ``to_dict`` keeps the user-settable ones (so
# ``CompilationConfig(**d)`` rebuilds an equal config), ``repr`` leaves out runtime state.

# Fields left out of ``repr``: the padding table is a resolution result vLLM does not print.
# The run-time state is no field; of it vLLM prints ``local_cache_dir`` only, last.
_REPR_EXCLUDED = frozenset({"bs_to_padded_graph_size"})


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
                     if k not in config.inductor_passes and _is_plain_json(v)}
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
    shown["local_cache_dir"] = config.local_cache_dir
    return repr(shown)
