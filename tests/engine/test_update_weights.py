"""``LLM.update_weights``: live, in-place, all-or-nothing weight updates (and sleep / wake_up).

After an update, greedy tokens equal those of a freshly built engine on the updated checkpoint
(saved with ``transformers``), and transformers' own greedy continuation of it.
"""

from __future__ import annotations

import pytest
import torch

from forwardkit.compilation.counters import compilation_counter
from forwardkit.engine import LLM, SamplingParams
from forwardkit.models.weights import WeightLoadError

PROMPTS = [[3, 4, 5], [10 + i for i in range(19)], [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _perturb(model, seed: int, only: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Add noise of the weights' own scale to every tensor (or those whose names contain one
    of ``only``); returns the changed tensors by HF name."""
    gen = torch.Generator().manual_seed(seed)
    changed = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if only is not None and not any(part in name for part in only):
                continue
            param.add_(torch.randn(param.shape, generator=gen) * param.std().clamp_min(1e-3) * 0.8)
            changed[name] = param.detach().clone()
    return changed


def _updated_checkpoint(make_checkpoint, tmp_path, name: str, seed: int,
                        only: tuple[str, ...] | None = None) -> tuple[str, dict[str, torch.Tensor]]:
    model = _hf_model(make_checkpoint(name))
    changed = _perturb(model, seed, only)
    out = str(tmp_path / f"{name}-updated")
    model.save_pretrained(out, safe_serialization=True)
    return out, changed


def _engine(path: str, **kw) -> LLM:
    kw.setdefault("enforce_eager", True)
    return LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, **kw)


def _state(llm: LLM) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in llm.runner.model.state_dict().items()}


@pytest.mark.parametrize("name", ["llama_gqa_tied", "mixtral"])
def test_full_update_equals_fresh_engine(make_checkpoint, hf_greedy, tmp_path, name):
    llm = _engine(make_checkpoint(name))
    before = _greedy(llm)
    new_path, _ = _updated_checkpoint(make_checkpoint, tmp_path, name, seed=1)
    state = _hf_model(new_path).state_dict()  # includes lm_head.weight even when tied
    info = llm.update_weights(state.items())
    assert info["num_tensors"] == len(state)
    after = _greedy(llm)
    assert after != before  # the update reached the model
    assert after == _greedy(_engine(new_path))
    assert after == hf_greedy(new_path, PROMPTS, GREEDY.max_tokens)


def test_partial_update_of_merged_projections_any_dtype(make_checkpoint, tmp_path):
    """Only q_proj (part of qkv_proj) and up_proj (part of gate_up_proj) of layer 1, given in
    float64 and bfloat16: the other shards of the merged parameters stay as they were."""
    llm = _engine(make_checkpoint("llama3_rope"))
    before = _greedy(llm)
    only = ("layers.1.self_attn.q_proj", "layers.1.mlp.up_proj")
    new_path, changed = _updated_checkpoint(make_checkpoint, tmp_path, "llama3_rope", 2, only)
    assert len(changed) == 2
    pairs = [(n, t.double() if "q_proj" in n else t) for n, t in changed.items()]
    llm.update_weights(iter(pairs))  # any iterable, consumed once
    after = _greedy(llm)
    assert after != before and after == _greedy(_engine(new_path))


def test_moe_single_expert_update(make_checkpoint, tmp_path):
    """One expert's w1/w2/w3 in the per-expert Hugging Face naming (as saved on disk) land in
    the stacked expert parameters; the other experts keep their weights."""
    from safetensors import safe_open

    llm = _engine(make_checkpoint("mixtral"))
    model = _hf_model(make_checkpoint("mixtral"))
    experts = model.model.layers[0].mlp.experts  # in memory: stacked [E, ...] tensors
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in (experts.gate_up_proj, experts.down_proj):
            param[1].add_(torch.randn(param[1].shape, generator=gen) * param.std())
    new_path = str(tmp_path / "mixtral-expert1")
    model.save_pretrained(new_path, safe_serialization=True)
    prefix = "model.layers.0.block_sparse_moe.experts.1."
    with safe_open(f"{new_path}/model.safetensors", framework="pt") as f:
        changed = {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118
    assert sorted(changed) == [prefix + w + ".weight" for w in ("w1", "w2", "w3")]
    before = _greedy(llm)
    llm.update_weights(changed)  # a dict works too
    after = _greedy(llm)
    assert after != before and after == _greedy(_engine(new_path))


@pytest.mark.parametrize("bad, match", [
    (("model.layers.0.self_attn.not_a_proj.weight", torch.zeros(4)),
     r"unexpected tensors: model\.layers\.0\.self_attn\.not_a_proj\.weight"),
    (("model.layers.1.mlp.up_proj.weight", torch.zeros(3, 64)),
     r"wrong shape: model\.layers\.1\.mlp\.up_proj\.weight \(expected shape \(128, 64\), got \(3, 64\)\)"),
    (("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64)),
     r"k_proj\.weight \(expected shape \(32, 64\), got \(64, 64\)\)"),
])
def test_rejected_update_changes_nothing(make_checkpoint, tmp_path, bad, match):
    llm = _engine(make_checkpoint("llama_gqa_tied"))
    before_tokens, before_state = _greedy(llm), _state(llm)
    _, good = _updated_checkpoint(make_checkpoint, tmp_path, "llama_gqa_tied", 4)
    # Valid tensors first, the bad one last: nothing may be copied before it is seen.
    with pytest.raises(WeightLoadError, match=match) as info:
        llm.update_weights([*good.items(), bad])
    assert "nothing was changed" in str(info.value)
    after_state = _state(llm)
    assert all(torch.equal(before_state[k], after_state[k]) for k in before_state)
    assert _greedy(llm) == before_tokens


@pytest.mark.parametrize("items, match", [
    (5, "expected an iterable of"),
    ([("a", 1.0)], r"item 0 is \(str, float\)"),
    ([("model.norm.weight", torch.zeros(64, dtype=torch.complex64))], "dtype torch.complex64"),
    (["model.norm.weight"], "item 0 is str"),
])
def test_bad_update_items(make_checkpoint, items, match):
    llm = _engine(make_checkpoint("llama_gqa_tied"))
    with pytest.raises(ValueError, match=match):
        llm.update_weights(items)


def test_inductor_freezing_is_refused(make_checkpoint):
    """Freezing folds weights into compiled constants: an update would silently not apply."""
    from forwardkit.config.builder import build_engine_config
    from forwardkit.engine.weight_update import WeightUpdateError, update_model_weights
    from forwardkit.models.default import default_hf_config

    path = make_checkpoint("llama_gqa_tied")
    cfg = build_engine_config(path, default_hf_config=default_hf_config(), compilation_config={
        "mode": 3, "backend": "inductor", "inductor_compile_config": {"freezing": True}})
    model = torch.nn.Linear(2, 2)
    weight = model.weight.detach().clone()
    with pytest.raises(WeightUpdateError, match=r"inductor_compile_config\['freezing'\] is set"):
        update_model_weights(cfg, model, [("weight", torch.zeros(2, 2))])
    assert torch.equal(model.weight, weight)
    # The same settings without compilation are fine.
    eager = build_engine_config(path, default_hf_config=default_hf_config(), enforce_eager=True,
                                compilation_config={"inductor_compile_config": {"freezing": True}})
    from forwardkit.engine.weight_update import freezing_reason

    assert freezing_reason(eager) is None and freezing_reason(cfg) is not None


@pytest.mark.slow
def test_update_under_inductor_no_recompile(make_checkpoint, hf_greedy, tmp_path):
    """Mode 3 with the Inductor backend: the update is seen by the compiled pieces, and neither
    the update nor the following generate traces or compiles anything."""
    path = make_checkpoint("llama_gqa_tied")
    llm = _engine(path, enforce_eager=False, compilation_config={"mode": 3, "backend": "inductor"})
    before = _greedy(llm)
    new_path, _ = _updated_checkpoint(make_checkpoint, tmp_path, "llama_gqa_tied", 5)
    started = compilation_counter.clone()
    llm.update_weights(_hf_model(new_path).state_dict().items())
    after = _greedy(llm)
    delta = compilation_counter.delta(started)
    assert {k: v for k, v in delta.items() if v} == {}, delta
    assert after != before
    assert after == hf_greedy(new_path, PROMPTS, GREEDY.max_tokens)


def test_sleep_frees_kv_cache_and_wake_up_restores(make_checkpoint):
    llm = _engine(make_checkpoint("llama_gqa_tied"))
    before = _greedy(llm)
    caches = list(llm.runner.kv_caches.values())
    held = sum(t.untyped_storage().nbytes() for t in caches)
    assert held > 0 and not llm.is_sleeping()
    assert llm.sleep() == held
    assert sum(t.untyped_storage().nbytes() for t in caches) == 0 and llm.is_sleeping()
    assert llm.sleep() == 0  # already asleep
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompt_token_ids=[[1, 2]], use_tqdm=False)
    assert llm.wake_up() == held
    assert sum(t.untyped_storage().nbytes() for t in caches) == held and not llm.is_sleeping()
    assert _greedy(llm) == before
    with pytest.raises(ValueError, match=r"sleep\(level=2\) is not supported"):
        llm.sleep(level=2)
    with pytest.raises(ValueError, match=r"wake_up\(tags=\['x'\]\) is invalid"):
        llm.wake_up(tags=["x"])


def test_update_while_asleep(make_checkpoint, tmp_path):
    """The RL pattern: sleep during training, load the new weights, wake up, generate."""
    llm = _engine(make_checkpoint("llama_gqa_tied"))
    new_path, changed = _updated_checkpoint(make_checkpoint, tmp_path, "llama_gqa_tied", 6)
    llm.sleep()
    llm.update_weights(changed.items())
    assert llm.wake_up(tags=["weights"]) == 0 and llm.is_sleeping()
    llm.wake_up(tags=["kv_cache"])
    assert _greedy(llm) == _greedy(_engine(new_path))


@pytest.mark.parametrize("mode", [2, 3])
def test_update_under_dynamo_modes_no_retrace(make_checkpoint, tmp_path, mode):
    """Mode 2 (one Dynamo trace, guards dropped) and mode 3 (piecewise) with the eager piece
    backend: Dynamo's graphs take the parameters as inputs, so the update shows, untraced."""
    path = make_checkpoint("mixtral")
    built = compilation_counter.clone()
    llm = _engine(path, enforce_eager=False, compilation_config={"mode": mode, "backend": "eager"})
    assert compilation_counter.delta(built).get("num_dynamo_traces", 0) >= 1  # really compiled
    before = _greedy(llm)
    new_path, _ = _updated_checkpoint(make_checkpoint, tmp_path, "mixtral", 7)
    started = compilation_counter.clone()
    llm.update_weights(_hf_model(new_path).state_dict().items())
    after = _greedy(llm)
    delta = {k: v for k, v in compilation_counter.delta(started).items() if v}
    assert delta == {}, delta
    assert after != before and after == _greedy(_engine(new_path))


def test_update_reaches_prepacked_bf16_weights(make_checkpoint, tmp_path, monkeypatch):
    """bf16 on a CPU with native bf16: linear layers run through oneDNN-packed copies of their
    weights; a full and a partial (one shard of qkv_proj) update re-derive them. On an AVX2 CPU
    the layers are routed for the native kernel alone, which reads the updated weight itself."""
    from forwardkit.kernels.cpu.router import CpuLinearRouter, route_supported

    monkeypatch.setattr(CpuLinearRouter, "timing_default", False)  # the fast paths, not timed away

    if not route_supported(torch.bfloat16):
        pytest.skip("this CPU has neither native bf16 matmuls nor the native few-row kernel, so "
                    "no bf16 weight is routed")

    def bf16_engine(path: str) -> LLM:
        return LLM(path, dtype="bfloat16", enforce_eager=True, max_num_seqs=4,
                   max_num_batched_tokens=16, max_model_len=64)

    llm = bf16_engine(make_checkpoint("llama_gqa_tied"))
    qkv = llm.runner.module.model.layers[0].self_attn.qkv_proj
    assert qkv.calls_linear_op and llm.runner.cpu_linear_router.is_routed(qkv.weight)
    before = _greedy(llm)
    new_path, _ = _updated_checkpoint(make_checkpoint, tmp_path, "llama_gqa_tied", seed=4)
    llm.update_weights(_hf_model(new_path).state_dict().items())
    after = _greedy(llm)
    assert after != before and after == _greedy(bf16_engine(new_path))
    only = ("layers.0.self_attn.k_proj",)
    part_path, changed = _updated_checkpoint(make_checkpoint, tmp_path, "llama_gqa_tied", 5, only)
    fresh = bf16_engine(make_checkpoint("llama_gqa_tied"))
    original = _greedy(fresh)
    fresh.update_weights(changed.items())
    assert _greedy(fresh) != original and _greedy(fresh) == _greedy(bf16_engine(part_path))


def test_update_re_derives_packed_float32_copies(make_checkpoint, tmp_path, monkeypatch):
    """float32 layers take oneDNN-packed copies for 3-32 rows on any CPU with oneDNN:
    ``update_weights`` binds the runner's router for its writes, so every packed copy is
    re-derived and the engine generates what a fresh one on the new weights does."""
    from forwardkit.kernels.cpu.router import CpuLinearRouter

    monkeypatch.setattr(CpuLinearRouter, "timing_default", False)  # the fast paths, not timed away

    def engine(path: str) -> LLM:
        return LLM(path, dtype="float32", enforce_eager=True, max_num_seqs=4,
                   max_num_batched_tokens=16, max_model_len=64)

    llm = engine(make_checkpoint("llama_gqa_tied"))
    routes = llm.runner.cpu_linear_router
    assert routes is not None
    before = _greedy(llm)  # several prompts decode together: products of 3+ rows pack
    old = [e.packed for e in routes._entries.values() if e.packed is not None]
    assert old
    new_path, _ = _updated_checkpoint(make_checkpoint, tmp_path, "llama_gqa_tied", seed=4)
    llm.update_weights(_hf_model(new_path).state_dict().items())
    now = [e.packed for e in routes._entries.values() if e.packed is not None]
    assert len(now) == len(old) and not any(a is b for a in now for b in old)  # all re-derived
    after = _greedy(llm)
    assert after != before and after == _greedy(engine(new_path))
