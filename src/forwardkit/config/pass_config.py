"""``PassConfig`` (custom Inductor pass switches) and ``DynamicShapesConfig``.

Both are pydantic dataclasses with ``extra="forbid"``, so an unknown key in a dict or JSON
config is an error that names it. Re-exported by :mod:`forwardkit.config.compilation`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from pydantic import ConfigDict, field_validator
from pydantic.dataclasses import dataclass

from forwardkit.config.compilation_enums import DynamicShapesType
from forwardkit.config.frozen import FreezableConfig
from forwardkit.config.utils import get_hash_factors, hash_factors
from forwardkit.logger import init_logger
from forwardkit.platforms import Platform, current_platform

__all__ = ["CallablePass", "DynamicShapesConfig", "PassConfig", "resolve_inductor_pass"]

logger = init_logger(__name__)

# Device capability -> {world size: MB} for the FlashInfer fused all-reduce cut-off.
# (The reference's prose says 1 MB for SM90 at 8 ranks; its table, which is what counts, says 0.5.)
_FI_ALLREDUCE_FUSION_MAX_SIZE_MB: dict[int, dict[int, float]] = {
    90: {2: 64, 4: 2, 8: 0.5},
    100: {2: 64, 4: 32, 8: 1},
}

_CONFIG = ConfigDict(extra="forbid", use_attribute_docstrings=True)


@dataclass(config=_CONFIG)
class PassConfig(FreezableConfig):
    """Switches for forwardkit's custom Inductor passes.

    The ``bool | None`` flags are tri-state: ``None`` means "not decided yet"; the
    engine config fills them in from its optimisation level (``config/levels.py``). Set
    values are parsed leniently (``True``, ``1``, ``"yes"``, ``"off"``, ...).
    """

    fuse_norm_quant: bool | None = None
    """Fuse RMSNorm with a following quant op: here the int8 rounding of the activations of a
    block-quantized projection on the CPU (``quantization/fusion.py``). Filled in by the
    optimization level as in vLLM (on with the ``rms_norm`` / ``quant_fp8`` custom ops)."""
    fuse_act_quant: bool | None = None
    """Fuse SiLU-and-mul with a following quant op (as ``fuse_norm_quant``)."""
    fuse_attn_quant: bool | None = None
    """Fuse attention with its output quant op."""
    eliminate_noops: bool | None = None
    """Remove no-op reshapes and views."""
    enable_sp: bool | None = None
    """Sequence-parallelism pass."""
    fuse_gemm_comms: bool | None = None
    """Async TP: fuse GEMMs with collectives (needs ``enable_sp``)."""
    fuse_allreduce_rms: bool | None = None
    """FlashInfer all-reduce + RMSNorm fusion."""
    fuse_rms_norm: bool | None = None
    """forwardkit (no vLLM name): inline the opaque RMSNorm ops (plain and with residual add)
    so Inductor fuses them with their neighbours."""
    fuse_silu_and_mul: bool | None = None
    """forwardkit (no vLLM name): inline the opaque SiLU-and-mul op so Inductor fuses it."""
    fi_allreduce_fusion_max_size_mb: float | None = None
    """Size cut-off (MB) for the fused all-reduce; None -> per-device default table."""
    enable_qk_norm_rope_fusion: bool = False
    """Fused Q/K RMSNorm + RoPE pass (CUDA-alike platforms only)."""
    platform: dataclasses.InitVar[Any] = None
    """Construction only (not a field): the platform the flags are checked for; None =
    ``current_platform``. An engine config passes its own (no process-wide platform swap)."""

    @field_validator("fi_allreduce_fusion_max_size_mb")
    @classmethod
    def _check_size_mb(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value < float("inf"):
            raise ValueError(
                f"fi_allreduce_fusion_max_size_mb must be a finite number >= 0 (megabytes) or "
                f"None, got {value}"
            )
        return value

    def __post_init__(self, platform: Platform | None = None) -> None:
        target = current_platform if platform is None else platform
        if not self.eliminate_noops:
            if self.fuse_norm_quant or self.fuse_act_quant:
                logger.warning_once(
                    "Fusion enabled but reshape elimination disabled. "
                    "RMSNorm/SiluMul + quant (fp8) fusion might not work"
                )
            if self.fuse_attn_quant:
                logger.warning_once(
                    "Fusion enabled but reshape elimination disabled. "
                    "Attention + quant (fp8) fusion might not work"
                )
            if self.fuse_allreduce_rms:
                logger.warning_once(
                    "Fusion enabled but reshape elimination disabled. "
                    "Allreduce + rms norm + quant (fp8) fusion might not work"
                )
        if self.enable_qk_norm_rope_fusion and not target.is_cuda_alike():
            logger.warning_once(
                "QK Norm + RoPE fusion is only supported on CUDA-alike platforms; disabling it."
            )
            self.enable_qk_norm_rope_fusion = False

    @staticmethod
    def default_fi_allreduce_fusion_max_size_mb(platform: Platform | None = None) -> dict[int, float]:
        """World size -> MB cut-off for ``platform``'s device (None: ``current_platform``);
        ``{}`` off CUDA or on an unknown device."""
        target = current_platform if platform is None else platform
        if not target.is_cuda_alike():
            return {}
        capability = target.get_device_capability()
        if capability is None:
            return {}
        return dict(_FI_ALLREDUCE_FUSION_MAX_SIZE_MB.get(capability, {}))

    def flashinfer_max_size(self, world_size: int, platform: Platform | None = None) -> int | None:
        """Byte cut-off for the fused all-reduce at ``world_size`` ranks on ``platform``
        (None: ``current_platform``); None when unsupported."""
        if world_size not in (2, 4, 8):
            return None
        mb = self.fi_allreduce_fusion_max_size_mb
        if mb is None:
            mb = self.default_fi_allreduce_fusion_max_size_mb(platform).get(world_size)
        return int(mb * 1024 * 1024) if mb is not None else None

    def compute_hash(self) -> str:
        """SHA-256 over every field."""
        return hash_factors(get_hash_factors(self, ()))

    def non_default_items(self) -> dict[str, Any]:
        """Fields whose value differs from a fresh ``PassConfig()`` (used by ``repr``)."""
        fresh = PassConfig()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(fresh, f.name)
        }

    def to_dict(self) -> dict[str, Any]:
        """Every field as a plain JSON-able dict (``PassConfig(**d)`` rebuilds it)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(config=_CONFIG)
class DynamicShapesConfig(FreezableConfig):
    """How Dynamo treats the dynamic token dimension."""

    type: DynamicShapesType = DynamicShapesType.BACKED
    """``"backed"``, ``"unbacked"`` or ``"backed_size_oblivious"`` (exact lower case)."""
    evaluate_guards: bool = False
    """Keep (and evaluate) shape guards instead of dropping all of them."""
    assume_32_bit_indexing: bool = True
    """Let Inductor assume tensor indices fit in 32 bits."""

    def compute_hash(self) -> str:
        """SHA-256 over all three fields (the type as its plain string)."""
        return hash_factors(get_hash_factors(self, ()))

    def to_dict(self) -> dict[str, Any]:
        """Every field as a plain JSON-able dict."""
        return {
            "type": self.type.value,
            "evaluate_guards": self.evaluate_guards,
            "assume_32_bit_indexing": self.assume_32_bit_indexing,
        }


class CallablePass:
    """A plain function used as an Inductor graph pass, with a stable ``uuid()`` for caching.

    The uuid is a SHA-256 of the function's source (or of its qualified name when the source
    is unavailable) unless one is given. The compile backend may re-wrap it in its own pass type.
    """

    def __init__(self, fn: Callable[..., Any], uuid: str | None = None) -> None:
        self.fn = fn
        self._uuid = uuid

    def __call__(self, graph: Any) -> Any:
        return self.fn(graph)

    def uuid(self) -> str:
        """Identity for the compile cache: same function source -> same uuid."""
        if self._uuid is None:
            try:
                text = inspect.getsource(self.fn)
            except (OSError, TypeError):
                text = f"{getattr(self.fn, '__module__', '')}.{getattr(self.fn, '__qualname__', repr(self.fn))}"
            self._uuid = hashlib.sha256(text.encode("utf-8")).hexdigest()
        return self._uuid

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CallablePass) and other.uuid() == self.uuid()

    def __hash__(self) -> int:
        return hash(self.uuid())

    def __repr__(self) -> str:
        return f"CallablePass({getattr(self.fn, '__qualname__', self.fn)!r})"


def resolve_inductor_pass(name: str, value: Any) -> Any:
    """Turn one ``inductor_passes`` entry into a pass object.

    ``value`` is a dotted name ``"package.module.function"`` (resolved with ``importlib``, so
    nested modules work; the reference only resolved one level and raised a bare KeyError for
    ``"os.path.join"``) or a callable. Objects that already have a ``uuid()`` are kept;
    other callables are wrapped in :class:`CallablePass`. Errors are ``ValueError`` naming the
    entry and what is accepted.
    """
    obj = value
    if isinstance(value, str):
        module_name, _, attr = value.rpartition(".")
        if not module_name or not attr:
            raise ValueError(
                f"inductor_passes[{name!r}] = {value!r} is not a dotted name; expected "
                "'module.function', e.g. 'my_pkg.passes.fuse_things'"
            )
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(
                f"inductor_passes[{name!r}] = {value!r}: cannot import module {module_name!r} ({e})"
            ) from e
        if not hasattr(module, attr):
            raise ValueError(
                f"inductor_passes[{name!r}] = {value!r}: module {module_name!r} has no attribute {attr!r}"
            )
        obj = getattr(module, attr)
    if not callable(obj):
        raise ValueError(
            f"inductor_passes[{name!r}] = {value!r} is not callable; expected a function taking "
            "a torch.fx.Graph or a dotted name of one"
        )
    return obj if callable(getattr(obj, "uuid", None)) else CallablePass(obj)
