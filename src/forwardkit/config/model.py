"""``ModelConfig``: what config resolution needs to know about the model.

Built from explicit fields (``ModelConfig(hf_config={...})``) or from a local Hugging Face
checkpoint directory with :meth:`ModelConfig.from_pretrained`, which reads ``config.json``.
Derived facts (``architectures``, ``is_moe``, ``is_encoder_decoder``, hidden size, ...) are
read from ``hf_config`` so they can never disagree with it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from forwardkit.config.frozen import FreezableConfig
from forwardkit.config.utils import hash_factors, normalize_value, short_repr

__all__ = ["EMBEDDING_QUANTIZATION", "QUANTIZATION_FORMATS", "SUPPORTED_ROPE_TYPES", "ModelConfig",
           "embedding_quantization", "resolve_dtype", "rope_parameters"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
_ACCEPTED = "'auto', 'float32', 'bfloat16', 'float16' (or a torch.dtype of those)"
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# Used when config.json does not say how long a sequence may be (vLLM falls back to 2048 too).
_FALLBACK_MAX_MODEL_LEN = 2048


# Weight formats ``ModelConfig.quantization`` accepts (``forwardkit.quantization.formats``).
QUANTIZATION_FORMATS = ("q8_0", "q4_0", "q4_1")
# The format of the token embedding and the LM head (tied or not) of a model quantized on load,
# whatever the projections' format: llama-quantize keeps the output tensor wider than 4 bits
# (Q6_K); q8_0 is the nearest wider format with a native kernel here.
EMBEDDING_QUANTIZATION = "q8_0"


# GGUF tensor types held in 32-weight blocks by the loader (Q8_0, Q4_0, Q4_1 as they are; Q4_K
# and Q6_K repacked into them).
GGUF_BLOCK_TYPES = frozenset({2, 3, 8, 12, 14})


def embedding_quantization(quantization: str | None) -> str | None:
    """The format the token embedding and the LM head are held in when the projections are
    quantized on load to ``quantization`` (None: unquantized, the model's dtype)."""
    return None if quantization is None else EMBEDDING_QUANTIZATION


def resolve_dtype(dtype: str | torch.dtype | None, hf_config: dict[str, Any] | None = None) -> torch.dtype:
    """Turn a dtype request into a ``torch.dtype``.

    ``'auto'``/None takes ``torch_dtype`` (or ``dtype``) from the HF config, and float32 when the
    config names none. Strings may be spelled ``'torch.bfloat16'`` too.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; accepted: {_ACCEPTED}")
        return dtype
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        hf = hf_config or {}
        name = hf.get("torch_dtype") or hf.get("dtype")
        if name is None:
            return torch.float32
        return resolve_dtype(name)
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be a string or torch.dtype, got {dtype!r}; accepted: {_ACCEPTED}")
    key = dtype.strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; accepted: {_ACCEPTED}")
    return _DTYPES[key]


# config.json keys the models read as sizes (each a positive int when present) or as numbers.
_SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim",
              "num_experts_per_tok", "moe_intermediate_size")
_NUMBER_KEYS = ("rms_norm_eps", "rope_theta")


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Keys each scaled rope type reads from its scaling dict: (key, must be an integer).
_ROPE_KEYS: dict[str, tuple[tuple[str, bool], ...]] = {
    "linear": (("factor", False),),
    "llama3": (("factor", False), ("low_freq_factor", False), ("high_freq_factor", False),
               ("original_max_position_embeddings", True)),
}


def rope_parameters(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` from an HF config (old ``rope_theta``/``rope_scaling`` keys or
    transformers-5 ``rope_parameters``); ``scaling`` is None for plain rope. Assumes a config
    that passed ``ModelConfig``'s checks (:func:`_check_rope`)."""
    params = dict(hf_config.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    scaling = hf_config.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            return theta, None
        scaling["rope_type"] = rope_type
    return theta, scaling


def _is_positive_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value < float("inf"))


def _check_rope(hf_config: dict[str, Any], where: str) -> None:
    """ValueError naming ``rope_scaling`` / ``rope_parameters`` (and the bad key in it) when
    the rotary settings cannot be used."""
    for key in ("rope_scaling", "rope_parameters"):
        value = hf_config.get(key)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{key!r}{where} must be an object (a dict of rope settings) or null, "
                             f"got {short_repr(value)} ({type(value).__name__})")
    theta = (hf_config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and not _is_positive_number(theta):
        raise ValueError(f"'rope_parameters.rope_theta'{where} must be a finite number > 0, got "
                         f"{short_repr(theta)} ({type(theta).__name__})")
    key = "rope_scaling" if hf_config.get("rope_scaling") else "rope_parameters"
    _, scaling = rope_parameters(hf_config)
    if scaling is None:
        return
    rope_type = scaling["rope_type"]
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"'{key}.rope_type'{where} must be one of {list(SUPPORTED_ROPE_TYPES)}, "
                         f"got {short_repr(rope_type)}")
    for name, integer in _ROPE_KEYS.get(rope_type, ()):
        value = scaling.get(name)
        ok = (isinstance(value, int) and not isinstance(value, bool) and value > 0) if integer \
            else _is_positive_number(value)
        if not ok:
            kind = "a positive integer" if integer else "a finite number > 0"
            got = "it is missing" if name not in scaling else \
                f"got {short_repr(value)} ({type(value).__name__})"
            raise ValueError(f"'{key}.{name}'{where} must be {kind} for rope_type "
                             f"{rope_type!r}; {got}")


def _check_eos(hf_config: dict[str, Any], where: str) -> None:
    """ValueError naming ``eos_token_id`` unless it is null, a token id or a list of them."""
    value = hf_config.get("eos_token_id")
    if value is None:
        return
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"'eos_token_id'{where} must be a token id (an integer >= 0), a list of "
                         f"them or null, got {short_repr(value)} ({type(value).__name__})")


def _check_hf_config(hf_config: dict[str, Any], model: str | None) -> None:
    """ValueError naming the key (and config.json) whose value has the wrong type."""
    where = f" in {os.path.join(model, 'config.json')}" if model is not None else ""
    _check_rope(hf_config, where)
    _check_eos(hf_config, where)
    for key in _SIZE_KEYS:
        value = hf_config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{key!r}{where} must be a positive integer, got {short_repr(value)} "
                             f"({type(value).__name__})")
    for key in _EXPERT_KEYS:  # 0 means "not a MoE model"
        value = hf_config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{key!r}{where} must be an integer >= 0, got {short_repr(value)} "
                             f"({type(value).__name__})")
    for key in _NUMBER_KEYS:
        value = hf_config.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not 0 < value < float("inf")):
            raise ValueError(f"{key!r}{where} must be a finite number > 0, got {short_repr(value)} "
                             f"({type(value).__name__})")


@dataclass(config=ConfigDict(extra="forbid", arbitrary_types_allowed=True))
class ModelConfig(FreezableConfig):
    """The model an engine runs: checkpoint dir (or None), its HF config and runtime choices."""

    model: str | None = None
    """Local Hugging Face checkpoint directory; None = the built-in default model."""
    hf_config: dict[str, Any] = Field(default_factory=dict)
    """The parsed ``config.json``."""
    dtype: Any = "auto"
    """Weights/activation dtype: 'auto' (from the HF config), a name, or a torch.dtype."""
    max_model_len: int | None = None
    """Longest sequence; None = ``max_position_embeddings`` of the HF config."""
    enforce_eager: bool = False
    """Never compile and never use CUDA graphs (forces optimisation level O0)."""
    disable_cascade_attn: bool = False
    """Turn cascade attention off."""
    runner: Literal["generate", "pooling"] = "generate"
    """``pooling`` marks an embedding/classification model (it gets a pooler config)."""
    pooler_config: dict[str, Any] | None = None
    """Non-None for pooling models."""
    quantization: str | None = None
    """Block format the attention/MLP projections are quantized to on load (``q8_0``, ``q4_0``,
    ``q4_1``); None keeps every weight in ``dtype``. The token embedding and the LM head are then
    held in :data:`EMBEDDING_QUANTIZATION` (``q8_0``), MoE experts in the projections' format;
    norms, biases and MoE router gates stay in ``dtype``."""

    def __post_init__(self) -> None:
        if self.model is not None:
            self.model = os.fspath(self.model)
        _check_hf_config(self.hf_config, self.model)
        self.dtype = resolve_dtype(self.dtype, self.hf_config)
        if self.quantization is not None and self.quantization not in QUANTIZATION_FORMATS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_FORMATS)} or None, "
                             f"got {short_repr(self.quantization)}")
        if self.runner == "pooling" and self.pooler_config is None:
            self.pooler_config = {}
        limit = self.hf_config.get("max_position_embeddings")
        if self.max_model_len is None:
            self.max_model_len = int(limit) if limit else _FALLBACK_MAX_MODEL_LEN
        elif self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        elif limit and self.max_model_len > int(limit):
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's "
                f"max_position_embeddings ({limit})"
            )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], dtype: str | torch.dtype | None = None,
                        **overrides: Any) -> ModelConfig:
        """Read ``<path>/config.json``; ``overrides`` set other fields (``max_model_len=...``)."""
        directory = os.fspath(path)
        if not os.path.isdir(directory):
            raise ValueError(f"model path {directory!r} is not a directory (expected a local "
                             "Hugging Face checkpoint with config.json, or a GGUF file)")
        config_file = os.path.join(directory, "config.json")
        if not os.path.isfile(config_file):
            raise ValueError(f"no config.json in model directory {directory!r}")
        try:
            with open(config_file, encoding="utf-8") as f:
                hf_config = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{config_file} is not valid JSON: {exc}") from None
        if not isinstance(hf_config, dict):
            raise ValueError(f"{config_file} must hold a JSON object, got {type(hf_config).__name__}")
        return cls(model=directory, hf_config=hf_config, dtype="auto" if dtype is None else dtype,
                   **overrides)

    # ------------------------------------------------------------------ derived facts
    @property
    def architectures(self) -> list[str]:
        """``architectures`` of the HF config (``[]`` when absent)."""
        return list(self.hf_config.get("architectures") or [])

    @property
    def architecture(self) -> str | None:
        """The first architecture name, or None."""
        archs = self.architectures
        return archs[0] if archs else None

    @property
    def is_moe(self) -> bool:
        """The model has experts (``num_local_experts``/``num_experts`` > 0)."""
        return any((self.hf_config.get(key) or 0) > 0 for key in _EXPERT_KEYS)

    @property
    def is_encoder_decoder(self) -> bool:
        """The HF config says ``is_encoder_decoder``."""
        return bool(self.hf_config.get("is_encoder_decoder", False))

    @property
    def is_pooling_model(self) -> bool:
        """Has a pooler config (an embedding/classification model)."""
        return self.pooler_config is not None

    def _get(self, *keys: str) -> Any:
        for key in keys:
            if self.hf_config.get(key) is not None:
                return self.hf_config[key]
        raise ValueError(f"the model's HF config has none of {list(keys)} (model={self.model!r})")

    def get_hidden_size(self) -> int:
        """``hidden_size`` of the HF config."""
        return int(self._get("hidden_size", "d_model", "n_embd"))

    def get_num_layers(self) -> int:
        """Number of decoder layers."""
        return int(self._get("num_hidden_layers", "n_layer", "num_layers"))

    def get_num_attention_heads(self) -> int:
        """Query heads per layer."""
        return int(self._get("num_attention_heads", "n_head"))

    def get_num_kv_heads(self) -> int:
        """Key/value heads per layer (= attention heads without GQA)."""
        value = self.hf_config.get("num_key_value_heads")
        return int(value) if value is not None else self.get_num_attention_heads()

    def get_head_size(self) -> int:
        """Per-head dimension (``head_dim`` or hidden / heads)."""
        value = self.hf_config.get("head_dim")
        if value is not None:
            return int(value)
        return self.get_hidden_size() // self.get_num_attention_heads()

    def get_max_model_len(self) -> int:
        """``max_model_len`` as resolved at construction (None is replaced there)."""
        if self.max_model_len is None:
            raise ValueError("max_model_len is None; it is resolved when the ModelConfig is built")
        return self.max_model_len

    def get_vocab_size(self) -> int:
        """Vocabulary size."""
        return int(self._get("vocab_size"))

    def compute_hash(self) -> str:
        """SHA-256 over what shapes the compiled graph (HF config, dtype, limits, eagerness)."""
        factors = {
            "hf_config": self.hf_config,
            "dtype": str(self.dtype),
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "runner": self.runner,
        }
        if self.quantization is not None:  # (unquantized models keep their earlier hash)
            factors["quantization"] = self.quantization
            factors["embedding_quantization"] = embedding_quantization(self.quantization)
        return hash_factors({k: normalize_value(v) for k, v in factors.items()})
