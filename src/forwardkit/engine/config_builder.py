"""``build_engine_config``: ``LLM(...)`` keyword arguments -> a resolved ``EngineConfig``.

Defaults match ``forwardkit.config.args`` (the CLI path), so ``LLM()`` and ``forwardkit
generate`` configure the same engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from forwardkit.config.cache import CacheConfig
from forwardkit.config.engine import EngineConfig
from forwardkit.config.model import ModelConfig
from forwardkit.config.parallel import ParallelConfig
from forwardkit.config.scheduler import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    SchedulerConfig,
)
from forwardkit.platforms import Platform, platform_by_name

__all__ = ["build_engine_config"]


def _init_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def build_engine_config(
    model: str | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    enforce_eager: bool = False,
    compilation_config: Any = None,
    optimization_level: int | None = None,
    data_parallel_size: int = 1,
    block_size: int = 16,
    num_gpu_blocks: int | None = None,
    platform: str | Platform | None = None,
    **kwargs: Any,
) -> EngineConfig:
    """Build the engine config of an ``LLM``.

    ``model`` is a local Hugging Face checkpoint directory or None for the built-in model.
    Extra keyword arguments go to ``ParallelConfig`` (``enable_expert_parallel``,
    ``data_parallel_rank``, ``all2all_backend`` ...) or ``SchedulerConfig``
    (``max_num_partial_prefills`` ...) by field name; any other name is a ``TypeError``
    listing what is accepted.
    """
    parallel_fields = _init_fields(ParallelConfig) - {"data_parallel_size"}
    scheduler_fields = _init_fields(SchedulerConfig) - {
        "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "max_model_len",
    }
    parallel_kwargs = {k: v for k, v in kwargs.items() if k in parallel_fields}
    scheduler_kwargs = {k: v for k, v in kwargs.items() if k in scheduler_fields}
    unknown = sorted(set(kwargs) - set(parallel_kwargs) - set(scheduler_kwargs))
    if unknown:
        raise TypeError(
            f"LLM() got unknown keyword argument(s) {unknown}; besides the named ones it accepts "
            f"ParallelConfig fields {sorted(parallel_fields)} and SchedulerConfig fields "
            f"{sorted(scheduler_fields)}"
        )
    model_kwargs: dict[str, Any] = {"enforce_eager": enforce_eager}
    if max_model_len is not None:
        model_kwargs["max_model_len"] = max_model_len
    if model is not None:
        model_config = ModelConfig.from_pretrained(model, dtype=dtype, **model_kwargs)
    else:
        from forwardkit.models.default import default_hf_config  # model layer, only for defaults

        model_config = ModelConfig(hf_config=dict(default_hf_config()), dtype=dtype, **model_kwargs)

    tokens, seqs = max_num_batched_tokens, max_num_seqs
    if tokens is None:
        tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, seqs or 0)
        if not enable_chunked_prefill:
            tokens = max(tokens, model_config.max_model_len)
    if seqs is None:
        seqs = min(DEFAULT_MAX_NUM_SEQS, tokens)
    scheduler_config = SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        max_model_len=model_config.max_model_len,
        is_encoder_decoder=model_config.is_encoder_decoder,
        **scheduler_kwargs,
    )
    parallel_config = ParallelConfig(data_parallel_size=data_parallel_size, **parallel_kwargs)
    if isinstance(platform, str):
        platform = platform_by_name(platform)
    config_kwargs: dict[str, Any] = {
        "model_config": model_config,
        "parallel_config": parallel_config,
        "scheduler_config": scheduler_config,
        "cache_config": CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks),
        "compilation_config": compilation_config,
        "platform": platform,
    }
    if optimization_level is not None:
        config_kwargs["optimization_level"] = optimization_level
    return EngineConfig(**config_kwargs)
