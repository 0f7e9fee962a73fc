"""``load_model(engine_config)``: build the model class for the config and fill its weights.

Weights come from a local Hugging Face checkpoint directory (``config.json`` plus
``*.safetensors``, sharded checkpoints through ``model.safetensors.index.json``) or a GGUF file
(``models/gguf_loader.py``: quantized projections stay packed). Pickle-based
formats (``pytorch_model.bin``, ``*.pt``) are refused: loading them can run arbitrary code.
With ``model_config.model`` None (the built-in model or a named shape) the model gets seeded
random weights.

With ``model_config.quantization`` set (``q8_0``, ``q4_0``, ``q4_1``) the attention and MLP
projections hold a ``QuantizedLinearMethod``, and the token embedding and the LM head hold
methods in ``q8_0`` (``config.model.embedding_quantization``; a tied head shares the packed
table): each weight is loaded at full precision, quantized as soon as all of it is loaded and
its full-precision copy freed (``models/weights.py``), so the model is never held at full
precision; seeded random weights are quantized one weight at a time after the fill. MoE experts
are packed in the projections' format (``FusedMoE.quantize_weights``); norms and router gates
stay in the model's dtype. A weight whose rows are not whole 32-weight
blocks is refused (named) before anything is read.

On the CPU the loader also makes the model's ``CpuLinearRouter`` (``kernels/cpu/router.py``)
when forwardkit's CPU kernels serve its weights (one decision, ``_cpu_fast_paths``, read from
the modules before any weight is written: a layer calls the ``forwardkit::linear`` op, the
``cpu_linear`` custom op, on unless ``custom_ops`` has ``"-cpu_linear"``, or holds quantized
weights or experts): it routes those layers' weights (packed copies only when
a second copy fits in memory; a small model's paths are timed) and queues the weights for the
huge-page move (they are asked for on huge pages before they are written). The router travels with
the model (``kernels.cpu.router.attached_router``); the runner binds it around each step.
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from safetensors import safe_open

from forwardkit.config.gguf import is_gguf_path
from forwardkit.config.model import embedding_quantization
from forwardkit.kernels.cpu import hugepages
from forwardkit.kernels.cpu.router import CpuLinearRouter, attach_router
from forwardkit.layers.fused_moe import FusedMoE
from forwardkit.layers.linear import (
    Linear,
    LMHead,
    VocabEmbedding,
    linear_op_weights,
    quantized_layers,
)
from forwardkit.logger import init_logger
from forwardkit.models import get_model_class
from forwardkit.models.default import init_random_weights
from forwardkit.models.gguf_loader import load_gguf_weights
from forwardkit.models.weights import WeightLoadError, missing_parameters, quantize_remaining

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig

__all__ = ["iterate_safetensors", "load_model", "safetensors_files"]

logger = init_logger(__name__)

_INDEX = "model.safetensors.index.json"
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files (from the shard index when there is one)."""
    index = os.path.join(model_dir, _INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{index} is not a valid shard index (need a 'weight_map'): {exc}") from None
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise ValueError(f"{index} lists shard files that do not exist: {absent}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    pickled = sorted(
        os.path.basename(p) for pattern in _PICKLE_PATTERNS for p in glob.glob(os.path.join(model_dir, pattern))
    )
    if pickled:
        raise ValueError(
            f"{model_dir} holds only pickle-format weights {pickled}; forwardkit requires safetensors "
            "(*.safetensors) because unpickling can run arbitrary code. Convert the checkpoint, e.g. "
            "with transformers: model.save_pretrained(dir, safe_serialization=True)"
        )
    raise ValueError(f"no *.safetensors weight files found in model directory {model_dir}")


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


class SafetensorsSlice:
    """One checkpoint tensor, not read yet: its shape and dtype, and the part a rank needs
    (``narrow``) or all of it (``materialize``), read on demand from the open file (a
    ``layers.parallel.TensorSource``). Valid only while its file is being iterated."""

    def __init__(self, handle: Any, name: str, path: str) -> None:
        self._handle, self._name, self._path = handle, name, path
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())
        dtype = _ST_DTYPES.get(self._slice.get_dtype())
        self.dtype = dtype if dtype is not None else self.materialize().dtype

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read ``[start, start + length)`` along ``dim`` (only those bytes are copied)."""
        dim = dim % len(self.shape)
        index = (slice(None),) * dim + (slice(start, start + length),)
        try:
            return self._slice[index]
        except Exception as exc:
            raise _corrupt(self._path, exc, self._name) from exc

    def materialize(self) -> torch.Tensor:
        """Read the whole tensor."""
        try:
            return self._handle.get_tensor(self._name)
        except Exception as exc:
            raise _corrupt(self._path, exc, self._name) from exc


@dataclass(frozen=True)
class _Entry:
    """Where one tensor's bytes lie in a safetensors file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def _read_header(path: str) -> dict[str, _Entry] | None:
    """The tensors of safetensors file ``path``, checked against the file's size; None when a
    tensor has a dtype this reader does not copy (the memory-mapped reader takes the file)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"the file has {size} bytes, no header")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise ValueError(f"a header of {length} bytes does not fit in a {size}-byte file")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    start = 8 + length
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            return None
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes or begin < 0 or start + end > size:
            raise ValueError(f"tensor {name!r}: bytes [{begin}, {end}) of the data do not hold "
                             f"{info['dtype']} {list(shape)} inside the {size}-byte file")
        entries[name] = _Entry(dtype, shape, start + begin, nbytes)
    return entries


def _read_tensor(f: io.BufferedReader, entry: _Entry) -> torch.Tensor:
    """One tensor's bytes, read (not mapped) into a new CPU tensor."""
    out = torch.empty(entry.shape, dtype=entry.dtype)
    view = out.view(-1).view(torch.uint8).numpy().data
    f.seek(entry.offset)
    done = 0
    while done < entry.nbytes:
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"the file ends {entry.nbytes - done} bytes into a tensor")
        done += got
    return out


def _read_file(path: str, entries: dict[str, _Entry]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``path`` (name order), each read into its own memory: nothing of the
    file stays mapped, so the process holds only the tensors it keeps (a memory-mapped file's
    pages count in its resident set until it is closed)."""
    with open(path, "rb") as f:
        for name in sorted(entries):
            try:
                tensor = _read_tensor(f, entries[name])
            except (OSError, ValueError) as exc:
                raise _corrupt(path, exc, name) from exc
            yield name, tensor


def iterate_safetensors(files: list[str], lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` for every tensor of every file, on the CPU, each read into its
    own memory (:func:`_read_file`). With ``lazy`` the values are :class:`SafetensorsSlice`
    objects over the memory-mapped file, so a tensor-parallel rank reads only its shard of each
    (they must be used before the iteration moves on)."""
    for path in files:
        if not lazy:
            try:
                entries = _read_header(path)
            except (OSError, ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
                raise _corrupt(path, exc) from exc
            if entries is not None:
                yield from _read_file(path, entries)
                continue
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as exc:  # SafetensorError (bad header), OSError, ...
            raise _corrupt(path, exc) from exc
        with handle as f:
            for name in list(f.keys()):  # noqa: SIM118 - safe_open is not a mapping
                if lazy:
                    try:
                        lazy_tensor = SafetensorsSlice(f, name, path)
                    except Exception as exc:  # SafetensorError: a bad header entry
                        raise _corrupt(path, exc, name) from exc
                    yield name, lazy_tensor
                    continue
                try:
                    tensor = f.get_tensor(name)
                except Exception as exc:  # truncated data
                    raise _corrupt(path, exc, name) from exc
                yield name, tensor


def _corrupt(path: str, exc: Exception, tensor: str | None = None) -> ValueError:
    what = f" (tensor {tensor!r})" if tensor else ""
    return ValueError(f"cannot read safetensors file {path}{what}: {type(exc).__name__}: {exc}; "
                      "the file is truncated or corrupt: re-download or re-save the checkpoint")


def _check_quantizable(layers: list[tuple[str, Linear | LMHead | VocabEmbedding]]) -> None:
    """Refuse (named) a layer whose weight cannot be cut into blocks, before anything is read."""
    for name, layer in layers:
        if isinstance(layer, VocabEmbedding):
            assert layer.quant_method is not None
            layer.quant_method.check_shape(layer, f"{name}.weight")
        else:
            assert layer.quant_method is not None
            layer.quant_method.check_shape(layer, f"{name}.weight")


def _finish_quantization(model: nn.Module, fmt: str | None, dtype: torch.dtype) -> None:
    """Quantize the weights still at full precision (a checkpoint's were quantized as each
    was loaded; seeded random weights are quantized here, one at a time) and log the sizes."""
    packed_weights = quantize_remaining(model)
    packed = sum(w.numel() for _, w in packed_weights)
    embedding = sum(w.numel() for name, w in packed_weights
                    if name.endswith(("embed_tokens.weight", "lm_head.weight")))
    logger.info("Quantized %d weights: projections to %s (%.1f MB), the token embedding and LM "
                "head to %s (%.1f MB); norms stay in %s", len(packed_weights), fmt,
                (packed - embedding) / 1e6, embedding_quantization(fmt), embedding / 1e6,
                str(dtype).removeprefix("torch."))


def _quantized_experts(model: nn.Module) -> list[FusedMoE]:
    """The MoE layers of ``model`` whose experts are packed in a block format."""
    return [m for m in model.modules() if isinstance(m, FusedMoE) and m.quant_format is not None]


def _finish_expert_quantization(model: nn.Module) -> None:
    """Pack the quantized MoE layers' experts still at full precision (a checkpoint's were
    packed as each layer's last expert tensor arrived; seeded random ones are packed here)."""
    layers = _quantized_experts(model)
    for layer in layers:
        layer.quantize_weights()
    if layers:
        packed = sum(p.numel() for m in layers for p in (m.w13_weight, m.w2_weight))
        logger.info("MoE experts of %d layers packed in %s: %.1f MB", len(layers),
                    layers[0].quant_format, packed / 1e6)


def _cpu_fast_paths(model: nn.Module) -> bool:
    """Whether forwardkit's CPU kernels serve the weights of ``model``: layers calling the
    ``forwardkit::linear`` op, quantized layers or quantized MoE experts. Read from the modules
    right after construction, before any weight is written, and decided once: such a model's
    weights are asked for on huge pages before they are written, and it gets a
    ``CpuLinearRouter``."""
    return bool(quantized_layers(model) or linear_op_weights(model) or _quantized_experts(model))


def load_model(engine_config: EngineConfig) -> nn.Module:
    """Build, load and return the model of ``engine_config`` in eval mode on the platform device.

    On the CPU, when layers call the ``forwardkit::linear`` op (``cpu_linear``, on unless
    ``custom_ops`` has ``"-cpu_linear"``) or hold quantized weights, the model gets a
    ``CpuLinearRouter`` (``attached_router(model)``; module doc): it routes the former and
    queues every weight for the huge-page move; their weights are asked for on huge pages
    before they are written. A plain PyTorch baseline adds ``"-cpu_linear"``.
    """
    from forwardkit.config.engine import set_current_engine_config

    model_config = engine_config.require_model_config()
    hf_config = model_config.hf_config
    model_cls = get_model_class(hf_config.get("architectures"))
    platform = engine_config.platform
    device = platform.device() if platform is not None else torch.device("cpu")
    model_dir = model_config.model
    gguf = is_gguf_path(model_dir)
    files = safetensors_files(model_dir) if model_dir is not None and not gguf else []
    with set_current_engine_config(engine_config), torch.device(device):
        model = model_cls(engine_config)
    quantized = quantized_layers(model)
    _check_quantizable(quantized)
    fast_paths = device.type == "cpu" and _cpu_fast_paths(model)
    if fast_paths:
        # Before anything writes them: the weights then fault in on huge pages as they are
        # written (faster than 4 KiB faults, and nothing is left for the move after the first
        # step, which stalls the steps that run beside it; see kernels/cpu/hugepages.py).
        for t in model.parameters():
            hugepages.advise(t)
    if model_dir is None:
        init_random_weights(model)
        logger.info_once("Built %s with seeded random weights (no checkpoint)", model_cls.__name__)
    elif gguf:
        assert model_dir is not None
        loaded = load_gguf_weights(model, model_dir, model_config.dtype)
        missing = missing_parameters(model, loaded)
        if missing:
            raise WeightLoadError(missing=missing, source=f"GGUF file {model_dir}")
    else:
        try:
            # a rank holding a shard of the weights reads only that shard of each tensor
            pc = engine_config.parallel_config
            lazy = pc.tensor_parallel_size > 1 or (pc.enable_expert_parallel
                                                   and pc.data_parallel_size > 1)
            loaded = model.load_weights(iterate_safetensors(files, lazy=lazy))
        except WeightLoadError as exc:
            raise WeightLoadError(
                exc.missing, exc.unexpected, exc.mismatched, source=f"checkpoint {model_dir}"
            ) from None
        missing = missing_parameters(model, loaded)
        if missing:
            raise WeightLoadError(missing=missing, source=f"checkpoint {model_dir}")
        logger.info("Loaded %s from %s (%d files)", model_cls.__name__, model_dir, len(files))
    if quantized:
        _finish_quantization(model, model_config.quantization, model_config.dtype)
    _finish_expert_quantization(model)
    if fast_paths:
        router = CpuLinearRouter()
        # What is not on huge pages yet (written before it could be advised: packed quantized
        # blocks) moves in the background once the runner has served its first step (memory
        # already huge is skipped at once). Quantized weights too: a decode step streams them.
        router.huge_pages.defer(model.parameters())
        router.route_weights(linear_op_weights(model))
        attach_router(model, router)
    return model.eval()
