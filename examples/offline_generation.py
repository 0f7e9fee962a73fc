"""Offline generation with ``forwardkit.engine.LLM`` on a local Hugging Face checkpoint.

    python examples/offline_generation.py --model /path/to/llama-checkpoint
    python examples/offline_generation.py            # builds a tiny random Llama first (offline)

A checkpoint is a directory with ``config.json`` and ``*.safetensors`` (what
``save_pretrained`` writes); Llama- and Mixtral-family architectures are supported. Without
``--model`` the script saves a tiny randomly initialised ``LlamaForCausalLM`` in a temporary
directory, so it runs on a laptop CPU with no download. Random weights generate meaningless
tokens, of course; the point is the API and that it runs.

The prompts are token ids (``prompt_token_ids``), because the tiny checkpoint ships no
tokenizer; with a real checkpoint that has one you can pass text and read ``.text``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from forwardkit.engine import LLM, SamplingParams

PROMPTS = [[1, 15, 27, 300], [1, 42], [1, 7, 7, 7, 7, 7, 99, 123, 5]]


def make_tiny_llama(directory: str) -> str:
    """Save a tiny random Llama checkpoint (config.json + model.safetensors) in ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1, eos_token_id=None, bos_token_id=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def build_llm(model: str, enforce_eager: bool, backend: str) -> LLM:
    """The engine. The comments list the knobs a newcomer usually wants."""
    return LLM(
        model=model,
        dtype="float32",          # "auto" = the checkpoint's dtype; "bfloat16" halves memory
        max_num_seqs=8,           # requests per step (continuous batching)
        max_num_batched_tokens=64,  # token budget per step; longer prompts are chunked
        max_model_len=128,        # prompt + generated tokens per request
        seed=0,                   # seeds requests that have no SamplingParams.seed
        # enforce_eager=True: no torch.compile and no CUDA graphs (fastest start-up).
        enforce_eager=enforce_eager,
        # compilation_config takes a CompilationConfig or a dict of its fields, e.g.
        #   {"mode": 3}                       piecewise compile (the default unless eager)
        #   {"mode": 2}                       one Dynamo trace, the whole graph to the backend
        #   {"backend": "eager"}              trace and split, but do not run Inductor
        #   {"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8]}
        #                                     CUDA graphs (GPU only; CPU runs use NONE)
        #   {"compile_sizes": [1, 8]}         extra Inductor compiles specialised to sizes
        compilation_config=None if enforce_eager else {"backend": backend},
    )


def show(title: str, outputs, tokenizer) -> None:
    """Print each request's generated token ids (and text when there is a tokenizer)."""
    print(title)
    for out in outputs:
        completion = out.outputs[0]
        line = (f"  prompt {out.prompt_token_ids} -> {completion.token_ids} "
                f"({len(completion.token_ids)} tokens, finish={completion.finish_reason})")
        if tokenizer is not None:
            line += f" text={completion.text!r}"
        print(line)


def main(argv: list[str] | None = None) -> int:
    """Generate greedily and with seeded sampling; check that both are reproducible."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local HF checkpoint dir (default: a tiny random Llama)")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--enforce-eager", action="store_true", help="skip torch.compile")
    parser.add_argument("--backend", choices=["inductor", "eager"], default="inductor",
                        help="compiler for the model's pieces (ignored with --enforce-eager)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="forwardkit-tiny-llama-") as tmp:
        model = args.model or make_tiny_llama(os.path.join(tmp, "tiny-llama"))
        start = time.perf_counter()
        llm = build_llm(model, args.enforce_eager, args.backend)
        print(f"engine ready in {time.perf_counter() - start:.1f} s (model {model})")
        tokenizer = llm.tokenizer  # None when the checkpoint ships none (get_tokenizer() raises)

        # Greedy: temperature 0. ignore_eos keeps going past an EOS so every request makes
        # exactly max_tokens tokens (drop it for real use).
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        first = llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy, use_tqdm=False)
        elapsed = time.perf_counter() - start
        note = "" if args.enforce_eager else ", including the one-time compile"
        show(f"greedy ({elapsed:.2f} s{note}):", first, tokenizer)

        # Sampling: a per-request seed makes the draw reproducible, whatever else is batched.
        # sampling_params may be one SamplingParams for all prompts or a list, one per prompt.
        sampled = [SamplingParams(temperature=0.8, top_p=0.95, seed=1234 + i,
                                  max_tokens=args.max_tokens, ignore_eos=True)
                   for i in range(len(PROMPTS))]
        samples = llm.generate(prompt_token_ids=PROMPTS, sampling_params=sampled, use_tqdm=False)
        show("sampled (temperature=0.8, top_p=0.95, seeds 1234, 1235, ...):", samples, tokenizer)

        # Run both again: same tokens (greedy is deterministic, sampling is seeded).
        again = llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy, use_tqdm=False)
        resampled = llm.generate(prompt_token_ids=PROMPTS, sampling_params=sampled, use_tqdm=False)

    def ids(outs):
        return [o.outputs[0].token_ids for o in outs]

    counts = {len(t) for t in ids(first) + ids(samples)}
    if counts != {args.max_tokens}:
        raise SystemExit(f"FAILED: expected {args.max_tokens} tokens per request, got {counts}")
    if ids(again) != ids(first) or ids(resampled) != ids(samples):
        raise SystemExit("FAILED: a repeated generate() gave different tokens")
    print(f"OK: generated {args.max_tokens} tokens for each of {len(PROMPTS)} prompts, greedy "
          "and sampled; repeated runs gave the same tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
