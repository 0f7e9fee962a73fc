"""Live weight updates and sleep / wake-up of a running engine (the RL-rollout side of ``LLM``).

``update_weights`` copies Hugging Face-named tensors into the model's parameters in place,
through the same name mapping (``model.map_weight_name``) and per-parameter ``weight_loader``
the checkpoint loader uses, so merged projections (``qkv_proj``, ``gate_up_proj``) and MoE
experts work. It is all or nothing: every name, shard and shape is checked on storage-less
twins of the parameters first, and only then is anything copied. Compiled pieces and CUDA
graphs read the parameters' storage, so in-place copies need no recompilation and no
re-capture; the one configuration that would bake the old values into compiled code
(Inductor ``freezing``, which folds parameters into constants) is refused.

``sleep`` releases the KV cache's memory (the tensors keep their shape, their storage goes to
zero bytes) and ``wake_up`` gives it back, zeroed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from forwardkit.config.compilation_enums import CompilationMode, CUDAGraphMode
from forwardkit.kernels.cpu import hugepages
from forwardkit.kernels.cpu.router import attached_router
from forwardkit.logger import init_logger
from forwardkit.models.weights import WeightLoadError, check_named_weights, load_named_weights

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig

__all__ = ["KVCacheSleeper", "WeightUpdateError", "freezing_reason", "prepare_weight_update",
           "update_model_weights"]

logger = init_logger(__name__)


class WeightUpdateError(ValueError):
    """``update_weights`` was refused; nothing in the model changed."""


def freezing_reason(engine_config: EngineConfig) -> str | None:
    """Why compiled code of this engine would keep stale weights after an in-place update
    (Inductor freezing folds parameters into constants), or None when updates are safe."""
    cc = engine_config.compilation_config
    mode = cc.mode if cc.mode is not None else CompilationMode.NONE
    if mode == CompilationMode.NONE or engine_config.require_model_config().enforce_eager:
        return None
    if (cc.backend or "inductor") != "inductor":
        return None
    if cc.inductor_compile_config.get("freezing"):
        return "compilation_config.inductor_compile_config['freezing'] is set"
    import torch._inductor.config as inductor_config

    if getattr(inductor_config, "freezing", False):
        return "torch._inductor.config.freezing is set"
    return None


def _unwrap(model: nn.Module) -> nn.Module:
    """The model under a CUDA-graph wrapper (which forwards calls but not ``map_weight_name``)."""
    inner = getattr(model, "runnable", None)
    return inner if isinstance(inner, nn.Module) and hasattr(inner, "map_weight_name") else model


def _as_pairs(named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
    """Materialise and type-check ``named_tensors`` (an iterable of ``(name, tensor)`` or a dict)."""
    if isinstance(named_tensors, dict):
        named_tensors = named_tensors.items()
    if isinstance(named_tensors, (str, bytes, torch.Tensor)) or not isinstance(named_tensors, Iterable):
        raise WeightUpdateError(
            f"update_weights(named_tensors={type(named_tensors).__name__}) is invalid; expected an "
            "iterable of (hf_name, tensor) pairs or a dict name -> tensor"
        )
    pairs = []
    for i, item in enumerate(named_tensors):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise WeightUpdateError(
                f"update_weights: item {i} is {type(item).__name__} {str(item)[:60]!r}; "
                "expected a (hf_name, tensor) pair"
            )
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(
                f"update_weights: item {i} is ({type(name).__name__}, {type(tensor).__name__}); "
                "expected (str, torch.Tensor)"
            )
        if tensor.is_complex() or tensor.dtype == torch.bool:
            raise WeightUpdateError(
                f"update_weights: {name} has dtype {tensor.dtype}; expected a real floating-point "
                "or integer tensor (cast to the model dtype on copy)"
            )
        pairs.append((name, tensor))
    return pairs


def prepare_weight_update(engine_config: EngineConfig, model: nn.Module,
                          named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
    """Every check of :func:`update_model_weights`, changing nothing: the configuration allows
    updates, the items are ``(name, tensor)`` pairs, and every name, shard and shape fits the
    model (a dry run of the loaders). Returns the pairs."""
    reason = freezing_reason(engine_config)
    if reason is not None:
        raise WeightUpdateError(
            f"update_weights is refused: {reason}, so compiled code holds the old weights as "
            "constants and would silently keep them. Build the LLM without Inductor freezing "
            "(or with enforce_eager=True) to update weights live"
        )
    pairs = _as_pairs(named_tensors)
    target = _unwrap(model)
    map_name: Any = target.map_weight_name
    try:
        check_named_weights(target, pairs, map_name)
    except WeightLoadError as exc:
        raise WeightLoadError(
            exc.missing, exc.unexpected, exc.mismatched,
            source="update_weights (nothing was changed): the given weights",
        ) from None
    return pairs


@torch.no_grad()
def update_model_weights(engine_config: EngineConfig, model: nn.Module, named_tensors: Any) -> dict[str, Any]:
    """Copy ``named_tensors`` into ``model`` in place, all or nothing.

    Returns ``{"num_tensors", "num_parameters", "seconds"}``. Raises :class:`WeightUpdateError`
    (refused configuration, bad items) or :class:`WeightLoadError` (unknown names, wrong
    shapes) before any parameter changes. Under tensor parallelism each rank is given the
    full tensors and copies its shard of each.
    """
    start = time.perf_counter()
    pairs = prepare_weight_update(engine_config, model, named_tensors)
    target = _unwrap(model)
    map_name: Any = target.map_weight_name
    router = attached_router(target) or attached_router(model)
    # the model's CPU router bound for the writes: a packed weight is re-derived once, after
    # all its shards
    with router.writes() if router is not None else contextlib.nullcontext():
        updated = load_named_weights(target, pairs, map_name)
    if target.parameters().__next__().device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    logger.info("update_weights: %d tensors into %d parameters in %.3f s", len(pairs),
                len(updated), seconds)
    return {"num_tensors": len(pairs), "num_parameters": len(updated), "seconds": seconds}


class KVCacheSleeper:
    """Release and restore a runner's KV cache tensors, keeping the tensor objects.

    The attention layers and the runner hold the same tensors, so the cache is freed by
    shrinking their storage to zero bytes and restored by growing it back (zeroed).
    """

    _TAGS = ("weights", "kv_cache")

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.kv_caches: dict[str, torch.Tensor] = runner.kv_caches
        self._sizes: dict[str, int] | None = None

    @property
    def asleep(self) -> bool:
        """Whether the cache is released."""
        return self._sizes is not None

    def allocated_bytes(self) -> int:
        """Bytes currently held by the KV cache storage."""
        return sum(t.untyped_storage().nbytes() for t in self.kv_caches.values())

    def sleep(self, level: int = 1) -> int:
        """Free the cache storage; returns the bytes released (0 if already asleep)."""
        if level != 1:
            raise ValueError(
                f"sleep(level={level!r}) is not supported; the reference engine implements level 1 "
                "(release the KV cache, keep the weights)"
            )
        if self._sizes is not None:
            return 0
        mode = getattr(self.runner, "cudagraph_mode", CUDAGraphMode.NONE)
        if mode != CUDAGraphMode.NONE:
            raise ValueError(
                f"sleep() with CUDA graphs (cudagraph_mode={mode}) is not supported: captured "
                "graphs hold the KV cache's addresses, which re-allocation would change"
            )
        sizes = {name: t.untyped_storage().nbytes() for name, t in self.kv_caches.items()}
        for t in self.kv_caches.values():
            t.untyped_storage().resize_(0)
        self._sizes = sizes
        if any(t.device.type == "cuda" for t in self.kv_caches.values()):
            torch.cuda.empty_cache()
        logger.info("sleep: released %.1f MiB of KV cache", sum(sizes.values()) / 2**20)
        return sum(sizes.values())

    def wake_up(self, tags: list[str] | None = None) -> int:
        """Re-allocate the cache (zeroed); returns the bytes allocated (0 if awake).

        ``tags`` as in vLLM (``"weights"``, ``"kv_cache"``; None = both); weights are never
        released here, so only ``"kv_cache"`` does anything.
        """
        if tags is not None:
            unknown = [t for t in tags if t not in self._TAGS]
            if isinstance(tags, str) or unknown:
                raise ValueError(f"wake_up(tags={tags!r}) is invalid; expected None or a list of "
                                 f"{list(self._TAGS)}")
            if "kv_cache" not in tags:
                return 0
        if self._sizes is None:
            return 0
        for name, t in self.kv_caches.items():
            t.untyped_storage().resize_(self._sizes[name])
            hugepages.zero_(t)
        total = sum(self._sizes.values())
        self._sizes = None
        return total
