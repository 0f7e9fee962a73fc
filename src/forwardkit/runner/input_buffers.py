"""``InputBuffers``: persistent token-id and position tensors that every step slices.

CUDA graphs replay on the memory they were captured with, so the model must always see
prefixes of the same storage (``input_ids[:num_padded_tokens]``); the runner fills these
buffers in place each step instead of building new tensors.
"""

from __future__ import annotations

import array

import torch

from forwardkit.runner.batch import StepBatch

__all__ = ["InputBuffers", "int64_tensor"]


def int64_tensor(data: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of ``data`` through a typed buffer (several times faster than
    ``torch.tensor`` on a Python list)."""
    if not data:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", data), dtype=torch.int64)


class InputBuffers:
    """Static ``input_ids`` and ``positions`` (int64) of ``max_num_tokens`` rows on ``device``."""

    def __init__(self, max_num_tokens: int, device: torch.device | str) -> None:
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens={max_num_tokens} is invalid; expected >= 1")
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)

    def check_fits(self, num_padded_tokens: int) -> None:
        """Raise ``ValueError`` if a step of ``num_padded_tokens`` rows does not fit."""
        if num_padded_tokens > self.max_num_tokens:
            raise ValueError(
                f"a step of {num_padded_tokens} (padded) tokens does not fit the runner's input "
                f"buffers of {self.max_num_tokens} tokens (max_num_batched_tokens / largest "
                "capture size)"
            )

    def fill(self, batch: StepBatch, num_padded_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``batch``'s tokens and positions, zero the padding rows; return the two prefixes."""
        self.check_fits(num_padded_tokens)
        n = batch.num_tokens
        if n:
            # NOTE: one host->device copy per buffer; pinned staging would make it async.
            self.input_ids[:n].copy_(int64_tensor(batch.flat_token_ids()))
            self.positions[:n].copy_(int64_tensor(batch.flat_positions()))
        if num_padded_tokens > n:
            self.input_ids[n:num_padded_tokens].zero_()
            self.positions[n:num_padded_tokens].zero_()
        return self.input_ids[:num_padded_tokens], self.positions[:num_padded_tokens]

    def dummy(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed prefixes for a dummy run (profile, warm-up, capture, idle DP rank)."""
        self.check_fits(num_tokens)
        self.input_ids[:num_tokens].zero_()
        self.positions[:num_tokens].zero_()
        return self.input_ids[:num_tokens], self.positions[:num_tokens]
