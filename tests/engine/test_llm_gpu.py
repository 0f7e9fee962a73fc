"""On a GPU: compiled + CUDA-graph generation (FULL decode graphs, piecewise mixed graphs)
gives the same greedy tokens as eager and as transformers."""

from __future__ import annotations

import pytest
import torch

from forwardkit.engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[3, 4, 5], [10 + i for i in range(19)], [7 * i % 256 for i in range(1, 38)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("name", ["llama_gqa_tied", "mixtral"])
def test_cudagraphs_match_eager_and_transformers(make_checkpoint, hf_greedy, name):
    from forwardkit.config.compilation import CUDAGraphMode

    path = make_checkpoint(name)
    expected = hf_greedy(path, PROMPTS, 24)
    graphed = LLM(path, platform="cuda", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
    assert graphed.runner.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    got = graphed.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    modes = {graphed.runner.last_step.mode}
    eager = LLM(path, platform="cuda", max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=128, enforce_eager=True)
    ref = eager.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref] == expected
    assert CUDAGraphMode.FULL in modes  # the last step (one request decoding) replayed a full graph
