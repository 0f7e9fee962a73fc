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
# With "dbo": a round with balanced work, so steps are micro-batched (prefill and decode).
DBO_ROUND = [[[5, 6, 7], [8, 9], [30 + i for i in range(7)]],
             [[1, 2, 3, 4], [60 + i for i in range(6)], [90, 91, 92]]]
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, enforce_eager=True, max_model_len=128)


def _rounds(dp_padding: bool | str) -> list:
    return ROUNDS + [DBO_ROUND] if dp_padding == "dbo" else ROUNDS


def _engine_config(path: str, nprocs: int, dp_padding: bool | str):
    from forwardkit.config.builder import build_engine_config
    from forwardkit.config.compilation import CUDAGraphMode
    from forwardkit.config.frozen import unfrozen

    if dp_padding == "dbo":  # dual-batch overlap with thresholds the 16-token steps reach
        return build_engine_config(path, data_parallel_size=nprocs, enable_expert_parallel=True,
                                   enable_dbo=True, dbo_decode_token_threshold=2,
                                   dbo_prefill_token_threshold=4, **ENGINE)
    if not dp_padding:
        return build_engine_config(path, data_parallel_size=nprocs, enable_expert_parallel=True,
                                   **ENGINE)
    # Graphs configured (CPU resolution turns them off, so set the mode afterwards): every
    # rank is padded to the largest token count across ranks, even eager (as in vLLM).
    engine = {**ENGINE, "enforce_eager": False}
    cfg = build_engine_config(path, data_parallel_size=nprocs, enable_expert_parallel=True,
                              compilation_config={"mode": 0}, **engine)
    with unfrozen(cfg):
        cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    return cfg


def _rank_main(rank: int, nprocs: int, port: int, path: str,
               dp_padding: bool | str) -> tuple[list[list[list[int]]], int]:
    os.environ["FORWARDKIT_MOE_DP_CHUNK_SIZE"] = "4"  # several all-gather chunks per step
    from forwardkit.distributed import destroy_dp_group, init_dp_group

    init_dp_group(world_size=nprocs, rank=rank, master_port=port, backend="gloo", timeout_s=60)
    try:
        llm = LLM(engine_config=_engine_config(path, nprocs, dp_padding))
        padded_steps = 0
        step = llm.runner.execute

        def execute(batch, pad_to=None):
            nonlocal padded_steps
            logits = step(batch, pad_to)
            info = llm.runner.last_step
            if dp_padding == "dbo":  # count micro-batched steps instead
                padded_steps += info.ubatch_slices is not None
            elif batch.num_reqs:  # (an idle rank's dummy step always pads 0 -> >= 1 tokens)
                padded_steps += info.num_padded_tokens > batch.num_tokens
            across = info.num_tokens_across_dp.tolist()
            assert across[rank] == info.num_padded_tokens
            assert (len(set(across)) == 1) or not dp_padding or (
                dp_padding == "dbo" and info.ubatch_slices is None)
            return logits

        llm.runner.execute = execute
        experts = [m for m in llm.runner.model.modules() if type(m).__name__ == "FusedMoE"]
        assert experts and all(m.use_ep for m in experts)
        results = []
        for per_rank in _rounds(dp_padding):
            outs = llm.generate(prompt_token_ids=per_rank[rank], sampling_params=GREEDY,
                                use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in outs])
        return results, padded_steps
    finally:
        destroy_dp_group()


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("dp_padding", [False, True, "dbo"], ids=["unpadded", "dp-padded", "dbo"])
def test_dp2_expert_parallel_matches_single_process(make_checkpoint, dp_padding):
    from forwardkit.distributed.launch import spawn

    path = make_checkpoint("mixtral")
    single = LLM(path, **ENGINE)
    results, padded_steps = zip(*spawn(_rank_main, 2, args=(path, dp_padding), timeout_s=300))
    assert (sum(padded_steps) > 0) == bool(dp_padding)  # with "dbo": steps micro-batched
    for round_index, per_rank in enumerate(_rounds(dp_padding)):
        for rank in range(2):
            prompts = per_rank[rank]
            expected = [o.outputs[0].token_ids for o in
                        single.generate(prompt_token_ids=prompts, sampling_params=GREEDY,
                                        use_tqdm=False)] if prompts else []
            assert results[rank][round_index] == expected, (round_index, rank)
