"""``build_engine_config``: flat user arguments -> a resolved :class:`EngineConfig`.

The one place that turns the arguments a user types (``LLM(...)`` keywords, or the
``forwardkit config/generate/bench`` flags via :func:`forwardkit.commands.flag_config.engine_config_from_args`)
into the nested configs, so both paths configure the same engine. Rules:

* ``model`` (a local Hugging Face directory) wins; else ``model_shape`` or
  ``default_hf_config`` describes the model; with none of them the model is the built-in one
  (shape ``config.model_shapes.BUILTIN_MODEL_SHAPE``). So the result always has a
  ``ModelConfig``, and code downstream reads ``engine_config.model_config`` without a None case.
* ``max_num_batched_tokens`` defaults to ``max(2048, max_num_seqs)``, raised to
  ``max_model_len`` when chunked prefill is off (so every prompt fits one step);
  ``max_num_seqs`` defaults to ``min(128, max_num_batched_tokens)``.
* Other keyword arguments go to ``ParallelConfig`` or ``SchedulerConfig`` by field name
  (a None value means the field's default); any other name is a ``TypeError`` listing what
  is accepted.
* Every invalid value is a one-line ``ValueError`` naming the argument (pydantic's
  multi-line ``ValidationError`` is condensed by :func:`one_line_error`).

The built-in model is the named shape ``default`` (its HF config lives in
``config/model_shapes.py``); the model layer builds it with seeded random weights.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from pydantic import ValidationError

from forwardkit.config.cache import CacheConfig, check_hash_algo
from forwardkit.config.compilation import CompilationConfig
from forwardkit.config.custom_ops import is_custom_op_enabled
from forwardkit.config.engine import EngineConfig
from forwardkit.config.engine_args import ENGINE_ARGS, LLM_LEVEL_ARGS, screen_engine_args
from forwardkit.config.gguf import gguf_model_config, is_gguf_path
from forwardkit.config.lora import LoRAConfig
from forwardkit.config.model import GGUF_BLOCK_TYPES, QUANTIZATION_FORMATS, ModelConfig
from forwardkit.config.model_shapes import (
    BUILTIN_MODEL_SHAPE,
    model_shape_config,
    model_shape_names,
)
from forwardkit.config.observability import ObservabilityConfig
from forwardkit.config.parallel import ParallelConfig
from forwardkit.config.scheduler import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    SchedulerConfig,
    SpeculativeConfig,
)
from forwardkit.config.utils import short_repr
from forwardkit.logger import init_logger
from forwardkit.platforms import Platform, cpu_capabilities, current_platform, platform_by_name

logger = init_logger(__name__)

__all__ = ["build_engine_config", "check_fits_machine", "default_batch_limits", "engine_kwarg_names",
           "machine_memory_bytes", "one_line_error"]

# Named arguments of build_engine_config that are also config fields (not routed by name).
_NAMED_PARALLEL = frozenset({"data_parallel_size"})
_NAMED_SCHEDULER = frozenset({"max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"})


def one_line_error(exc: ValidationError, prefix: str | None = None) -> str:
    """Condense a pydantic ``ValidationError`` into one line naming each bad field."""
    title = prefix or exc.title
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = err.get("msg", "").removeprefix("Value error, ").removeprefix("Assertion failed, ")
        parts.append(f"{title}.{loc}: {msg}" if loc else f"{title}: {msg}")
    return "; ".join(parts) or str(exc).splitlines()[0]


def _init_fields(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.init)


# Named arguments of build_engine_config that are CacheConfig fields.
_NAMED_CACHE = frozenset({"block_size", "num_gpu_blocks", "enable_prefix_caching",
                          "prefix_caching_hash_algo"})
# Engine arguments that are compilation-config keys (vLLM takes them at the top level too).
_COMPILATION_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")


def engine_kwarg_names() -> tuple[frozenset[str], frozenset[str]]:
    """(ParallelConfig, SchedulerConfig) field names ``build_engine_config`` takes as ``**kwargs``."""
    return (_init_fields(ParallelConfig) - _NAMED_PARALLEL,
            _init_fields(SchedulerConfig) - _NAMED_SCHEDULER)


def routed_field_names() -> dict[str, frozenset[str]]:
    """Config fields ``build_engine_config`` routes from its ``**kwargs`` by name, per config
    (a field added to one of these configs is taken at once, and needs a row in the
    engine-argument table)."""
    parallel, scheduler = engine_kwarg_names()
    return {"parallel": parallel, "scheduler": scheduler,
            "cache": _init_fields(CacheConfig) - _NAMED_CACHE,
            "observability": _init_fields(ObservabilityConfig),
            "lora": _init_fields(LoRAConfig) | {"enable_lora"}}


def default_batch_limits(max_num_seqs: int | None, max_num_batched_tokens: int | None, *,
                         max_model_len: int, enable_chunked_prefill: bool = True) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) with the defaults filled in (module docstring)."""
    seqs, tokens = max_num_seqs, max_num_batched_tokens
    if tokens is None:
        tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, seqs or 0)
        if not enable_chunked_prefill:
            tokens = max(tokens, max_model_len)
    if seqs is None:
        seqs = min(DEFAULT_MAX_NUM_SEQS, tokens)
    return seqs, tokens


def _resolve_platform(platform: str | Platform | None) -> Platform:
    if platform is None:
        return current_platform._get()
    if isinstance(platform, str):
        return platform_by_name(platform)
    if not isinstance(platform, Platform):
        raise ValueError(f"platform must be a Platform, 'cuda', 'cpu' or None, got "
                         f"{short_repr(platform)} ({type(platform).__name__})")
    return platform


def _with_compilation_keys(value: Any, keys: Mapping[str, Any], label: str) -> Any:
    """``value`` (a compilation config in any accepted form) with top-level engine arguments
    that are compilation keys (``cudagraph_capture_sizes``, ...) merged in; a key set both
    ways is refused."""
    if isinstance(value, str):
        value = CompilationConfig.from_cli(value).to_dict() if value.strip() else None
    if isinstance(value, CompilationConfig):
        raise ValueError(f"give {', '.join(keys)} inside {label} (a CompilationConfig "
                         "instance) or as arguments, not both")
    merged = dict(value or {})
    both = sorted(set(merged) & set(keys))
    if both:
        raise ValueError(f"{both[0]} is given both as an argument and in {label}")
    merged.update(keys)
    return merged


def _compilation(value: Any, platform: Platform, label: str) -> CompilationConfig:
    """``value`` (None, dict, JSON/mode string or CompilationConfig) as a CompilationConfig."""
    if isinstance(value, CompilationConfig):
        return value
    try:  # the platform's defaults apply (passed explicitly; nothing process-wide swapped)
        if value is None:
            return CompilationConfig(platform=platform)
        if isinstance(value, Mapping):
            return CompilationConfig(**value, platform=platform)
        if isinstance(value, str):
            return CompilationConfig.from_cli(value, platform=platform)
    except ValidationError as exc:  # name the bad key relative to the compilation config
        raise ValueError(one_line_error(exc, prefix=label)) from None
    raise ValueError(f"{label} must be a CompilationConfig, a dict of its fields, a JSON object "
                     f"string or None, got {type(value).__name__}")


def build_engine_config(
    model: str | os.PathLike[str] | None = None,
    *,
    default_hf_config: Mapping[str, Any] | None = None,
    model_shape: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool | None = True,
    enforce_eager: bool = False,
    compilation_config: CompilationConfig | Mapping[str, Any] | str | None = None,
    optimization_level: int | None = None,
    data_parallel_size: int | None = None,
    block_size: int | None = None,
    num_gpu_blocks: int | None = None,
    enable_prefix_caching: bool | None = None,
    prefix_caching_hash_algo: str | None = None,
    speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None,
    platform: str | Platform | None = None,
    arg_names: Mapping[str, str] | None = None,
    quantization: str | None = None,
    **kwargs: Any,
) -> EngineConfig:
    """Build and resolve an :class:`EngineConfig` from flat arguments (rules: module docstring).

    Args:
        model: local Hugging Face checkpoint directory (config.json + safetensors), or None.
        default_hf_config: HF config dict of the model used when ``model`` is None; None =
            the built-in model (shape ``BUILTIN_MODEL_SHAPE``).
        model_shape: a named real-architecture shape (``config.model_shapes``, e.g.
            ``"llama-3.2-1b"``) built with seeded random weights; replaces ``default_hf_config``
            and excludes ``model``.
        dtype: "auto"/None (from config.json, then :func:`_cpu_dtype` on a CPU), "float32",
            "bfloat16", "float16" or a torch dtype.
        max_model_len: longest sequence; None = ``max_position_embeddings``.
        max_num_seqs / max_num_batched_tokens / enable_chunked_prefill: scheduler limits.
        enforce_eager: no compilation and no CUDA graphs (forces O0).
        compilation_config: a ``CompilationConfig``, a dict of its fields, a JSON string or None.
        optimization_level: 0-3; None = O2.
        data_parallel_size: DP replicas; None = 1 (or ``FORWARDKIT_DP_SIZE`` on the offline path).
        block_size / num_gpu_blocks: KV cache layout; None = defaults (16 / decided later).
        enable_prefix_caching / prefix_caching_hash_algo: automatic prefix caching; None =
            defaults (on / ``"sha256"``).
        speculative_config: a ``SpeculativeConfig``, a dict of its fields, or None (off).
        platform: "cpu", "cuda", a ``Platform`` or None (the current one).
        arg_names: how the caller's users spell each argument, used in error messages
            (the CLI maps ``dtype`` to ``--dtype``); unmapped names are used as they are.
        quantization: block format the attention/MLP projections are quantized to on load
            (``q8_0``, ``q4_0``, ``q4_1``; ``ModelConfig.quantization``); None = none.
        **kwargs: the other engine arguments of vLLM, as the table in
            ``config/engine_args.py`` says: acting ones are routed to ``ParallelConfig`` /
            ``SchedulerConfig`` / ``CacheConfig`` / ``ObservabilityConfig`` by field name (see
            :func:`routed_field_names`) or into the compilation config; no-ops are dropped;
            refused ones raise unless left at a value that changes nothing.

    Raises:
        TypeError: a name that is no engine argument (vLLM's or forwardkit's).
        ValueError: any invalid value, as one line naming the argument or field.
    """
    if arg_names is not None and not (isinstance(arg_names, Mapping)
                                      and all(isinstance(v, str) for v in arg_names.values())):
        raise ValueError(f"arg_names must be a dict of argument name -> displayed name or None, "
                         f"got {short_repr(arg_names)} ({type(arg_names).__name__})")
    names = dict(arg_names or {})

    def label(name: str) -> str:
        return names.get(name, name)

    if enable_chunked_prefill is None:  # vLLM's default: on
        enable_chunked_prefill = True
    routed = _split_engine_kwargs(kwargs)
    parallel_kwargs, scheduler_kwargs = routed["parallel"], routed["scheduler"]
    if data_parallel_size is not None:
        parallel_kwargs["data_parallel_size"] = data_parallel_size
    if "num_gpu_blocks" in routed["named"]:
        if num_gpu_blocks is not None:
            raise ValueError(f"give {label('num_gpu_blocks')} or num_gpu_blocks_override, not both")
        num_gpu_blocks = routed["named"]["num_gpu_blocks"]
    _check_argument_types(label, model=model, default_hf_config=default_hf_config, dtype=dtype,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          enable_chunked_prefill=enable_chunked_prefill, enforce_eager=enforce_eager,
                          optimization_level=optimization_level, data_parallel_size=data_parallel_size,
                          block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                          enable_prefix_caching=enable_prefix_caching)
    if prefix_caching_hash_algo is not None:
        try:
            check_hash_algo(prefix_caching_hash_algo, label("prefix_caching_hash_algo"))
        except ValueError as exc:
            raise ValueError(str(exc)) from None

    if routed["compilation"]:
        compilation_config = _with_compilation_keys(compilation_config, routed["compilation"],
                                                    label("compilation_config"))

    if quantization is not None and quantization not in QUANTIZATION_FORMATS:
        raise ValueError(f"{label('quantization')} must be one of {list(QUANTIZATION_FORMATS)} or "
                         f"None, got {short_repr(quantization)}")
    builtin_hf_config = _shape_hf_config(model, model_shape, default_hf_config, label)
    resolved_platform = _resolve_platform(platform)
    compilation = _compilation(compilation_config, resolved_platform, label("compilation_config"))
    try:
        model_config = _model_config(model, builtin_hf_config, dtype, max_model_len, enforce_eager)
        if quantization is not None and is_gguf_path(model):
            raise ValueError(f"{label('quantization')}={quantization!r} quantizes a full-precision "
                             f"checkpoint on load; GGUF file {model} keeps the types its tensors "
                             "have: leave quantization unset")
        if quantization is not None:
            model_config = dataclasses.replace(model_config, quantization=quantization)
        model_config = _cpu_dtype(model_config, dtype, resolved_platform, compilation)
        scheduler_config = _scheduler_config(model_config, max_num_seqs, max_num_batched_tokens,
                                             enable_chunked_prefill, scheduler_kwargs)
        cache_kwargs: dict[str, Any] = {"num_gpu_blocks": num_gpu_blocks, **routed["cache"]}
        for key, value in (("block_size", block_size),
                           ("enable_prefix_caching", enable_prefix_caching),
                           ("prefix_caching_hash_algo", prefix_caching_hash_algo)):
            if value is not None:
                cache_kwargs[key] = value
        cache_config = CacheConfig(**cache_kwargs)
        parallel_config = ParallelConfig(**parallel_kwargs)
        _check_cpu_all2all(parallel_config, resolved_platform, label("all2all_backend"))
        config_kwargs: dict[str, Any] = {
            "model_config": model_config,
            "parallel_config": parallel_config,
            "scheduler_config": scheduler_config,
            "cache_config": cache_config,
            "compilation_config": compilation,
            "observability_config": ObservabilityConfig(**routed["observability"]),
            "platform": resolved_platform,
        }
        lora_config = _lora_config(routed["lora"], label)
        if lora_config is not None:
            config_kwargs["lora_config"] = lora_config
        if speculative_config is not None:
            config_kwargs["speculative_config"] = _speculative(speculative_config,
                                                               label("speculative_config"))
        if optimization_level is None and enforce_eager:
            optimization_level = 0  # what enforce_eager means; asked for, so nothing to warn about
        if optimization_level is not None:
            config_kwargs["optimization_level"] = optimization_level
        engine_config = EngineConfig(**config_kwargs)
        spec = engine_config.speculative_config
        if spec is not None:
            spec.check_draft_model(model_config.get_vocab_size(),
                                   engine_config.parallel_config.tensor_parallel_size)
        return engine_config
    except ValidationError as exc:
        raise ValueError(one_line_error(exc)) from None


def _lora_config(kwargs: Mapping[str, Any], label: Callable[[str], str]) -> LoRAConfig | None:
    """The ``LoRAConfig`` of ``enable_lora=True`` and its companions; None without it (then a
    companion given anyway is refused: it would change nothing)."""
    kwargs = dict(kwargs)
    enable = kwargs.pop("enable_lora", False)
    if not isinstance(enable, bool):
        raise ValueError(f"{label('enable_lora')} must be True or False, got {short_repr(enable)}")
    if not enable:
        defaults = {f.name: f.default for f in dataclasses.fields(LoRAConfig)}
        changed = sorted(n for n, v in kwargs.items() if v != defaults.get(n))
        if changed:
            name = changed[0]
            raise ValueError(f"{label(name)}={short_repr(kwargs[name])} needs enable_lora=True "
                             "(without it the engine serves no adapters)")
        return None
    for name, value in kwargs.items():
        if name == "lora_dtype":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{label(name)} must be an integer, got {short_repr(value)}")
    return LoRAConfig(**kwargs)


def _speculative(value: object, name: str) -> SpeculativeConfig:
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, Mapping):
        return SpeculativeConfig(**dict(value))
    raise ValueError(f"{name} must be a SpeculativeConfig, a dict of its fields or None, got "
                     f"{short_repr(value)} ({type(value).__name__})")


def _shape_hf_config(model: Any, model_shape: str | None, default_hf_config: Mapping[str, Any] | None,
                     label: Any) -> Mapping[str, Any]:
    """The HF config of the model built without a checkpoint: ``model_shape``, else
    ``default_hf_config``, else the built-in model's."""
    if model_shape is None:
        if default_hf_config is None:
            return model_shape_config(BUILTIN_MODEL_SHAPE)
        return default_hf_config
    if not isinstance(model_shape, str):
        raise ValueError(f"{label('model_shape')} must be the name of a model shape or None, got "
                         f"{short_repr(model_shape)} ({type(model_shape).__name__}); accepted: "
                         f"{model_shape_names()}")
    if model is not None:
        raise ValueError(f"give {label('model')} or {label('model_shape')}, not both "
                         f"(got {short_repr(os.fspath(model))} and {model_shape!r:.100})")
    return model_shape_config(model_shape)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (AVX-512-BF16 or AMX, through oneDNN):
    ``platforms.cpu_capabilities().native_bf16``."""
    return cpu_capabilities().native_bf16


_GGUF_F32 = 0  # ggml's type id of float32 (norms and MoE routers in a quantized GGUF)


def weights_held_in_blocks(model_config: ModelConfig) -> bool:
    """Whether every large weight of the model is held in 32-weight blocks, so that ``dtype``
    decides only the activations, the KV cache and the small tensors (norms, biases, MoE router
    gates): a model quantized on load (its projections, MoE experts, token embedding and LM head
    go into blocks), or a GGUF file whose tensors are all block types or float32 (norms and
    routers are float32 in GGUF; a file with 16-bit matrices is not)."""
    if model_config.quantization is not None:
        return True
    types = model_config.hf_config.get("gguf_tensor_types") or {}
    kinds = set(types.values())
    return bool(kinds & GGUF_BLOCK_TYPES) and kinds <= GGUF_BLOCK_TYPES | {_GGUF_F32}


def _cpu_dtype(model_config: ModelConfig, dtype: Any, platform: Platform,
               compilation: CompilationConfig) -> ModelConfig:
    """What ``dtype="auto"`` resolves to on a CPU, where the checkpoint names a 16-bit dtype
    (an explicit dtype is kept, and so is anything on a GPU):

    - float32 for a model whose weights are all held in blocks (:func:`weights_held_in_blocks`):
      its products quantize their activations to int8 whatever the dtype, so 16-bit activations
      save no product time there, while float32 ones (llama.cpp computes so too) keep the
      rounding of the residual stream, norms and attention out of the model's accuracy; the
      cost is a KV cache of twice the bytes (decode time showed none, AMX or AVX2).
    - float32 for a bf16 checkpoint where bf16 products would be emulated: no native bf16
      matmul (AVX-512-BF16 / AMX through oneDNN) and neither forwardkit's AVX2 bf16 kernels
      (they need AVX2 + FMA and the ``cpu_linear`` op, on unless ``"-cpu_linear"``). Emulated
      bf16 matmuls are several times slower than float32; the AVX2 kernels are faster than
      float32 (they read half the bytes at batch 1 and match float32's prompt speed).
    - else the checkpoint's dtype."""
    auto = dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto")
    if not auto or not platform.is_cpu() or model_config.dtype == torch.float32:
        return model_config
    if weights_held_in_blocks(model_config):
        logger.info_once("The model's weights are held in quantized blocks: dtype='auto' runs its "
                         "activations and KV cache in float32 (the products take int8 "
                         "activations either way; pass dtype='bfloat16' for 16-bit activations "
                         "and a KV cache of half the bytes)")
        return dataclasses.replace(model_config, dtype=torch.float32)
    if model_config.dtype != torch.bfloat16 or cpu_has_native_bf16():
        return model_config
    if cpu_capabilities().avx2_fma and is_custom_op_enabled(
            compilation.custom_ops, "cpu_linear", compilation.mode, compilation.backend):
        return model_config
    logger.info_once("This CPU has no native bf16 matmuls and forwardkit's AVX2 bf16 kernels do "
                     "not serve here (no AVX2 + FMA, or custom_ops has '-cpu_linear'): running "
                     "the bf16 model in float32 (pass dtype='bfloat16' to force bf16)")
    return dataclasses.replace(model_config, dtype=torch.float32)


def _split_engine_kwargs(kwargs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The keyword arguments per config (``parallel``, ``scheduler``, ``cache``,
    ``observability``, ``compilation``, ``named``), Nones dropped, after the engine-argument
    table (``config/engine_args.py``) refused what is not supported here."""
    llm_level = sorted(set(kwargs) & LLM_LEVEL_ARGS)
    if llm_level:
        raise TypeError(f"{llm_level[0]!r} is an argument of LLM(...), not of the engine config")
    screened = screen_engine_args(kwargs)
    fields = routed_field_names()
    out: dict[str, dict[str, Any]] = {k: {} for k in (*fields, "compilation", "named")}
    for name, value in screened.items():
        if value is None:
            continue
        config = next((c for c, names in fields.items() if name in names), None)
        if config is not None:
            out[config][name] = value
        elif name in _COMPILATION_KEYS:
            out["compilation"][name] = value
        elif name == "num_gpu_blocks":  # num_gpu_blocks_override, renamed by the table
            out["named"][name] = value
        elif ENGINE_ARGS[name].kind == "acts":  # a table row without a route: a bug here
            raise TypeError(f"engine argument {name!r} acts per the table but build_engine_config "
                            "does not route it")
    return out


# The MoE all-to-all backends the layers implement without CUDA kernels.
_CPU_ALL2ALL = ("allgather_reducescatter", "naive")


def _check_cpu_all2all(parallel: ParallelConfig, platform: Platform, name: str) -> None:
    """On the CPU only the backends built from plain collectives run; another one would
    silently run as allgather_reducescatter, so it is refused."""
    if platform.is_cpu() and parallel.all2all_backend not in _CPU_ALL2ALL:
        raise ValueError(f"{name}={parallel.all2all_backend!r} needs its CUDA kernels; on the CPU "
                         f"the MoE layers run {' or '.join(map(repr, _CPU_ALL2ALL))} (resolve "
                         "the CUDA config with platform='cuda')")


def _scheduler_config(model_config: ModelConfig, max_num_seqs: int | None,
                      max_num_batched_tokens: int | None, enable_chunked_prefill: bool,
                      scheduler_kwargs: Mapping[str, Any]) -> SchedulerConfig:
    """The scheduler limits, defaults filled in from the model's ``max_model_len``."""
    model_len = model_config.get_max_model_len()
    seqs, tokens = default_batch_limits(max_num_seqs, max_num_batched_tokens, max_model_len=model_len,
                                        enable_chunked_prefill=enable_chunked_prefill)
    return SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        max_model_len=model_len,
        is_encoder_decoder=model_config.is_encoder_decoder,
        **scheduler_kwargs,
    )


# Named arguments that must be ints, with the smallest accepted value.
_INT_ARGS = {"max_model_len": 1, "max_num_seqs": 1, "max_num_batched_tokens": 1, "optimization_level": 0,
             "data_parallel_size": 1, "block_size": 1, "num_gpu_blocks": 0}


def _check_argument_types(label: Any, **args: Any) -> None:
    """ValueError naming the first named argument of the wrong type or below its minimum."""
    for name, minimum in _INT_ARGS.items():
        value = args[name]
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{label(name)} must be an integer >= {minimum} or None, got "
                             f"{short_repr(value)} ({type(value).__name__})")
        if value < minimum:
            raise ValueError(f"{label(name)} must be >= {minimum}, got {value}")
    for name in ("enable_chunked_prefill", "enforce_eager", "enable_prefix_caching"):
        if name == "enable_prefix_caching" and args[name] is None:
            continue
        if not isinstance(args[name], bool):
            raise ValueError(f"{label(name)} must be True or False, got {short_repr(args[name])}")
    checks = (("model", (str, os.PathLike), "a local checkpoint directory (str or path) or None"),
              ("default_hf_config", Mapping, "a dict (a Hugging Face config.json) or None"),
              ("dtype", (str, torch.dtype), "auto, float32, bfloat16, float16, a torch dtype or None"))
    for name, kinds, accepted in checks:
        value = args[name]
        if value is not None and not isinstance(value, kinds):
            raise ValueError(f"{label(name)} must be {accepted}, got {short_repr(value)} "
                             f"({type(value).__name__})")


def _with_architecture(config: ModelConfig) -> ModelConfig:
    """A config.json without ``architectures`` but with a ``model_type`` takes the causal-LM
    class ``transformers`` maps that type to (as its ``AutoModelForCausalLM`` does)."""
    if config.architectures or not isinstance(config.hf_config.get("model_type"), str):
        return config
    model_type = config.hf_config["model_type"]
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - transformers is a dependency of checkpoints here
        return config
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if not isinstance(name, str):
        return config  # the model registry names what is missing when the model is built
    return dataclasses.replace(config, hf_config={**config.hf_config, "architectures": [name]})


def _model_config(model: str | os.PathLike[str] | None, builtin_hf_config: Mapping[str, Any],
                  dtype: str | torch.dtype | None, max_model_len: int | None,
                  enforce_eager: bool) -> ModelConfig:
    """A checkpoint's ``ModelConfig`` when ``model`` is given, else one of ``builtin_hf_config``
    (a model built with seeded random weights)."""
    overrides: dict[str, Any] = {"enforce_eager": bool(enforce_eager)}
    if max_model_len is not None:
        overrides["max_model_len"] = max_model_len
    if model is not None and is_gguf_path(model):
        return gguf_model_config(os.fspath(model), dtype=dtype, **overrides)
    if model is not None:
        config = ModelConfig.from_pretrained(model, dtype=dtype, **overrides)
        return _with_architecture(config)
    return ModelConfig(hf_config=dict(builtin_hf_config), dtype="auto" if dtype is None else dtype,
                       **overrides)


# Bytes per batched token the runner's persistent step buffers hold at the least (input ids and
# positions, int64 each); the real footprint (activations, logits) is larger.
_STEP_BUFFER_BYTES_PER_TOKEN = 16


def machine_memory_bytes(platform: Platform) -> int | None:
    """What a run on ``platform`` can allocate at most: the physical memory on a CPU, the
    device's total memory on a GPU; None when this machine cannot tell (a CUDA config
    resolved on a machine without a GPU)."""
    if platform.is_cpu():
        try:
            return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    if platform.is_cuda_alike() and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_fits_machine(cfg: EngineConfig, arg_names: Mapping[str, str] | None = None,
                       memory_bytes: int | None = None) -> None:
    """Refuse (``ValueError`` naming the argument) sizes whose buffers cannot fit this machine,
    before anything is allocated: ``max_num_seqs`` / ``max_num_batched_tokens`` (every step's
    input buffers) and an explicit KV cache of ``num_gpu_blocks`` blocks.

    ``arg_names``: how the caller spells each argument (the CLI's flags); ``memory_bytes``:
    the machine's memory (default :func:`machine_memory_bytes`). The estimate counts only what
    is surely allocated, so a size refused here could never run.
    """
    total = memory_bytes if memory_bytes is not None else machine_memory_bytes(cfg.platform)
    if total is None:
        return
    names = dict(arg_names or {})

    def label(name: str) -> str:
        return names.get(name, name)

    sched = cfg.scheduler_config
    tokens, seqs = int(sched.max_num_batched_tokens), int(sched.max_num_seqs)
    step_bytes = tokens * _STEP_BUFFER_BYTES_PER_TOKEN
    if step_bytes > total:
        flag = label("max_num_seqs") if seqs == tokens else label("max_num_batched_tokens")
        named = (f"{flag}={seqs} (which sets max_num_batched_tokens)" if seqs == tokens
                 else f"{flag}={tokens}")
        raise ValueError(f"{named} is too large for this machine: the step buffers for {tokens} "
                         f"tokens need at least {_gib(step_bytes)}, and it has {_gib(total)} of "
                         f"memory; lower {flag}")
    blocks = cfg.cache_config.num_gpu_blocks
    model = cfg.model_config
    if blocks is None or model is None:
        return
    tp = max(1, int(cfg.parallel_config.tensor_parallel_size))
    kv_heads = max(1, model.get_num_kv_heads() // tp)
    per_block = (2 * model.get_num_layers() * int(cfg.cache_config.block_size) * kv_heads
                 * model.get_head_size() * model.dtype.itemsize)
    kv_bytes = int(blocks) * per_block
    if kv_bytes > total:
        flag = label("num_gpu_blocks")
        raise ValueError(f"{flag} is too large for this machine: its KV cache of {blocks} blocks "
                         f"x {per_block} bytes needs {_gib(kv_bytes)}, and it has {_gib(total)} of "
                         f"memory; lower {flag}")
