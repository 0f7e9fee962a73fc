"""Mixed batches: each token applies its own adapter; more adapters than slots; swapping an
adapter into a slot never recompiles; ``has_lora`` in each step's descriptor."""

from __future__ import annotations

import pytest

from forwardkit import LLM, LoRARequest, SamplingParams
from forwardkit.compilation.counters import compilation_counter

PROMPTS = [[3, 4, 5, 6], [10 + i for i in range(11)], [7 * i % 256 for i in range(1, 9)], [42, 43]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
NAMES = ["llama_all", "llama_ko_gate", "llama_up_v"]


def _engine(base: str, **kwargs) -> LLM:
    args = dict(dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=8,
                max_num_batched_tokens=64, enable_lora=True, max_lora_rank=16)
    return LLM(base, **{**args, **kwargs})


def _tokens(llm: LLM, prompts, loras) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False,
                        lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outs]


def _record_steps(llm: LLM, monkeypatch) -> list[tuple[list[int] | None, bool]]:
    """Each executed step's per-request slots and its descriptor's has_lora."""
    seen: list[tuple[list[int] | None, bool]] = []
    real = llm.runner.execute

    def execute(batch, *args, **kwargs):
        out = real(batch, *args, **kwargs)
        seen.append((batch.lora_slots, llm.runner.last_step.descriptor.has_lora))
        return out

    monkeypatch.setattr(llm.runner, "execute", execute)
    return seen


def _requests(lora_paths, tmp_path, save_peft_dir, count: int) -> tuple[str, list[LoRARequest]]:
    base = lora_paths(NAMES[0])[0]
    dirs = [lora_paths(n)[1] for n in NAMES]
    while len(dirs) < count:  # more adapters of the same shape, drawn with other seeds
        dirs.append(save_peft_dir("llama_all", len(dirs), tmp_path / f"extra{len(dirs)}"))
    return base, [LoRARequest(f"a{i}", i + 1, d) for i, d in enumerate(dirs[:count])]


def test_mixed_step_gives_each_request_its_own_tokens(lora_paths, save_peft_dir, tmp_path,
                                                      monkeypatch):
    base, reqs = _requests(lora_paths, tmp_path, save_peft_dir, 3)
    llm = _engine(base, max_loras=3)
    loras = [reqs[0], reqs[1], reqs[2], None]
    alone = [_tokens(llm, [p], [r])[0] for p, r in zip(PROMPTS, loras)]
    assert len({tuple(t) for t in alone}) == 4  # every adapter (and the base) differs
    steps = _record_steps(llm, monkeypatch)
    assert _tokens(llm, PROMPTS, loras) == alone
    mixed = [slots for slots, _ in steps if slots is not None and len(set(slots)) == 4]
    assert mixed and -1 in mixed[0], "no step held the three adapters and the base model"
    assert all(has for slots, has in steps if slots and max(slots) >= 0)
    # a step of base-model requests only: has_lora False
    assert _tokens(llm, [PROMPTS[3]], None) == [alone[3]]
    assert steps[-1] == (None, False)


def test_more_adapters_than_slots(lora_paths, save_peft_dir, tmp_path, monkeypatch):
    """Five adapters, two slots, two host copies: every request finishes with the tokens it
    gets alone; adapters wait for a slot (least recently used swapped out) and dropped host
    copies are read again from disk."""
    base, reqs = _requests(lora_paths, tmp_path, save_peft_dir, 5)
    reference = _engine(base, max_loras=5)
    prompts = [PROMPTS[i % 4] for i in range(5)]
    expected = [_tokens(reference, [p], [r])[0] for p, r in zip(prompts, reqs)]
    llm = _engine(base, max_loras=2, max_cpu_loras=2)
    steps = _record_steps(llm, monkeypatch)
    assert _tokens(llm, prompts, reqs) == expected
    assert max(len({s for s in slots if s >= 0}) for slots, _ in steps if slots) == 2
    assert llm.lora is not None
    assert llm.lora.loads > 5  # some adapter was dropped from the host and read again
    assert llm.lora.slot_loads > 2 and len(llm.lora.loaded) <= 2


@pytest.mark.slow
def test_swapping_adapters_does_not_recompile(lora_paths, save_peft_dir, tmp_path):
    """Mode 3 (Inductor): the LoRA op is one node over persistent slot buffers; changing which
    adapters fill the slots recompiles nothing and gives the eager engine's tokens."""
    base, reqs = _requests(lora_paths, tmp_path, save_peft_dir, 3)
    eager = _engine(base, max_loras=3)
    expected = [_tokens(eager, PROMPTS[:3], [r] * 3) for r in reqs]
    built = compilation_counter.clone()
    llm = _engine(base, enforce_eager=False, max_loras=1, compilation_config={"mode": 3})
    assert compilation_counter.delta(built).get("num_dynamo_traces", 0) >= 1  # really compiled
    assert _tokens(llm, PROMPTS[:3], [reqs[0]] * 3) == expected[0]
    started = compilation_counter.clone()
    for r, want in zip(reqs[1:] + reqs[:1], expected[1:] + expected[:1]):
        assert _tokens(llm, PROMPTS[:3], [r] * 3) == want
    delta = {k: v for k, v in compilation_counter.delta(started).items() if v}
    assert delta == {}, delta
    assert llm.lora is not None and llm.lora.slot_loads >= 4


@pytest.mark.parametrize("specialize", [True, False])
def test_cuda_graphs_for_both_lora_cases(lora_paths, save_peft_dir, tmp_path, monkeypatch,
                                         specialize):
    """Graphs resolved for an emulated CUDA platform, run on the CPU through the recording
    stand-in: with ``cudagraph_specialize_lora`` graphs are captured and replayed for
    ``has_lora`` True and False; without it every graph has the LoRA ops (has_lora True).
    Replays read the per-token slots from the persistent buffer: tokens equal eager."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "cudagraph"))
    from recording import RecordingGraphs, graph_counts

    from forwardkit.config.builder import build_engine_config
    from forwardkit.config.frozen import unfrozen
    from forwardkit.platforms import CpuPlatform, CudaPlatform, Platform
    from forwardkit.runner import model_runner

    monkeypatch.setattr(model_runner, "GraphBackend", RecordingGraphs)
    monkeypatch.setattr(Platform, "can_capture_graphs", lambda self: True)
    base, reqs = _requests(lora_paths, tmp_path, save_peft_dir, 2)
    loras = [reqs[0], None, reqs[1]]
    eager = _engine(base, max_loras=2)
    expected = _tokens(eager, PROMPTS[:3], loras)
    expected_base = _tokens(eager, PROMPTS[:3], None)
    cc = {"mode": 3, "backend": "eager", "cudagraph_mode": "FULL_AND_PIECEWISE",
          "cudagraph_capture_sizes": [1, 2, 4, 8], "cudagraph_specialize_lora": specialize}
    cfg = build_engine_config(base, dtype="float32", max_model_len=128, max_num_seqs=8,
                              max_num_batched_tokens=64, enable_lora=True, max_loras=2,
                              compilation_config=cc, platform=CudaPlatform(device_capability=90))
    with unfrozen(cfg):
        cfg.platform = CpuPlatform()  # graph settings stay as resolved for CUDA
    llm = LLM(engine_config=cfg)
    runner = llm.runner
    wrappers = {f"piece{i}": w for i, w in enumerate(runner.piece_wrappers)}
    if runner.cudagraph_mode.has_full_cudagraphs():
        wrappers["full"] = runner.model

    def replays() -> dict[bool, int]:
        out = dict.fromkeys({desc.has_lora for (_, desc) in graph_counts(wrappers)}, 0)
        for (_, desc), n in graph_counts(wrappers).items():
            out[desc.has_lora] += n
        return out

    assert set(replays()) == ({True, False} if specialize else {True})  # captured
    start = replays()
    assert _tokens(llm, PROMPTS[:3], loras) == expected
    mid = replays()
    assert _tokens(llm, PROMPTS[:3], None) == expected_base
    end = replays()
    assert mid[True] > start[True]  # steps with adapters replayed has_lora=True graphs
    base_key = not specialize  # steps without adapters: their own graphs, or the same ones
    assert end[base_key] > mid[base_key]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_tensor_parallel_equals_one_rank(lora_paths, save_peft_dir, tmp_path):
    """tp=2 (LLM's own worker process): column-parallel layers hold their rows of B,
    row-parallel ones their columns of A; a mixed step gives the tokens of tp=1, with slots
    swapped (three adapters, two slots) on both ranks."""
    base, reqs = _requests(lora_paths, tmp_path, save_peft_dir, 3)
    loras = [reqs[0], reqs[1], None, reqs[2]]
    one = _tokens(_engine(base, max_loras=2), PROMPTS, loras)
    tp2 = _engine(base, max_loras=2, tensor_parallel_size=2)
    try:
        assert _tokens(tp2, PROMPTS, loras) == one
    finally:
        tp2.shutdown()
