"""GGUF files as models, the config side: open a file (errors that name it), and turn its
metadata into the Hugging Face-style config dict the models read.

``LLM(model="x.gguf")`` builds its :class:`~forwardkit.config.model.ModelConfig` with
:func:`gguf_model_config`; the weights are read by ``models/gguf_loader.py``. The metadata keys
read (``<arch>`` is ``general.architecture``: ``llama`` or ``qwen2``):

==========================================  ==========================================
GGUF key                                    config key
==========================================  ==========================================
``<arch>.embedding_length``                 ``hidden_size``
``<arch>.block_count``                      ``num_hidden_layers``
``<arch>.feed_forward_length``              ``intermediate_size``
``<arch>.attention.head_count``             ``num_attention_heads``
``<arch>.attention.head_count_kv``          ``num_key_value_heads``
``<arch>.attention.key_length``             ``head_dim``
``<arch>.rope.freq_base``                   ``rope_theta``
``<arch>.attention.layer_norm_rms_epsilon``  ``rms_norm_eps``
``<arch>.context_length``                   ``max_position_embeddings``
``<arch>.vocab_size`` (or the embedding)    ``vocab_size``
``<arch>.expert_count`` / ``_used_count``   ``num_local_experts`` / ``num_experts_per_tok``
``tokenizer.ggml.bos/eos_token_id``         ``bos_token_id`` / ``eos_token_id``
==========================================  ==========================================

A ``llama`` file with experts is Mixtral. The embedding is tied when ``output.weight`` is
absent. A ``rope_freqs`` tensor (llama.cpp's per-frequency divisors of a scaled rotary) becomes
a ``linear`` or ``llama3`` ``rope_scaling`` when it matches one exactly, and is refused
otherwise. The config also records each tensor's GGUF type (``gguf_tensor_types``), so the
compile hash tells files of different types apart.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from forwardkit.config.model import ModelConfig

__all__ = ["GGUFFile", "GGUFTensor", "SUPPORTED_GGUF_ARCHITECTURES", "gguf_hf_config",
           "gguf_model_config", "is_gguf_path", "open_gguf"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")  # llama with experts: Mixtral
_DTYPE_OF_FILE_TYPE = {0: "float32", 1: "float16", 32: "bfloat16"}  # others: quantized


def is_gguf_path(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` names a GGUF file: a file ending in ``.gguf`` or starting with the magic."""
    if path is None:
        return False
    path = os.fspath(path)
    if not os.path.isfile(path):
        return False
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its name, ggml type id, shape in PyTorch order (ggml's reversed:
    ``[rows, k]`` for a matrix) and its bytes (a read-only view of the mapped file)."""

    name: str
    type_id: int
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes the tensor's data takes in the file."""
        return int(self.data.nbytes)


@dataclass(frozen=True)
class GGUFFile:
    """An opened GGUF file: its path, metadata (key -> value; arrays such as the vocabulary
    are None) and tensors, in file order."""

    path: str
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]

    @property
    def architecture(self) -> str:
        """``general.architecture``."""
        return str(self.metadata.get("general.architecture", ""))

    def tensor_names(self) -> set[str]:
        """Names of every tensor."""
        return {t.name for t in self.tensors}


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - gguf is a dev dependency
        raise ValueError("reading a GGUF file needs the 'gguf' package: pip install gguf") from exc
    return gguf


def _field_value(field: Any) -> Any:
    """A metadata field's value (a scalar or a string); None for an array (the vocabulary and
    its scores: transformers reads them itself; no config key is an array)."""
    gguf = _import_gguf()
    types = field.types
    if not types or types[0] == gguf.GGUFValueType.ARRAY:
        return None
    values = [field.parts[i] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(values[0]).decode("utf-8")
    return values[0].tolist()[0]


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and check a GGUF file (header, metadata, tensor table; the data stays mapped).

    Raises ``ValueError`` naming the file when it is not a GGUF file, is truncated (a tensor's
    data runs past the end) or is otherwise corrupt."""
    path = os.fspath(path)
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # ValueError (magic, version, types), IndexError, OSError, ...
        raise ValueError(f"cannot read GGUF file {path}: {type(exc).__name__}: {exc}; the file "
                         "is truncated, corrupt or not a GGUF file") from None
    size = os.path.getsize(path)
    tensors = []
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or int(t.data.nbytes) != int(t.n_bytes):
            raise ValueError(f"GGUF file {path} is truncated: tensor {t.name!r} needs bytes up to "
                             f"{end}, the file has {size}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors.append(GGUFTensor(t.name, int(t.tensor_type), shape, t.data))
    metadata = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = _field_value(field)
        except Exception as exc:
            raise ValueError(f"cannot read metadata key {key!r} of GGUF file {path}: {exc}") from None
    return GGUFFile(path, metadata, tuple(tensors))


def _positive_int(info: GGUFFile, key: str, required: bool = True) -> int | None:
    value = info.metadata.get(key)
    if value is None:
        if required:
            raise ValueError(f"GGUF file {info.path} has no metadata key {key!r} (needed for the "
                             "model's shape)")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 0:
        raise ValueError(f"metadata key {key!r} of GGUF file {info.path} must be a non-negative "
                         f"integer, got {value!r:.60}")
    return int(value)


def _llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                    original: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` (plain frequency / scaled frequency) of a llama3 rotary."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    scaled = np.where(wavelen < original / high, inv,
                      np.where(wavelen > original / low, inv / factor,
                               (1 - smooth) * inv / factor + smooth * inv))
    return np.asarray(inv / scaled)


def _rope_scaling(info: GGUFFile, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The ``rope_scaling`` of the file: from ``<arch>.rope.scaling.type`` or ``rope_freqs``."""
    kind = info.metadata.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        factor = info.metadata.get(f"{arch}.rope.scaling.factor")
        if kind != "linear" or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"GGUF file {info.path}: rope scaling {kind!r} (factor {factor!r}) is "
                             "not supported; supported: 'linear' with a factor > 0, or a "
                             "rope_freqs tensor of llama3 scaling")
        return {"rope_type": "linear", "factor": float(factor)}
    freqs = next((t for t in info.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    if freqs.type_id != 0 or freqs.shape != (head_dim // 2,):
        raise ValueError(f"GGUF file {info.path}: tensor 'rope_freqs.weight' must be F32 of shape "
                         f"({head_dim // 2},), got type {freqs.type_id} shape {freqs.shape}")
    got = np.asarray(freqs.data, dtype=np.float64)
    if np.allclose(got, got[0], rtol=1e-6) and got[0] > 0:
        return {"rope_type": "linear", "factor": float(got[0])}
    factor = float(got.max())
    # Llama 3.1 / 3.2's settings; any other llama3 setting is refused rather than guessed
    for low, high, original in ((1.0, 4.0, 8192),):
        if np.allclose(_llama3_factors(theta, head_dim, factor, low, high, original), got,
                       rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
    raise ValueError(f"GGUF file {info.path}: the rope_freqs tensor matches neither a linear "
                     "scaling nor llama3 scaling (low_freq_factor 1, high_freq_factor 4, "
                     "original_max_position_embeddings 8192); this rotary is not supported")


def _model_dtype(info: GGUFFile, file_type: Any) -> str:
    """The model's dtype: the file's float type (``general.file_type``, else the type of its
    matrices when all are one float type); bfloat16 for a quantized file."""
    if isinstance(file_type, (int, np.integer)):
        return _DTYPE_OF_FILE_TYPE.get(int(file_type), "bfloat16")
    matrix_types = {t.type_id for t in info.tensors if len(t.shape) >= 2}
    if len(matrix_types) == 1:
        return {0: "float32", 1: "float16", 30: "bfloat16"}.get(matrix_types.pop(), "bfloat16")
    return "bfloat16"


def gguf_hf_config(info: GGUFFile) -> dict[str, Any]:
    """The Hugging Face-style config dict of the model in ``info`` (module doc for the keys).
    Raises ``ValueError`` naming the architecture (with the supported ones) or the metadata key
    that is missing or wrong."""
    arch = info.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF file {info.path}: architecture {arch!r} (general.architecture) is "
                         f"not supported; supported: {list(SUPPORTED_GGUF_ARCHITECTURES)} "
                         "(llama with experts is Mixtral)")
    hidden = _positive_int(info, f"{arch}.embedding_length")
    heads = _positive_int(info, f"{arch}.attention.head_count")
    assert hidden is not None and heads is not None
    kv_heads = _positive_int(info, f"{arch}.attention.head_count_kv", required=False) or heads
    head_dim = _positive_int(info, f"{arch}.attention.key_length", required=False) or hidden // heads
    rope_dims = _positive_int(info, f"{arch}.rope.dimension_count", required=False)
    if rope_dims is not None and rope_dims != head_dim:
        raise ValueError(f"GGUF file {info.path}: {arch}.rope.dimension_count={rope_dims} differs "
                         f"from the head dim {head_dim} (partial rotary is not supported)")
    names = info.tensor_names()
    vocab = _positive_int(info, f"{arch}.vocab_size", required=False)
    if vocab is None:
        embed = next((t for t in info.tensors if t.name == "token_embd.weight"), None)
        if embed is None:
            raise ValueError(f"GGUF file {info.path} has no tensor 'token_embd.weight' and no "
                             f"{arch}.vocab_size")
        vocab = embed.shape[0]
    theta = float(info.metadata.get(f"{arch}.rope.freq_base") or 10000.0)
    experts = _positive_int(info, f"{arch}.expert_count", required=False) or 0
    file_type = info.metadata.get("general.file_type")
    cfg: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": _positive_int(info, f"{arch}.block_count"),
        "intermediate_size": _positive_int(info, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": _positive_int(info, f"{arch}.context_length", required=False) or 2048,
        "rms_norm_eps": float(info.metadata.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": theta,
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": _model_dtype(info, file_type),
        "hidden_act": "silu",
    }
    if arch == "llama" and "blk.0.attn_q.bias" in names:
        cfg["attention_bias"] = True  # llama.cpp adds the biases a llama file carries
    scaling = _rope_scaling(info, arch, theta, head_dim)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if arch == "qwen2":
        cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    elif experts:
        used = _positive_int(info, f"{arch}.expert_used_count")
        cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"],
                   num_local_experts=experts, num_experts_per_tok=used)
    else:
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    for key in ("bos", "eos"):
        token = info.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(token, (int, np.integer)):
            cfg[f"{key}_token_id"] = int(token)
    cfg["gguf_tensor_types"] = {t.name: t.type_id for t in info.tensors}
    return cfg


def gguf_model_config(path: str | os.PathLike[str], dtype: Any = None, **overrides: Any) -> ModelConfig:
    """The ``ModelConfig`` of GGUF file ``path`` (its ``model`` is the file's path)."""
    info = open_gguf(path)
    return ModelConfig(model=info.path, hf_config=gguf_hf_config(info),
                       dtype="auto" if dtype is None else dtype, **overrides)
