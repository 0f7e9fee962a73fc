"""``LLM.update_lora`` (RL: adapters from tensors in memory, all or nothing, prefix cache keyed
by the adapter's version) and bad adapters (clear errors, the engine keeps serving)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from forwardkit import LLM, LoRARequest, SamplingParams
from forwardkit.engine.lora import LoRAError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# 40 tokens: two full blocks of 16 are cached after the first request
LONG = [(5 * i + 3) % 256 for i in range(40)]
PROMPTS = [LONG, [3, 4, 5, 6]]


def _engine(base: str, **kwargs) -> LLM:
    args = dict(dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=64, enable_lora=True, max_lora_rank=16, max_loras=2)
    return LLM(base, **{**args, **kwargs})


def _tokens(llm: LLM, lora, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False,
                        lora_request=lora)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_update_lora_from_tensors_equals_the_adapter_from_disk(lora_paths, peft_state_dict):
    base, adapter_dir = lora_paths("llama_all")
    llm = _engine(base)
    state, config = peft_state_dict("llama_all", 0)  # the tensors saved in adapter_dir
    request = llm.update_lora("rl", state, config)
    assert request.lora_path == "" and request.lora_int_id in llm.list_loras()
    from_disk = _tokens(llm, LoRARequest("disk", 7, adapter_dir))
    assert _tokens(llm, request) == from_disk
    assert from_disk != _tokens(llm, None)


def test_update_invalidates_the_adapters_cached_prefixes(lora_paths, peft_state_dict,
                                                         save_peft_dir, tmp_path):
    base, _ = lora_paths("llama_all")
    llm = _engine(base, enable_prefix_caching=True)
    v1, config = peft_state_dict("llama_all", 0)
    request = llm.update_lora("rl", v1, config)
    _tokens(llm, request)  # caches LONG's blocks under v1
    again = llm.generate(prompt_token_ids=[LONG], sampling_params=GREEDY, use_tqdm=False,
                         lora_request=request)
    assert again[0].num_cached_tokens == 32  # the cache works for an unchanged adapter
    v2, _ = peft_state_dict("llama_all", 1)
    assert llm.update_lora("rl", v2) == request  # same name: same id, its config kept
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False,
                        lora_request=request)
    assert outs[0].num_cached_tokens == 0  # v1's KV is not reused for v2
    fresh_dir = save_peft_dir("llama_all", 1, tmp_path / "v2")
    fresh = _tokens(_engine(base, enable_prefix_caching=True), LoRARequest("v2", 1, fresh_dir))
    assert [list(o.outputs[0].token_ids) for o in outs] == fresh


def test_a_bad_update_leaves_the_old_adapter_serving(lora_paths, peft_state_dict):
    base, _ = lora_paths("llama_all")
    llm = _engine(base)
    v1, config = peft_state_dict("llama_all", 0)
    request = llm.update_lora("rl", v1, config)
    before = _tokens(llm, request)
    v2, _ = peft_state_dict("llama_all", 1)
    key = next(k for k in v2 if "layers.1.mlp.down_proj.lora_B" in k)
    v2[key] = v2[key][:, :4]  # wrong rank
    with pytest.raises(LoRAError, match=r"update_lora\('rl'\): .*layers\.1\.mlp\.down_proj"
                                        r"\.lora_B\.weight has shape \(64, 4\), expected \(64, 8\)"):
        llm.update_lora("rl", v2)
    v2[key] = torch.full((64, 8), float("nan"))
    with pytest.raises(LoRAError, match="holds inf or nan"):
        llm.update_lora("rl", v2)
    assert _tokens(llm, request) == before
    with pytest.raises(ValueError, match=r"a new adapter needs config="):
        llm.update_lora("other", v1)


def _copy_adapter(src: str, dst: str, edit=None, config_edit=None) -> str:
    import json

    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    if edit is not None:
        edit(tensors)
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = json.load(f)
    if config_edit is not None:
        config_edit(config)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return dst


def _wrong_shape(t: dict) -> None:
    key = next(k for k in t if "layers.0.self_attn.k_proj.lora_A" in k)
    t[key] = torch.zeros(8, 32)


def _extra_layer(t: dict) -> None:
    for side, shape in (("A", (8, 64)), ("B", (64, 8))):
        t[f"base_model.model.model.layers.9.self_attn.q_proj.lora_{side}.weight"] = torch.zeros(shape)


def _embedding(t: dict) -> None:
    t["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(8, 256)


BAD = {
    "rank": (None, lambda c: c.update(r=32), r"adapter_config\.json: r=32 is above "
             r"max_lora_rank=16"),
    "shape": (_wrong_shape, None, r"adapter_model\.safetensors: .*layers\.0\.self_attn\.k_proj"
              r"\.lora_A\.weight has shape \(8, 32\), expected \(8, 64\)"),
    "missing_module": (_extra_layer, None, r"adapter_model\.safetensors: the adapter targets "
                       r"'model\.layers\.9\.self_attn\.q_proj', which this model has no"),
    "not_lora": (_embedding, None, r"adapter_model\.safetensors: tensor "
                 r"'base_model\.model\.model\.embed_tokens\.lora_embedding_A' is not a LoRA"),
    "target": (None, lambda c: c.update(target_modules=["q_proj", "lm_head"]),
               r"adapter_config\.json: target_modules names \['lm_head'\]"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapters_are_named_and_the_others_keep_serving(lora_paths, tmp_path, case):
    base, good_dir = lora_paths("llama_all")
    edit, config_edit, match = BAD[case]
    bad_dir = _copy_adapter(good_dir, str(tmp_path / case), edit, config_edit)
    llm = _engine(base)
    good = LoRARequest("good", 1, good_dir)
    expected = _tokens(llm, good)
    bad = LoRARequest("bad", 2, bad_dir)
    with pytest.raises(LoRAError, match=match):
        llm.add_lora(bad)
    with pytest.raises(LoRAError, match=match):  # a generate naming it queues nothing
        _tokens(llm, [good, bad])
    assert llm.list_loras() == {1}
    assert not llm.scheduler.has_unfinished
    assert _tokens(llm, good) == expected


def test_corrupt_file_and_unknown_ids(lora_paths, tmp_path):
    base, good_dir = lora_paths("llama_all")
    bad_dir = _copy_adapter(good_dir, str(tmp_path / "corrupt"))
    path = os.path.join(bad_dir, "adapter_model.safetensors")
    with open(path, "r+b") as f:
        f.write(b"\xff" * 64)
    llm = _engine(base)
    good = LoRARequest("good", 1, good_dir)
    expected = _tokens(llm, good)
    with pytest.raises(LoRAError, match=rf"^{path}: not a readable safetensors file"):
        llm.add_lora(LoRARequest("bad", 2, bad_dir))
    with pytest.raises(LoRAError, match=r"lora_path='/nonexistent' is not a directory"):
        llm.add_lora(LoRARequest("gone", 3, "/nonexistent"))
    with pytest.raises(ValueError, match=r"remove_lora: lora_int_id=5 is not a registered "
                                         r"adapter; registered: \[1\]"):
        llm.remove_lora(5)
    with pytest.raises(ValueError, match=r"lora_int_id=1 is adapter 'good', not 'other'"):
        llm.add_lora(LoRARequest("other", 1, good_dir))
    assert _tokens(llm, good) == expected
    assert llm.remove_lora(1) and llm.list_loras() == set()
    assert _tokens(llm, good) == expected  # registered again from its path
    with pytest.raises(ValueError, match=r"lora_int_id must be an integer >= 1, got 0"):
        LoRARequest("zero", 0, good_dir)


def test_lora_calls_need_enable_lora(lora_paths):
    base, good_dir = lora_paths("llama_all")
    llm = LLM(base, dtype="float32", enforce_eager=True, max_model_len=64)
    with pytest.raises(ValueError, match=r"generate\(lora_request=...\) needs "
                                         r"LLM\(enable_lora=True\)"):
        _tokens(llm, LoRARequest("a", 1, good_dir))
    with pytest.raises(ValueError, match=r"add_lora needs LLM\(enable_lora=True\)"):
        llm.add_lora(LoRARequest("a", 1, good_dir))


def test_the_engine_keeps_its_own_copy_of_given_tensors(lora_paths, peft_state_dict):
    """A trainer changing its tensors in place after update_lora changes nothing served, also
    when the adapter comes back into a slot from the host copy."""
    base, other_dir = lora_paths("llama_ko_gate")
    llm = _engine(base, max_loras=1)
    state, config = peft_state_dict("llama_all", 0)
    request = llm.update_lora("rl", state, config)
    before = _tokens(llm, request)
    with torch.no_grad():
        for t in state.values():
            t.mul_(-3.0)  # the trainer's next step, in place
    _tokens(llm, LoRARequest("other", 9, other_dir))  # swaps "rl" out of the only slot
    assert _tokens(llm, request) == before
