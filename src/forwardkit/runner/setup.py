"""Start-up decisions of the model runner: KV-cache size and the CUDA-graph mode the
attention backend can honour."""

from __future__ import annotations

import math
from typing import Any

import torch

from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.logger import init_logger

__all__ = ["CPU_KV_CACHE_BYTES", "GPU_KV_CACHE_FRACTION", "num_kv_blocks", "resolve_cudagraph_mode"]

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


def resolve_cudagraph_mode(compilation_config: Any, support: int) -> CUDAGraphMode:
    """Lower the configured ``cudagraph_mode`` to what attention supports (vLLM's rules).

    ``support`` is the minimum ``AttentionCGSupport`` over the attention layers
    (0 NEVER, 1 single-token decode, 2 uniform batch, 3 always). Uniform decode query length
    is 1 (no speculative decoding), so vLLM's rule for speculative decode lengths never fires.
    """
    mode = CUDAGraphMode.parse(compilation_config.cudagraph_mode)
    piecewise_attn = bool(compilation_config.is_attention_compiled_piecewise())
    attn_split = bool(compilation_config.splitting_ops_contain_attention())
    always, never = 3, 0
    if mode.mixed_mode() == CUDAGraphMode.FULL and support < always:
        if support == never:
            raise ValueError(
                f"cudagraph_mode={mode} needs full CUDA graphs but the attention backend "
                "supports none; use PIECEWISE or NONE"
            )
        new = CUDAGraphMode.FULL_AND_PIECEWISE if attn_split else CUDAGraphMode.FULL_DECODE_ONLY
        logger.warning(
            "cudagraph_mode %s: attention supports full graphs for uniform decode batches only; "
            "using %s", mode, new,
        )
        mode = new
    if mode.decode_mode() == CUDAGraphMode.FULL and support == never:
        mode = CUDAGraphMode.PIECEWISE if piecewise_attn else CUDAGraphMode.NONE
    if mode.has_full_cudagraphs() and support == never:
        raise ValueError(f"cudagraph_mode={mode} needs full CUDA graphs the backend cannot run")
    return mode
