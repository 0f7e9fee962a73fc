"""Accuracy of quantized weights beside their speed: mean KL divergence of the next-token
distributions against the bf16 model, and top-1 agreement, over one fixed token sequence.

For each format it builds ``LLM(model_shape=..., dtype="bfloat16", quantization=fmt)`` (the
same seeded random weights for every engine, quantized on load) and scores the sequence with
prompt logprobs: the full next-token distribution at every position is taken from the logits
the engine computes for them (``record_prompt_logprobs`` is wrapped to keep a copy; the
engine itself is asked for 0 extra logprobs, so nothing else changes). Prints per format the
mean and max KL(bf16 || format) in nats, top-1 agreement with bf16, and the weight GB.

With llama.cpp's Python binding installed, the same columns for llama.cpp on the same bits:
each forwardkit model's weights (bf16, or the packed quantized blocks as they are) are written
to a GGUF file (``forwardkit.bench.gguf_export``) and llama.cpp scores the sequence in one
batch (its default float16 KV cache), against the same bf16 forwardkit reference.

Random weights give flatter distributions than a trained model, so the absolute KL values are
smaller than a trained checkpoint's; the ranking of the formats and their ratios are what this
measures.

``--dtype`` sets the quantized models' activations and KV cache: ``auto`` (the default) is what a
user gets, the engine's own choice (float32 on a CPU, for a model whose weights are all in
blocks, as llama.cpp computes; its KV cache is float16), ``bfloat16`` / ``float32`` force one.
For ``auto`` and ``float32`` the bf16 reference is saved as a checkpoint and each format loads
it with that dtype, so it quantizes the very bf16 values a bfloat16 run does (the script checks
that the packed blocks are the same bits).

Usage: ``python benchmarks/quant_accuracy.py [--shape llama-3.2-1b] [--tokens 128]
[--formats q8_0,q4_0,q4_1] [--dtype auto|bfloat16|float32] [--no-llamacpp]`` (the shape's projections must be whole 32-weight blocks:
``default``'s 688-wide MLP is not)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from forwardkit.engine import llm as llm_module
from forwardkit.engine.llm import LLM
from forwardkit.engine.prompt_logprobs import PromptLogprobPlan
from forwardkit.engine.sampling_params import SamplingParams


def _distributions(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens) - 1, vocab]`` log-probabilities of the next token at every position."""
    kept: dict[int, torch.Tensor] = {}
    original = llm_module.record_prompt_logprobs

    def keep(logits: torch.Tensor, plan: PromptLogprobPlan) -> None:
        rows = torch.log_softmax(logits.float(), dim=-1)
        for i, (_, pos) in enumerate(plan.targets):
            kept[pos] = rows[i].clone()
        original(logits, plan)

    llm_module.record_prompt_logprobs = keep  # type: ignore[assignment]
    try:
        llm.generate([{"prompt_token_ids": tokens}],
                     SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                     use_tqdm=False)
    finally:
        llm_module.record_prompt_logprobs = original
    return torch.stack([kept[p] for p in range(1, len(tokens))])


def _llamacpp_distributions(llm: LLM, tokens: list[int], threads: int) -> torch.Tensor:
    """llama.cpp's next-token log-probabilities over ``tokens`` on ``llm``'s very weights."""
    from forwardkit.bench.generation import hf_quant_formats, hf_state_dict
    from forwardkit.bench.llamacpp import LlamaCppGenerator

    model = llm.runner.module
    cpp = LlamaCppGenerator(llm.runner.model_config.hf_config, hf_state_dict(model),
                            max_seqs=1, max_len=len(tokens) + 1, threads=threads,
                            formats=hf_quant_formats(model))
    try:
        rows = cpp.logits([(tok, pos, 0, True) for pos, tok in enumerate(tokens)])
    finally:
        cpp.close()
    return torch.log_softmax(rows.float(), dim=-1)[:-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--tokens", type=int, default=128, help="length of the scored sequence")
    parser.add_argument("--formats", default="q8_0,q4_0,q4_1")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="activations and KV cache of the quantized models: auto = the "
                             "engine's choice (the reference stays bf16)")
    parser.add_argument("--no-llamacpp", action="store_true",
                        help="leave llama.cpp out even where its binding is installed")
    args = parser.parse_args()
    from forwardkit.bench.llamacpp import llamacpp_available, llamacpp_missing_note

    with_cpp = not args.no_llamacpp and llamacpp_available()
    if not args.no_llamacpp and not with_cpp:
        print(llamacpp_missing_note())
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    tokens = [int(t) for t in torch.randint(0, 1000, (args.tokens,), generator=gen)]

    limits = {"enforce_eager": True, "max_model_len": args.tokens + 8,
              "max_num_batched_tokens": max(512, args.tokens + 8)}

    def build(fmt: str | None) -> LLM:
        return LLM(model_shape=args.shape, dtype="bfloat16", quantization=fmt, **limits)

    reference = build(None)
    checkpoint = None
    if args.dtype != "bfloat16":
        checkpoint = tempfile.TemporaryDirectory(prefix="quant_accuracy_")
        _save_checkpoint(reference, checkpoint.name)

    def build_quantized(fmt: str) -> LLM:
        if checkpoint is None:
            return build(fmt)
        llm = LLM(model=checkpoint.name, dtype=args.dtype, quantization=fmt, **limits)
        _check_same_blocks(llm, build(fmt))
        return llm
    ref = _distributions(reference, tokens)
    p = ref.exp()

    def scores(got: torch.Tensor) -> str:
        kl = (p * (ref - got)).sum(-1)
        agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        return f"{kl.mean().item():10.2e} {kl.max().item():10.2e} {agree:11.3f}"

    print(f"shape {args.shape}, {len(tokens) - 1} scored positions, seeded random weights; "
          f"reference: forwardkit bf16; quantized models: dtype {args.dtype}")
    head = f"{'mean KL':>10} {'max KL':>10} {'top-1 agree':>11}"
    print(f"{'format':8} {'activations':>11} {'weights GB':>10} {head}" + (f"  llama.cpp: {head}" if with_cpp else ""))
    for fmt in ["bf16", *args.formats.split(",")]:
        llm = reference if fmt == "bf16" else build_quantized(fmt)
        acts = str(llm.runner.model_config.dtype).removeprefix("torch.")
        line = f"{fmt:8} {acts:>11} {llm.weight_bytes_per_rank()[0] / 1e9:10.3f} "
        line += scores(ref if fmt == "bf16" else _distributions(llm, tokens))
        if with_cpp:
            line += "             " + scores(_llamacpp_distributions(llm, tokens, threads))
        print(line, flush=True)
        del llm
    if checkpoint is not None:
        checkpoint.cleanup()


def _save_checkpoint(llm: LLM, path: str) -> None:
    """``llm``'s model as a Hugging Face checkpoint (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    from forwardkit.bench.generation import hf_state_dict

    config = dict(llm.runner.model_config.hf_config, torch_dtype="bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    state = {k: v.contiguous().clone() for k, v in hf_state_dict(llm.runner.module).items()}
    save_file(state, os.path.join(path, "model.safetensors"))


def _check_same_blocks(got: LLM, want: LLM) -> None:
    """Every packed quantized weight of ``got`` holds the same bytes as ``want``'s."""
    theirs = dict(want.runner.module.named_parameters())
    for name, param in got.runner.module.named_parameters():
        if getattr(param, "quant_format", None) is not None and not torch.equal(
                param.data, theirs[name].data):
            raise RuntimeError(f"{name}: the {got.runner.model_config.dtype} model quantized other "
                               "bits than the bf16 one")


if __name__ == "__main__":
    main()
