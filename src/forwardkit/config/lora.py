"""``LoRAConfig``: the adapter slots of an engine serving LoRA adapters (vLLM's ``LoRAConfig``).

``LLM(enable_lora=True, max_loras=..., max_lora_rank=..., max_cpu_loras=...)`` builds one;
without ``enable_lora`` the engine config's ``lora_config`` is None and the model has no LoRA
ops at all.
"""

from __future__ import annotations

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from forwardkit.config.frozen import FreezableConfig
from forwardkit.config.utils import hash_factors

__all__ = ["LORA_RANKS", "LoRAConfig"]

# The ranks vLLM 0.14.0 accepts for max_lora_rank.
LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")


@dataclass(config=ConfigDict(extra="forbid"))
class LoRAConfig(FreezableConfig):
    """Adapter slots: how many adapters one step may hold, their largest rank, how many stay
    loaded in host memory."""

    max_lora_rank: int = 16
    """Largest adapter rank served (one of 1, 8, 16, 32, 64, 128, 256, 320, 512); the slot
    buffers are this wide, smaller ranks are zero-padded."""
    max_loras: int = 1
    """Adapters one step may hold (the slots of the device buffers)."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory (least recently used ones are dropped and reloaded
    from their path when asked for again); None = ``max_loras``; at least ``max_loras``."""
    fully_sharded_loras: bool = False
    """vLLM shards the shrink side too under TP; accepted only False here."""
    lora_dtype: str = "auto"
    """dtype of the adapter weights in the slots: "auto" (the model's), or one of float32,
    bfloat16, float16."""

    def __post_init__(self) -> None:
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank={self.max_lora_rank!r} is invalid; expected one of "
                             f"{', '.join(map(str, LORA_RANKS))}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras!r} is invalid; expected an integer >= 1")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras="
                             f"{self.max_loras}")
        if self.fully_sharded_loras:
            raise ValueError("fully_sharded_loras=True is not supported: the LoRA A of "
                             "column-parallel layers is replicated (accepted: False)")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype={self.lora_dtype!r} is invalid; expected one of "
                             f"{', '.join(LORA_DTYPES)}")

    def compute_hash(self) -> str:
        """Hash of what shapes the compiled graph: the slot count, the rank and the dtype."""
        return hash_factors({"max_lora_rank": self.max_lora_rank, "max_loras": self.max_loras,
                             "lora_dtype": self.lora_dtype})
