"""Tiny random checkpoints and random (non-zero) PEFT adapters for the LoRA tests, built once
per session with ``transformers`` + ``peft``; the reference continuations come from ``peft``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 256
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> (config class, config kwargs)
BASES: dict[str, tuple[str, dict]] = {
    # GQA: 4 query heads over 2 KV heads, separate LM head
    "llama_gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=False)),
    # Qwen2: biases on q/k/v (made non-zero below), tied embeddings
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=True, rope_theta=1000000.0)),
    "mixtral": ("MixtralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                      num_local_experts=4, num_experts_per_tok=2,
                                      intermediate_size=96)),
}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              max_position_embeddings=256, rms_norm_eps=1e-5)

# name -> (base, peft LoraConfig kwargs)
ADAPTERS: dict[str, tuple[str, dict]] = {
    "llama_all": ("llama_gqa", dict(r=8, lora_alpha=16, target_modules=ALL)),
    "llama_qv_down_rslora": ("llama_gqa", dict(r=4, lora_alpha=5, use_rslora=True,
                                               target_modules=["q_proj", "v_proj", "down_proj"])),
    "llama_ko_gate": ("llama_gqa", dict(r=16, lora_alpha=8, target_modules=["k_proj", "o_proj",
                                                                             "gate_proj"])),
    "llama_up_v": ("llama_gqa", dict(r=2, lora_alpha=7, target_modules=["up_proj", "v_proj"])),
    "qwen2_subset": ("qwen2", dict(r=8, lora_alpha=24, target_modules=["q_proj", "k_proj",
                                                                       "o_proj", "up_proj"])),
    "qwen2_all_rslora": ("qwen2", dict(r=16, lora_alpha=4, use_rslora=True, target_modules=ALL)),
    "mixtral_attn": ("mixtral", dict(r=8, lora_alpha=12, target_modules=["q_proj", "k_proj",
                                                                         "v_proj", "o_proj"])),
}


def _base_model(name: str):
    cls_name, extra = BASES[name]
    torch.manual_seed(11)
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra})
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(cfg).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _peft_model(name: str, seed: int = 0):
    base, kwargs = ADAPTERS[name]
    model = _base_model(base)
    torch.manual_seed(100 + seed + sum(map(ord, name)))
    # init_lora_weights=False: A and B both random (B non-zero), so the adapter changes tokens
    config = peft.LoraConfig(init_lora_weights=False, **kwargs)
    pm = peft.get_peft_model(model, config).eval()
    with torch.no_grad():  # make the adapter strong enough to change greedy tokens
        for pname, p in pm.named_parameters():
            if "lora_B" in pname:
                p.mul_(4.0)
    return pm


@pytest.fixture(scope="session")
def lora_paths(tmp_path_factory) -> Callable[[str], tuple[str, str]]:
    """``name -> (base checkpoint dir, adapter dir)``, each saved once."""
    root = tmp_path_factory.mktemp("lora")
    bases: dict[str, str] = {}
    adapters: dict[str, str] = {}

    def get(name: str) -> tuple[str, str]:
        base = ADAPTERS[name][0]
        if base not in bases:
            path = root / f"base_{base}"
            _base_model(base).save_pretrained(str(path))
            bases[base] = str(path)
        if name not in adapters:
            path = root / f"adapter_{name}"
            _peft_model(name).save_pretrained(str(path))
            adapters[name] = str(path)
        return bases[base], adapters[name]

    return get


def _hf_reference(adapter_dir: str | None, base_dir: str, prompts: list[list[int]],
                 new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs from transformers (+ peft when an adapter is given)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    model.generation_config.eos_token_id = None  # generate every token (ignore_eos)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            res = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens = res.sequences[0, len(prompt):].tolist()
            lps = [torch.log_softmax(step[0].float(), -1)[t].item()
                   for step, t in zip(res.logits, tokens)]
            out.append((tokens, lps))
    return out


@pytest.fixture(autouse=True)
def _untimed_linear_paths(monkeypatch):
    """Fixed linear paths (no per-machine timing), so near-tie argmaxes do not depend on speed."""
    from forwardkit.kernels.cpu.router import CpuLinearRouter

    monkeypatch.setattr(CpuLinearRouter, "timing_default", False)


def _peft_state_dict(name: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """An adapter as ``peft.get_peft_model_state_dict`` returns it, and its config fields."""
    pm = _peft_model(name, seed)
    state = peft.get_peft_model_state_dict(pm)
    cfg = pm.peft_config["default"]
    return ({k: v.detach().clone() for k, v in state.items()},
            {"r": cfg.r, "lora_alpha": cfg.lora_alpha, "use_rslora": cfg.use_rslora})


def _save_peft_dir(name: str, seed: int, path: Path) -> str:
    """Save adapter ``name`` drawn with another seed (a second adapter of the same shape)."""
    _peft_model(name, seed).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def hf_reference():
    """``(adapter dir or None, base dir, prompts, new tokens) -> [(tokens, logprobs)]``."""
    return _hf_reference


@pytest.fixture(scope="session")
def peft_state_dict():
    """``(adapter name, seed) -> (PEFT state dict, config fields)``."""
    return _peft_state_dict


@pytest.fixture(scope="session")
def save_peft_dir():
    """``(adapter name, seed, path) -> path`` of a saved adapter drawn with that seed."""
    return _save_peft_dir
