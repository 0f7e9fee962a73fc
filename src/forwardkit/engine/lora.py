"""LoRA adapters in the engine: requests, PEFT adapters from disk or memory, slots and LRU.

* :class:`LoRARequest` (``lora_name``, ``lora_int_id``, ``lora_path``) names an adapter, as in
  vLLM; ``LLM.generate(..., lora_request=)`` takes one for every prompt or one per prompt.
* :func:`read_peft_dir` reads a PEFT adapter directory (``adapter_config.json`` +
  ``adapter_model.safetensors``); :meth:`LoRAManager.build_adapter` checks its tensors against
  the model (every key names a projection the model has and can adapt, shapes match, rank at
  most ``max_lora_rank``) and turns them into per-projection, per-slice ``(A, B x scaling)``
  pairs (scaling ``lora_alpha / r``, rsLoRA ``lora_alpha / sqrt(r)``). Every error names the
  file (or ``update_lora``) and the field or tensor.
* :class:`LoRAManager` keeps up to ``max_cpu_loras`` adapters loaded on the host (least
  recently used ones with a path are dropped and read again when asked for; adapters given as
  tensors stay) and puts the adapters of a step into the model's ``max_loras`` slots, swapping
  out the least recently used adapter no request of the step needs. A slot is a copy into the
  persistent buffers of ``layers/lora.py``: nothing is recompiled or recaptured.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from forwardkit.layers.lora import LoRASlots
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from forwardkit.config.lora import LoRAConfig

__all__ = ["LoRAAdapter", "LoRAError", "LoRAManager", "LoRARequest", "SlotWeights",
           "pack_slot_weights", "read_peft_dir", "unpack_slot_weights", "write_slot"]

logger = init_logger(__name__)

# PEFT's name for a base model's module inside a PeftModel: "base_model.model.<module>"
_PEFT_PREFIX = "base_model.model."
_ADAPTABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAError(ValueError):
    """An adapter that cannot be served: names the file (or source) and the field or tensor."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to generate with: ``lora_name`` (unique), ``lora_int_id`` (an integer >= 1,
    unique) and ``lora_path`` (a PEFT adapter directory; "" for one given as tensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got "
                             f"{self.lora_name!r:.60}")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or self.lora_int_id < 1):
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got "
                             f"{self.lora_int_id!r:.60}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise ValueError(f"LoRARequest.lora_path must be a directory path, got "
                             f"{self.lora_path!r:.60}")


@dataclass
class LoRAAdapter:
    """A checked adapter on the host: per projection name, per slice index, ``(A, B x s)``."""

    request: LoRARequest
    rank: int
    scaling: float
    weights: SlotWeights = field(default_factory=dict)
    lora_alpha: float = 0.0
    use_rslora: bool = False

    @property
    def in_memory(self) -> bool:
        """Given as tensors (no path to read it again from)."""
        return not self.request.lora_path


def read_peft_dir(path: str) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """``(adapter_config.json as a dict, tensors of adapter_model.safetensors)`` of a PEFT
    adapter directory; ``LoRAError`` naming the file when one is missing or unreadable."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise LoRAError(f"lora_path={path!r} is not a directory (expected a PEFT adapter: "
                        "adapter_config.json and adapter_model.safetensors)")
    config_path = os.path.join(path, "adapter_config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise LoRAError(f"{config_path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise LoRAError(f"{config_path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        other = [n for n in ("adapter_model.bin", "adapter_model.pt") if
                 os.path.isfile(os.path.join(path, n))]
        hint = f" ({other[0]} is not read: pickled weights; save with safetensors)" if other else ""
        raise LoRAError(f"{weights_path}: missing{hint}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LoRAError(f"{weights_path}: not a readable safetensors file ({exc})") from None
    return config, tensors


def _config_value(config: Mapping[str, object], key: str, source: str,
                  default: object = None) -> object:
    value = config.get(key, default)
    if value is None:
        raise LoRAError(f"{source}: field {key!r} is missing")
    return value


SlotWeights = dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]


def write_slot(slots: Mapping[str, LoRASlots], slot: int, weights: SlotWeights | None) -> None:
    """Fill slot ``slot`` of every projection from ``weights`` (full tensors, per projection
    and slice; projections not named, or ``weights`` None, are cleared)."""
    for proj, proj_slots in slots.items():
        mine = None if weights is None else weights.get(proj)
        if mine is None:
            proj_slots.clear(slot)
        else:
            proj_slots.load(slot, mine)


def pack_slot_weights(weights: SlotWeights | None) -> bytes | None:
    """``weights`` as bytes for a TP worker's socket (tensors are not sent as shared memory)."""
    if weights is None:
        return None
    buf = io.BytesIO()
    torch.save(weights, buf)
    return buf.getvalue()


def unpack_slot_weights(data: bytes | None) -> SlotWeights | None:
    """The inverse of :func:`pack_slot_weights`."""
    if data is None:
        return None
    weights: SlotWeights = torch.load(io.BytesIO(data), weights_only=True)
    return weights


class LoRAManager:
    """The engine's adapters: registered requests, host copies (LRU), slots (LRU).

    Args:
        config: the engine's ``LoRAConfig``.
        model: the model (its ``map_weight_name`` places PEFT module names).
        slots: the model's slot buffers by projection name (the runner attached them).
    """

    def __init__(self, config: LoRAConfig, model: nn.Module, slots: Mapping[str, LoRASlots]) -> None:
        self.config = config
        self.max_loras = int(config.max_loras)
        self.max_rank = int(config.max_lora_rank)
        self.max_cpu_loras = int(config.max_cpu_loras or config.max_loras)
        self.model = model
        self.slots = dict(slots)
        if not self.slots:
            raise ValueError("enable_lora=True, but the model has no projection that can take "
                             "an adapter")
        self.dtype = next(iter(self.slots.values())).a.dtype
        self.requests: dict[int, LoRARequest] = {}  # registered: id -> request
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # host copies, LRU first
        self.slot_ids: list[int | None] = [None] * self.max_loras
        self._slot_lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.max_loras))
        self.versions: dict[int, int] = {}  # updates of an adapter (part of its cache key)
        self.loads = 0  # adapters read from disk (reloads included)
        self.slot_loads = 0  # adapters copied into a slot
        # called after a slot is written (slot, weights by projection; None: cleared), so the
        # other TP ranks write theirs (each takes its own part of the full tensors)
        self.on_slot_write: Callable[[int, SlotWeights | None], None] | None = None

    # ------------------------------------------------------------------ building adapters
    def build_adapter(self, request: LoRARequest, config: Mapping[str, object],
                      tensors: Mapping[str, torch.Tensor], source: str,
                      cfg_source: str) -> LoRAAdapter:
        """Check ``tensors`` (PEFT names) against the model; the adapter, or ``LoRAError``
        naming ``source`` (the tensors) or ``cfg_source`` (the config) and the field or
        tensor. Changes nothing."""
        rank = _config_value(config, "r", cfg_source)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise LoRAError(f"{cfg_source}: r={rank!r} is invalid; expected an integer >= 1")
        if rank > self.max_rank:
            raise LoRAError(f"{cfg_source}: r={rank} is above max_lora_rank={self.max_rank} "
                            "(LLM(max_lora_rank=...) raises it)")
        alpha = config.get("lora_alpha", 8)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise LoRAError(f"{cfg_source}: lora_alpha={alpha!r} is invalid; expected a number")
        rslora = config.get("use_rslora", False)
        if not isinstance(rslora, bool):
            raise LoRAError(f"{cfg_source}: use_rslora={rslora!r} is invalid; expected a bool")
        for key in ("rank_pattern", "alpha_pattern"):
            if config.get(key):
                raise LoRAError(f"{cfg_source}: {key}={config[key]!r} is not supported (one rank "
                                "and alpha for every module)")
        if config.get("use_dora"):
            raise LoRAError(f"{cfg_source}: use_dora=true is not supported (plain LoRA only)")
        if config.get("modules_to_save"):
            raise LoRAError(f"{cfg_source}: modules_to_save={config['modules_to_save']!r} is not "
                            "supported (only LoRA A/B of the projections are served)")
        targets = config.get("target_modules")
        if isinstance(targets, list):
            bad = [t for t in targets if t not in _ADAPTABLE]
            if bad:
                raise LoRAError(f"{cfg_source}: target_modules names {bad}, which this engine "
                                f"cannot adapt; accepted: {', '.join(_ADAPTABLE)}")
        scaling = float(alpha) / (math.sqrt(rank) if rslora else rank)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise LoRAError(f"{source}: {key!r} is a {type(tensor).__name__}, not a tensor")
            name = key.removeprefix(_PEFT_PREFIX)
            for part in (".lora_A.weight", ".lora_B.weight"):
                if name.endswith(part):
                    pairs.setdefault(name[: -len(part)], {})[part[6]] = tensor
                    break
            else:
                raise LoRAError(f"{source}: tensor {key!r} is not a LoRA A/B weight "
                                "(expected ...<module>.lora_A.weight / .lora_B.weight)")
        if not pairs:
            raise LoRAError(f"{source}: no LoRA tensors")
        adapter = LoRAAdapter(request, rank, scaling, lora_alpha=float(alpha), use_rslora=rslora)
        for module, ab in sorted(pairs.items()):
            for side in ("A", "B"):
                if side not in ab:
                    raise LoRAError(f"{source}: {module}.lora_{side}.weight is missing (its "
                                    f"lora_{'B' if side == 'A' else 'A'} is there)")
            proj, sl_index, slots = self._target(module, source)
            sl = slots.slices[sl_index]
            a, b = ab["A"], ab["B"]
            want_a, want_b = (rank, slots.full_input_size), (sl.full_out_size, rank)
            for side, t, want in (("A", a, want_a), ("B", b, want_b)):
                if tuple(t.shape) != want:
                    raise LoRAError(f"{source}: {module}.lora_{side}.weight has shape "
                                    f"{tuple(t.shape)}, expected {want} (r={rank})")
                if not t.is_floating_point():
                    raise LoRAError(f"{source}: {module}.lora_{side}.weight has dtype {t.dtype}; "
                                    "expected a floating-point tensor")
                # one reduction pass (inf / nan propagate into the sum); the exact check
                # only when the sum is not finite (a huge finite sum could overflow)
                if not math.isfinite(float(t.sum())) and not bool(torch.isfinite(t).all()):
                    raise LoRAError(f"{source}: {module}.lora_{side}.weight holds inf or nan")
            per_proj = adapter.weights.setdefault(proj, {})
            if sl_index in per_proj:
                raise LoRAError(f"{source}: {module} is given twice")
            scaled = b.detach().to("cpu", torch.float32, copy=True).mul_(scaling)
            # copies: the caller (a trainer) may change its tensors in place afterwards
            per_proj[sl_index] = (a.detach().to("cpu", self.dtype, copy=True), scaled.to(self.dtype))
        return adapter

    def _target(self, module: str, source: str) -> tuple[str, int, LoRASlots]:
        """``(projection name, slice index, slots)`` of a PEFT module name."""
        mapper = getattr(self.model, "map_weight_name", None)
        mapped = mapper(module + ".weight") if mapper is not None else (module + ".weight", None)
        if mapped is not None:
            param, shard = mapped
            proj = param.removesuffix(".weight")
            slots = self.slots.get(proj)
            if slots is not None:
                try:
                    return proj, slots.slice_of(shard), slots
                except KeyError:
                    pass
        raise LoRAError(f"{source}: the adapter targets {module!r}, which this model has no "
                        f"adaptable projection for (accepted: {', '.join(_ADAPTABLE)} of each "
                        "layer; Mixtral: attention only)")

    def adapter_from_dir(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check ``request``'s PEFT directory."""
        path = os.fspath(request.lora_path)
        config, tensors = read_peft_dir(path)
        self.loads += 1
        return self.build_adapter(request, config, tensors,
                                  os.path.join(path, "adapter_model.safetensors"),
                                  os.path.join(path, "adapter_config.json"))

    # ------------------------------------------------------------------ registry
    def check_request(self, request: LoRARequest) -> None:
        """``ValueError`` when ``request`` conflicts with a registered adapter (same id with
        another name, same name with another id)."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known.lora_name != request.lora_name:
            raise ValueError(f"lora_int_id={request.lora_int_id} is adapter "
                             f"{known.lora_name!r}, not {request.lora_name!r}")
        for other in self.requests.values():
            if other.lora_name == request.lora_name and other.lora_int_id != request.lora_int_id:
                raise ValueError(f"lora_name={request.lora_name!r} is registered with "
                                 f"lora_int_id={other.lora_int_id}, not {request.lora_int_id}")

    def add(self, request: LoRARequest) -> bool:
        """Register (and load) ``request``'s adapter; False when it is registered already."""
        self.check_request(request)
        if request.lora_int_id in self.requests:
            return False
        if not request.lora_path:
            raise LoRAError(f"LoRARequest {request.lora_name!r} has no lora_path; adapters "
                            "without one are given as tensors (LLM.update_lora)")
        self.register(self.adapter_from_dir(request))
        return True

    def register(self, adapter: LoRAAdapter) -> None:
        """Register a checked adapter (its host copy kept)."""
        self.requests[adapter.request.lora_int_id] = adapter.request
        self._keep(adapter)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot is freed); ``ValueError`` for an unknown id."""
        if lora_int_id not in self.requests:
            raise ValueError(f"remove_lora: lora_int_id={lora_int_id!r} is not a registered "
                             f"adapter; registered: {sorted(self.requests)}")
        del self.requests[lora_int_id]
        self.loaded.pop(lora_int_id, None)
        for slot, held in enumerate(self.slot_ids):
            if held == lora_int_id:
                self.slot_ids[slot] = None
                write_slot(self.slots, slot, None)
                if self.on_slot_write is not None:
                    self.on_slot_write(slot, None)
        return True

    def update(self, name: str, tensors: Mapping[str, torch.Tensor],
               config: Mapping[str, object] | None) -> LoRARequest:
        """Load adapter ``name`` from PEFT-named tensors (all or nothing)."""
        known = next((r for r in self.requests.values() if r.lora_name == name), None)
        old = self.loaded.get(known.lora_int_id) if known is not None else None
        if config is None:
            if known is None:
                raise ValueError(f"update_lora({name!r}): a new adapter needs config= (its "
                                 "adapter_config: lora_alpha, use_rslora; r is read from the "
                                 "tensors when absent)")
            if old is not None:
                config = {"lora_alpha": old.lora_alpha, "use_rslora": old.use_rslora}
            else:
                config = read_peft_dir(os.fspath(known.lora_path))[0]
        config = dict(config)
        if "r" not in config:
            rank = next((int(t.shape[0]) for k, t in tensors.items() if k.endswith("lora_A.weight")), None)
            if rank is not None:
                config["r"] = rank
        request = known if known is not None else LoRARequest(
            name, max(self.requests, default=0) + 1, "")
        adapter = self.build_adapter(request, config, tensors, f"update_lora({name!r})",
                                     f"update_lora({name!r}) config")
        # checked: now commit
        self.requests[request.lora_int_id] = request
        self.loaded.pop(request.lora_int_id, None)
        self._keep(adapter)
        self.versions[request.lora_int_id] = self.versions.get(request.lora_int_id, 0) + 1
        if request.lora_int_id in self.slot_ids:
            self._write_slot(self.slot_ids.index(request.lora_int_id), adapter)
        return request

    def registered_ids(self) -> set[int]:
        """Registered adapter ids."""
        return set(self.requests)

    def cache_key(self, lora_int_id: int) -> tuple[int, ...]:
        """What a request with this adapter adds to its KV blocks' hash: the id (as vLLM), and
        the update count once ``update_lora`` changed it."""
        version = self.versions.get(lora_int_id, 0)
        return (lora_int_id,) if version == 0 else (lora_int_id, version)

    # ------------------------------------------------------------------ host copies, slots
    def _keep(self, adapter: LoRAAdapter) -> None:
        lid = adapter.request.lora_int_id
        self.loaded[lid] = adapter
        self.loaded.move_to_end(lid)
        while len(self.loaded) > self.max_cpu_loras:
            victim = next((i for i, a in self.loaded.items()
                           if not a.in_memory and i not in self.slot_ids and i != lid), None)
            if victim is None:
                break  # every other host copy is in a slot or has no path to read it from
            del self.loaded[victim]

    def _adapter(self, lora_int_id: int) -> LoRAAdapter:
        adapter = self.loaded.get(lora_int_id)
        if adapter is None:  # dropped from the host cache: read again
            adapter = self.adapter_from_dir(self.requests[lora_int_id])
        self._keep(adapter)
        return adapter

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        write_slot(self.slots, slot, adapter.weights)
        self.slot_ids[slot] = adapter.request.lora_int_id
        self.slot_loads += 1
        if self.on_slot_write is not None:
            self.on_slot_write(slot, adapter.weights)

    def activate(self, lora_ids: Sequence[int]) -> list[int]:
        """Put the adapters of a step into slots; returns the slot of each entry of
        ``lora_ids`` (-1 for 0: no adapter). At most ``max_loras`` distinct ids."""
        wanted = list(dict.fromkeys(i for i in lora_ids if i))
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step holds {len(wanted)} adapters, more than max_loras="
                             f"{self.max_loras}")
        slot_of: dict[int, int] = {}
        for lid in wanted:
            if lid in self.slot_ids:
                slot_of[lid] = self.slot_ids.index(lid)
        for lid in wanted:
            if lid in slot_of:
                continue
            empty = [s for s in self._slot_lru if self.slot_ids[s] is None]
            free = empty[0] if empty else next(s for s in self._slot_lru
                                               if self.slot_ids[s] not in wanted)
            self.slot_ids[free] = None  # swapped out: its host copy may be dropped now
            self._write_slot(free, self._adapter(lid))
            slot_of[lid] = free
        for slot in slot_of.values():
            self._slot_lru.move_to_end(slot)
        return [slot_of[i] if i else -1 for i in lora_ids]
