"""Automatic prefix caching through ``LLM``: the same greedy tokens as with caching off, in
every mode, while shared prompt blocks are computed once; invalidation on weight updates,
sleep and wake-up; salts, prompt logprobs, metrics and bad input."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from forwardkit.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SYSTEM = [(7 * i + 3) % 250 + 1 for i in range(40)]  # a 40-token shared prefix
PROMPTS = [SYSTEM + [11, 12, 13], SYSTEM + [21, 22], SYSTEM[:23] + [5], [9, 8, 7], SYSTEM + [11, 12]]
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
              enforce_eager=True)


def _engine(path: str, caching: bool, **kw) -> LLM:
    return LLM(path, **{**ENGINE, **kw}, enable_prefix_caching=caching)


def _metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


def _generate(llm: LLM, prompts=PROMPTS, params=GREEDY, rounds: int = 2) -> list[list[list[int]]]:
    """Generate ``rounds`` times (the later rounds hit what the first cached)."""
    out = []
    for _ in range(rounds):
        res = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        out.append([c.token_ids for o in res for c in o.outputs])
    return out


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 8},  # chunked prefill over many steps, hits mid-prompt
    {"num_gpu_blocks": 16, "block_size": 4},  # 64 slots: forced preemption
    {"block_size": 1},
], ids=["eager", "chunked", "preemption", "block1"])
def test_greedy_tokens_identical_with_caching_on_and_off(make_checkpoint, kw):
    path = make_checkpoint("llama_gqa_tied")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=3)
    off_llm = _engine(path, False, **kw)
    on_llm = _engine(path, True, **kw)
    off = _generate(off_llm, params=params)
    on = _generate(on_llm, params=params)
    assert on == off
    assert _metric(on_llm, "vllm:prefix_cache_hits") > 0
    assert _metric(off_llm, "vllm:prefix_cache_queries") == 0
    assert _metric(on_llm, "forwardkit:prompt_tokens_computed") < \
        _metric(off_llm, "forwardkit:prompt_tokens_computed")
    if "num_gpu_blocks" in kw:
        assert _metric(on_llm, "vllm:num_preemptions") > 0
    on_llm.block_manager.check_invariants([])


def test_transformers_agrees_on_a_cached_prompt(make_checkpoint, hf_greedy):
    path = make_checkpoint("llama_gqa_tied")
    llm = _engine(path, True)
    _generate(llm, rounds=1)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [32, 32, 16, 0, 32]
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS, 6)


def test_n_samples_compute_the_prompt_once(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    prompt = SYSTEM + SYSTEM[:24]  # 64 tokens = 4 full blocks
    params = SamplingParams(temperature=1.0, max_tokens=4, n=8, seed=5)
    on, off = _engine(path, True), _engine(path, False)
    got = on.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    want = off.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    # one sequence computes all 64 tokens in the first step; the other 7 only their last block
    assert _metric(off, "forwardkit:prompt_tokens_computed") == 8 * 64
    assert _metric(on, "forwardkit:prompt_tokens_computed") == 64 + 7 * 16
    assert _metric(on, "vllm:prefix_cache_queries") == 8 * 64
    assert _metric(on, "vllm:prefix_cache_hits") == 7 * 48
    assert got.num_cached_tokens == 7 * 48


def test_compiled_mode3(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    cc = {"mode": 3, "compile_sizes": []}
    off = _generate(_engine(path, False))
    on_llm = _engine(path, True, enforce_eager=False, compilation_config=cc)
    assert _generate(on_llm) == off
    assert _metric(on_llm, "vllm:prefix_cache_hits") > 0


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_cuda_graph_modes_with_the_recording_stand_in(make_checkpoint, monkeypatch, mode):
    """Graphs resolved for an emulated CUDA platform, then run on the CPU with the recording
    stand-in (``tests/cudagraph/recording.py``): FULL decode graphs replay in steps whose
    requests started from cached blocks."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "cudagraph"))
    from recording import RecordingGraphs

    from forwardkit.config.builder import build_engine_config
    from forwardkit.config.frozen import unfrozen
    from forwardkit.platforms import CpuPlatform, CudaPlatform, Platform
    from forwardkit.runner import model_runner

    monkeypatch.setattr(model_runner, "GraphBackend", RecordingGraphs)
    monkeypatch.setattr(Platform, "can_capture_graphs", lambda self: True)
    path = make_checkpoint("llama_gqa_tied")
    off = _generate(_engine(path, False))
    cc = {"mode": 3, "backend": "eager", "cudagraph_mode": mode,
          "cudagraph_capture_sizes": [1, 2, 4, 8]}
    cfg = build_engine_config(path, **{**ENGINE, "enforce_eager": False}, compilation_config=cc,
                              platform=CudaPlatform(device_capability=90))
    with unfrozen(cfg):
        cfg.platform = CpuPlatform()  # graph settings stay as resolved for CUDA
    on_llm = LLM(engine_config=cfg)
    assert on_llm.runner.cudagraph_mode.has_full_cudagraphs()
    assert _generate(on_llm) == off
    replays = sum(g.replays for g in on_llm.runner.graph_backend.graphs)
    assert replays > 0 and _metric(on_llm, "vllm:prefix_cache_hits") > 0


def test_update_weights_invalidates_the_cache(make_checkpoint, tmp_path):
    """A prompt cached before the update gives the tokens of a fresh engine on the new weights
    (without the invalidation it would reuse KV computed with the old ones)."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint("llama_gqa_tied")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std().clamp_min(1e-3))
    new_dir = str(tmp_path / "updated")
    model.save_pretrained(new_dir, safe_serialization=True)
    llm = _engine(path, True)
    _generate(llm, rounds=1)  # caches the prompts under the old weights
    llm.update_weights(dict(model.state_dict()))
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    fresh = _engine(new_dir, True).generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fresh]
    assert [o.num_cached_tokens for o in outs] == [0, 32, 16, 0, 32]  # only within the call


def test_sleep_and_wake_up_invalidate_the_cache(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    llm = _engine(path, True)
    first = _generate(llm, rounds=1)
    llm.sleep()
    llm.wake_up()  # the cache comes back zeroed: nothing may be hit
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == first[0]
    assert outs[0].num_cached_tokens == 0


def test_reset_prefix_cache_and_metrics(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    llm = _engine(path, True)
    _generate(llm, rounds=1)
    hits = _metric(llm, "vllm:prefix_cache_hits")
    assert llm.reset_prefix_cache() is True
    outs = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, use_tqdm=False)
    assert outs[0].num_cached_tokens == 0 and _metric(llm, "vllm:prefix_cache_hits") == hits
    names = {m.name for m in llm.get_metrics()}
    assert {"vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
            "vllm:generation_tokens", "forwardkit:prefix_cache_hit_rate"} <= names
    assert _metric(llm, "vllm:generation_tokens") == 6 * 6
    assert 0 < _metric(llm, "forwardkit:prefix_cache_hit_rate") < 1


def test_metrics_count_the_native_kernels_calls(make_checkpoint):
    from forwardkit.kernels.cpu import native_attention

    if not native_attention.available(torch.float32):
        pytest.skip("needs a CPU with AVX2 / AVX-512 (native attention kernel)")
    llm = LLM(make_checkpoint("llama_gqa_tied"), dtype="float32", enforce_eager=True)

    def calls() -> dict[str, float]:
        return {m.labels["kernel"]: m.value for m in llm.get_metrics()
                if m.name == "forwardkit:native_kernel_calls"}

    before = calls()
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY, use_tqdm=False)
    after = calls()
    # 5 decode steps x 2 layers through the native decode attention
    assert after["attention"] - before["attention"] == 10


def test_cache_salt_keeps_tenants_apart(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    llm = _engine(path, True)
    prompt = SYSTEM + [1, 2]
    salted = [{"prompt_token_ids": prompt, "cache_salt": "a"},
              {"prompt_token_ids": prompt, "cache_salt": "b"}]
    outs = llm.generate(salted, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0]  # different salts share no block
    again = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}, prompt], GREEDY,
                         use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [32, 0]  # same salt hits; no salt does not
    assert {tuple(o.outputs[0].token_ids) for o in outs + again} == {tuple(outs[0].outputs[0].token_ids)}


def test_prompt_logprobs_complete_for_a_cached_prompt(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    llm, ref = _engine(path, True), _engine(path, False)
    _generate(llm, rounds=1)
    got = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params, use_tqdm=False)[0]
    want = ref.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params, use_tqdm=False)[0]
    assert got.num_cached_tokens == 0  # skip_reading_prefix_cache defaults to True here
    assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(PROMPTS[0])
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    # explicitly allowed: the cached positions have no logprobs, so say it is a choice
    read = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2,
                          skip_reading_prefix_cache=False)
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=read, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    # position p is scored from position p - 1's hidden state: 1..32 come from the cache
    assert out.prompt_logprobs[1:33] == [None] * 32
    for a, b in zip(out.prompt_logprobs[33:], got.prompt_logprobs[33:], strict=True):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": [1, 2], "cache_salt": 5}, "cache_salt=5 is invalid; expected a non-empty"),
    ({"prompt_token_ids": [1, 2], "cache_salt": ""}, "cache_salt='' is invalid"),
])
def test_bad_cache_salt_is_refused(make_checkpoint, prompt, match):
    llm = _engine(make_checkpoint("llama_gqa_tied"), True)
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], GREEDY, use_tqdm=False)


def test_bad_settings_are_refused(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo='md5' is invalid"):
        LLM(path, prefix_caching_hash_algo="md5", **ENGINE)
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        LLM(path, enable_prefix_caching="yes", **ENGINE)
    with pytest.raises(ValueError, match="skip_reading_prefix_cache=1 is invalid"):
        SamplingParams(skip_reading_prefix_cache=1)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_tp2_with_caching_matches_tp1_without(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    off = _generate(_engine(path, False))
    tp2 = _engine(path, True, tensor_parallel_size=2)
    try:
        assert _generate(tp2) == off
        assert _metric(tp2, "vllm:prefix_cache_hits") > 0
    finally:
        tp2.shutdown()


def _dp_rank(rank: int, nprocs: int, port: int, path: str) -> tuple[list, float]:
    from forwardkit.config.builder import build_engine_config
    from forwardkit.distributed import destroy_dp_group, init_dp_group

    init_dp_group(world_size=nprocs, rank=rank, master_port=port, backend="gloo", timeout_s=60)
    try:
        cfg = build_engine_config(path, data_parallel_size=nprocs, enable_expert_parallel=True,
                                  **ENGINE)
        llm = LLM(engine_config=cfg)
        mine = PROMPTS[rank::2]
        return _generate(llm, prompts=mine), _metric(llm, "vllm:prefix_cache_hits")
    finally:
        destroy_dp_group()


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_dp2_each_rank_its_own_cache(make_checkpoint):
    from forwardkit.distributed.launch import spawn

    path = make_checkpoint("mixtral")
    results = spawn(_dp_rank, 2, args=(path,), timeout_s=300)
    for rank, (tokens, hits) in enumerate(results):
        assert tokens == _generate(_engine(path, False), prompts=PROMPTS[rank::2])
        assert hits > 0
