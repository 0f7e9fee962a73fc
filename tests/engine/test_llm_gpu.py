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


def _record_modes(llm) -> list:
    """Wrap the runner's ``execute`` so every step's runtime mode is kept."""
    modes, execute = [], llm.runner.execute

    def spy(batch, *args, **kwargs):
        out = execute(batch, *args, **kwargs)
        modes.append(llm.runner.last_step.mode)
        return out

    llm.runner.execute = spy
    return modes


@pytest.mark.parametrize("name", ["llama_gqa_tied", "mixtral"])
def test_cudagraphs_match_eager_and_transformers(make_checkpoint, hf_greedy, name):
    from forwardkit.config.compilation import CUDAGraphMode

    path = make_checkpoint(name)
    short = [[3, 4, 5], [6, 7, 8, 9, 10]]  # first step: 8 mixed prefill tokens, a capture size
    expected = hf_greedy(path, PROMPTS, 24)
    graphed = LLM(path, platform="cuda", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
    runner = graphed.runner
    assert runner.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    # start-up captured one PIECEWISE graph per compiled piece and capture size, and the FULL
    # decode graphs; the pieces are the layers' compiled parts between attention ops
    sizes = runner.compilation_config.cudagraph_capture_sizes
    num_layers = len(runner.attn_layer_names)
    assert len(runner.piece_wrappers) == num_layers + 1
    for w in runner.piece_wrappers:
        assert sorted(d.num_tokens for d in w.concrete_cudagraph_entries) == sorted(sizes)
        assert all(e.cudagraph is not None for e in w.concrete_cudagraph_entries.values())
    full = runner.model.concrete_cudagraph_entries
    assert all(d.uniform for d in full) and len(full) == len([s for s in sizes if s <= 4])
    assert runner.capture_stats["graphs"] == {"PIECEWISE": len(sizes) * (num_layers + 1),
                                              "FULL": len(full)}
    assert runner.capture_stats["graph_memory_bytes"] is not None
    captured = runner.capture_stats["graphs"]["PIECEWISE"] + len(full)

    modes = _record_modes(graphed)
    got = graphed.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    got_short = graphed.generate(prompt_token_ids=short, sampling_params=GREEDY, use_tqdm=False)
    eager = LLM(path, platform="cuda", max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=128, enforce_eager=True)
    ref = eager.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    ref_short = eager.generate(prompt_token_ids=short, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref] == expected
    assert [o.outputs[0].token_ids for o in got_short] == [o.outputs[0].token_ids for o in ref_short]
    assert {CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE} <= set(modes)
    # nothing was captured while serving
    assert sum(len(w.concrete_cudagraph_entries) for w in runner.piece_wrappers) + len(full) == captured
