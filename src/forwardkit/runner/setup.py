"""Start-up decision of the model runner: the KV-cache size. The
CUDA-graph mode is decided by the engine config (``EngineConfig.served_cudagraph_mode``)."""

from __future__ import annotations

import math

import torch

from forwardkit.logger import init_logger

__all__ = ["CPU_KV_CACHE_BYTES", "GPU_KV_CACHE_FRACTION", "num_kv_blocks"]

logger = init_logger(__name__)

# Upper bound of a derived KV cache on CPU (explicit num_gpu_blocks is never capped).
CPU_KV_CACHE_BYTES = 512 * 1024**2
# Share of the free device memory a derived KV cache may take on a GPU.
GPU_KV_CACHE_FRACTION = 0.5


def num_kv_blocks(
    *,
    num_gpu_blocks: int | None,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    bytes_per_block: int,
    device: torch.device,
) -> int:
    """Blocks to allocate per attention layer.

    ``num_gpu_blocks`` when given; otherwise enough for ``max_num_seqs`` sequences of
    ``max_model_len`` tokens, capped by a memory budget (``CPU_KV_CACHE_BYTES`` on CPU,
    ``GPU_KV_CACHE_FRACTION`` of free memory on a GPU); the scheduler rejects requests
    that could never fit the result.
    """
    if num_gpu_blocks is not None:
        if num_gpu_blocks < 1:
            raise ValueError(
                f"cache_config.num_gpu_blocks={num_gpu_blocks} is invalid; expected >= 1 block"
            )
        return num_gpu_blocks
    per_seq = math.ceil(max_model_len / block_size)
    wanted = max_num_seqs * per_seq
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * GPU_KV_CACHE_FRACTION)
    else:
        budget = CPU_KV_CACHE_BYTES
    affordable = max(1, budget // max(bytes_per_block, 1))
    blocks = min(wanted, affordable)
    if blocks < wanted:
        logger.info(
            "KV cache: %d blocks of %d tokens (%d wanted for %d sequences of %d tokens; memory cap "
            "%.0f MiB)", blocks, block_size, wanted, max_num_seqs, max_model_len, budget / 2**20,
        )
    return blocks
