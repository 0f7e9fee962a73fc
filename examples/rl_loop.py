"""A minimal RL rollout-update loop: generate with the engine, train the policy with
``transformers``, push the new weights into the running engine, generate again.

    python examples/rl_loop.py                      # tiny random Llama, eager engine
    python examples/rl_loop.py --compile inductor   # the engine compiled (mode 3, Inductor)

Each iteration:

1. rollout: ``llm.generate`` samples ``n`` completions per prompt with their logprobs;
2. train: a REINFORCE step on the trainer's copy of the policy (a ``transformers`` model),
   with a toy reward (the share of even token ids), while the engine sleeps (KV cache freed);
3. update: ``llm.wake_up()`` and ``llm.update_weights(trainer.state_dict().items())``: the new
   weights are copied in place, with no recompilation and no graph re-capture.

It checks that after every update the engine's greedy tokens equal the trainer's own greedy
``generate`` (the engine really runs the new policy), that the engine's logprobs of its
samples match the trainer's log-softmax, and that no compilation happened after start-up.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from forwardkit import LLM, SamplingParams
from forwardkit.compilation.counters import compilation_counter

PROMPTS = [[1, 15, 27, 30], [1, 42], [1, 7, 7, 99]]


def make_tiny_llama(directory: str) -> str:
    """Save a tiny random Llama checkpoint (config.json + model.safetensors) in ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.1, eos_token_id=None, bos_token_id=1,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def completion_logprobs(trainer, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The trainer's log-probabilities of ``tokens`` after ``prompt`` (with gradients)."""
    ids = torch.tensor([prompt + tokens])
    logits = trainer(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)


def trainer_greedy(trainer, prompt: list[int], n: int) -> list[int]:
    """The trainer's own greedy continuation (transformers ``generate``)."""
    with torch.no_grad():
        out = trainer.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def main(argv: list[str] | None = None) -> int:
    """Run the loop; exits non-zero if a check fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt (n)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--compile", choices=["none", "eager", "inductor"], default="none",
                        help="engine compilation: none (enforce_eager), or mode 3 with this backend")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="forwardkit-rl-") as tmp:
        path = make_tiny_llama(os.path.join(tmp, "policy"))
        trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer.generation_config.eos_token_id = None
        compile_kw = ({"enforce_eager": True} if args.compile == "none" else
                      {"compilation_config": {"mode": 3, "backend": args.compile}})
        llm = LLM(path, dtype="float32", max_num_seqs=16, max_num_batched_tokens=64,
                  max_model_len=64, seed=0, **compile_kw)
    optimizer = torch.optim.SGD(trainer.parameters(), lr=args.lr)
    started = compilation_counter.clone()
    rollout = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens,
                             ignore_eos=True, logprobs=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    failures = []
    previous = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS,
                                                             sampling_params=greedy, use_tqdm=False)]
    changed = 0
    for it in range(args.iterations):
        # 1. rollout
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=rollout, use_tqdm=False)
        samples = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
        rewards = torch.tensor([sum(t % 2 == 0 for t in c.token_ids) / len(c.token_ids) for _, c in samples])
        # 2. train (the engine sleeps meanwhile: its KV cache memory is free for the trainer)
        freed = llm.sleep()
        optimizer.zero_grad()
        advantages = rewards - rewards.mean()
        logps = [completion_logprobs(trainer, p, c.token_ids) for p, c in samples]
        drift = max(abs(lp.sum().item() - c.cumulative_logprob) for lp, (_, c) in zip(logps, samples))
        loss = -sum(a * lp.sum() for a, lp in zip(advantages, logps)) / len(samples)
        loss.backward()
        optimizer.step()
        # 3. update the running engine
        llm.wake_up()
        start = time.perf_counter()
        info = llm.update_weights(trainer.state_dict().items())
        seconds = time.perf_counter() - start
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy,
                                                              use_tqdm=False)]
        want = [trainer_greedy(trainer, p, args.max_tokens) for p in PROMPTS]
        changed += got != previous
        previous = got
        print(f"iteration {it}: {len(samples)} samples, mean reward {rewards.mean():.3f}, "
              f"engine-vs-trainer logprob drift {drift:.1e}, slept ({freed} B KV freed), "
              f"update_weights {info['num_tensors']} tensors in {seconds * 1000:.1f} ms, "
              f"greedy tokens match the trainer: {got == want}")
        if got != want:
            failures.append(f"iteration {it}: engine greedy {got} != trainer greedy {want}")
        if drift > 1e-3:
            failures.append(f"iteration {it}: logprob drift {drift}")
    print(f"greedy output changed after {changed} of {args.iterations} updates")
    if not changed:
        failures.append("no update changed the engine's greedy output")
    recompiles = {k: v for k, v in compilation_counter.delta(started).items() if v}
    print(f"compilation counters after start-up: {recompiles or 'no change'}")
    if recompiles:
        failures.append(f"compilation after start-up: {recompiles}")
    if failures:
        raise SystemExit("FAILED: " + "; ".join(failures))
    print(f"OK: {args.iterations} rollout-train-update iterations; the engine followed every update "
          "with no recompilation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
