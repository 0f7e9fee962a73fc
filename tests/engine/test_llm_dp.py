"""Data parallel + expert parallel generation (2 gloo ranks) matches the single-process run."""

from __future__ import annotations

import os

import pytest

from forwardkit.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Per round, per rank: round 0 uneven (3 prompts vs 1), round 1 rank 1 has no work at all,
# round 2 rank 0 has no work and rank 1 a prompt longer than the 16-token step budget.
ROUNDS = [
    [[[3, 4, 5], [10 + i for i in range(19)], [42]], [[7, 8, 9, 10, 11]]],
    [[[100, 101], [50 + i for i in range(9)]], []],
    [[], [[200 - i for i in range(23)]]],
]
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, enforce_eager=True, max_model_len=128)


def _rank_main(rank: int, nprocs: int, port: int, path: str) -> list[list[list[int]]]:
    os.environ["FORWARDKIT_MOE_DP_CHUNK_SIZE"] = "4"  # several all-gather chunks per step
    from forwardkit.distributed import destroy_dp_group, init_dp_group

    init_dp_group(world_size=nprocs, rank=rank, master_port=port, backend="gloo", timeout_s=60)
    try:
        llm = LLM(path, data_parallel_size=nprocs, enable_expert_parallel=True, **ENGINE)
        experts = [m for m in llm.runner.model.modules() if type(m).__name__ == "FusedMoE"]
        assert experts and all(m.use_ep for m in experts)
        results = []
        for per_rank in ROUNDS:
            outs = llm.generate(prompt_token_ids=per_rank[rank], sampling_params=GREEDY,
                                use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in outs])
        return results
    finally:
        destroy_dp_group()


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_dp2_expert_parallel_matches_single_process(make_checkpoint):
    from forwardkit.distributed.launch import spawn

    path = make_checkpoint("mixtral")
    single = LLM(path, **ENGINE)
    results = spawn(_rank_main, 2, args=(path,), timeout_s=300)
    for round_index, per_rank in enumerate(ROUNDS):
        for rank in range(2):
            prompts = per_rank[rank]
            expected = [o.outputs[0].token_ids for o in
                        single.generate(prompt_token_ids=prompts, sampling_params=GREEDY,
                                        use_tqdm=False)] if prompts else []
            assert results[rank][round_index] == expected, (round_index, rank)
