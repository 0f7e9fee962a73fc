"""Sizes that allocate memory are checked against the machine before anything is allocated,
naming the argument (or the CLI flag); data parallelism in a plain process fails at once,
saying how to launch it."""

from __future__ import annotations

import time

import pytest

from forwardkit import cli
from forwardkit.engine import LLM

HUGE = str(99_999_999_999)


def _cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("flag", "named"), [
    ("--max-num-seqs", "--max-num-seqs=99999999999"),
    ("--max-num-batched-tokens", "--max-num-batched-tokens=99999999999"),
])
def test_generate_refuses_sizes_beyond_the_machine(capsys, flag, named):
    code, err = _cli(capsys, "generate", "--prompt-token-ids", "1,2", "--enforce-eager", flag, HUGE)
    assert code == 2
    assert f"error: {named}" in err and "too large for this machine" in err
    assert "tried to allocate" not in err


def test_bench_generation_refuses_batch_sizes_beyond_the_machine(capsys):
    code, err = _cli(capsys, "bench", "--generation", "--quick", "--no-progress",
                     "--contenders", "forwardkit", "--batch-sizes", "1000000")
    assert code == 2
    assert "error: --batch-sizes 1000000 is too large for this machine" in err


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"num_gpu_blocks": 10**9}, "num_gpu_blocks"),
    ({"max_num_seqs": 99_999_999_999}, "max_num_seqs=99999999999"),
])
def test_llm_refuses_sizes_beyond_the_machine(kwargs, named):
    with pytest.raises(ValueError, match=rf"^{named}.* too large for this machine"):
        LLM(enforce_eager=True, platform="cpu", **kwargs)


def test_in_process_data_parallel_fails_at_once(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "FORWARDKIT_DP_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FORWARDKIT_DP_TIMEOUT_S", "20")  # the old code waited this long
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"data_parallel_size=2 needs one process per DP rank.*"
                                         r"torchrun --nproc-per-node 2"):
        LLM(enforce_eager=True, platform="cpu", data_parallel_size=2)
    assert time.monotonic() - start < 10


def test_cuda_platform_without_a_gpu_is_named(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # a machine without a GPU
    code, err = _cli(capsys, "generate", "--platform", "cuda", "--prompt-token-ids", "1,2",
                     "--enforce-eager")
    assert code == 2 and "platform 'cuda' needs a CUDA device" in err
    assert "Torch not compiled" not in err
