"""On a machine with 2+ GPUs: tensor parallelism over NCCL (the device group) gives the tokens
of one GPU, eager and with CUDA graphs (the collectives are captured with the pieces)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from forwardkit.engine import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
import tp_models  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs CUDA with 2+ GPUs"),
]

PROMPTS = [[3, 17, 42, 5, 9, 200], [7, 8], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cudagraphs"])
def test_tp2_over_nccl_matches_one_gpu(tmp_path, eager):
    path = tp_models.build("llama", str(tmp_path / "llama"))
    engine = dict(platform="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
                  max_model_len=128, enforce_eager=eager)
    one = LLM(path, **engine)
    expected = [o.outputs[0].token_ids for o in
                one.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)]
    del one
    two = LLM(path, tensor_parallel_size=2, **engine)
    try:
        got = [o.outputs[0].token_ids for o in
               two.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)]
        assert got == expected
        from forwardkit.distributed import get_tp_group

        assert get_tp_group().device.type == "cuda"  # NCCL device group, not gloo
    finally:
        two.shutdown()
