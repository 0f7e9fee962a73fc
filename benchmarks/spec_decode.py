"""Speculative decoding (n-gram or a draft model) on one model, side by side with plain decoding.

    python benchmarks/spec_decode.py --model-shape llama-3.2-1b -k 4 --repeats 3
    python benchmarks/spec_decode.py --model-shape llama-3.2-1b -k 2 --method draft_model \
        --draft-layers 2

Prints, medians over ``--repeats`` rounds that alternate the two engines:

1. the model step alone (``ModelRunner.execute``): a verify step of ``1 + k`` tokens (on the
   speculating engine's runner, which runs a request's drafts as decode rows) against a
   1-token decode step, one request at a context of ``--context`` tokens, the two timed in
   alternation;
2. greedy generation of ``--new-tokens`` tokens at batch 1 from a repetitive prompt (the loops
   random-weight models fall into are what prompt lookup catches) and from a random prompt
   (drafts mostly rejected): tokens/s with and without drafts, the acceptance measured, the
   proposal time per verify step (the draft model's steps, or the n-gram lookup), and the
   speed-up that this acceptance and the measured costs allow (plain decoding's steps at the
   decode cost against speculation's verify steps at the verify cost plus the proposal time,
   and its steps without drafts at the decode cost), beside the speed-up reached.

``--method draft_model``: the draft is a checkpoint written to a temporary directory. With
``--draft-shape`` equal to ``--model-shape`` (the default) it holds the target's own seeded
random weights cut to its first ``--draft-layers`` layers (embedding, final norm and head
kept): all layers is draft = target, every draft accepted, the upper bound of acceptance;
fewer is a cheaper draft that agrees with the target less. Another shape (same vocabulary)
has its own seeded random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch

from forwardkit.bench.generation import hf_state_dict
from forwardkit.config.model_shapes import model_shape_config
from forwardkit.engine import LLM, SamplingParams
from forwardkit.runner.batch import StepBatch


def _metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


def _step_batch(llm: LLM, context: int, query: int) -> StepBatch:
    """One request of ``query`` tokens after ``context`` on ``llm``'s runner."""
    blocks = list(range(-(-(context + query) // llm.runner.block_size)))
    return StepBatch(req_ids=["x"], token_ids=[[7] * query], num_computed_tokens=[context],
                     block_tables=[blocks])


def _step_costs(plain: LLM, spec: LLM, context: int, query: int, repeats: int) -> tuple[float, float]:
    """Median ms of a 1-token decode step on ``plain``'s runner and of a ``query``-token verify
    step on ``spec``'s, timed in alternation (a background job of either engine, such as its
    weights moving to huge pages after its first steps, then weighs on both alike)."""
    decode_batch, verify_batch = _step_batch(plain, context, 1), _step_batch(spec, context, query)
    for _ in range(3):  # first uses of a row count make packed weight copies: untimed
        plain.runner.execute(decode_batch)
        spec.runner.execute(verify_batch)
    times: dict[str, list[float]] = {"decode": [], "verify": []}
    for r in range(repeats):
        order = (("decode", plain, decode_batch), ("verify", spec, verify_batch))
        for name, llm, batch in (order if r % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            llm.runner.execute(batch)
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["decode"]) * 1e3, statistics.median(times["verify"]) * 1e3


def _draft_layers(draft_shape: str, layers: int | None) -> int:
    """``--draft-layers`` checked against the draft shape (None: all its layers)."""
    total = int(model_shape_config(draft_shape)["num_hidden_layers"])
    if layers is None:
        return total
    if not 1 <= layers <= total:
        raise SystemExit(f"--draft-layers must be in 1..{total} for {draft_shape}, got {layers}")
    return layers


def write_draft(target: LLM, model_shape: str, draft_shape: str, layers: int | None,
                path: str) -> str:
    """A draft checkpoint under ``path`` (see the module docstring); returns ``path``."""
    from safetensors.torch import save_file

    config: dict[str, Any] = model_shape_config(draft_shape)
    layers = _draft_layers(draft_shape, layers)
    if draft_shape == model_shape:
        state = hf_state_dict(target.runner.module)
    else:
        source = LLM(model_shape=draft_shape, dtype=target.runner.dtype, enforce_eager=True,
                     max_model_len=64, num_gpu_blocks=4)
        state = hf_state_dict(source.runner.module)
    keep = {}
    for name, tensor in state.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            continue
        keep[name] = tensor.contiguous()
    config["num_hidden_layers"] = layers
    config["torch_dtype"] = str(target.runner.dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(keep, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


class _ProposalTimer:
    """Wall time of the speculating engine's proposals (wraps its proposer's ``propose_all``)."""

    def __init__(self, llm: LLM) -> None:
        proposer = llm._proposer
        assert proposer is not None
        self.seconds = 0.0
        inner = proposer.propose_all

        def timed(*args: Any) -> None:
            start = time.perf_counter()
            inner(*args)
            self.seconds += time.perf_counter() - start

        proposer.propose_all = timed  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-shape", default="llama-3.2-1b")
    ap.add_argument("-k", type=int, default=4, help="draft tokens (default 4)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    ap.add_argument("--draft-shape", default=None,
                    help="draft_model: the draft's shape (default: --model-shape)")
    ap.add_argument("--draft-layers", type=int, default=None,
                    help="draft_model: the draft's layers (default: all of its shape)")
    ap.add_argument("--enforce-eager", action="store_true", help="no compilation (quick runs)")
    args = ap.parse_args()
    draft_shape = args.draft_shape or args.model_shape
    layers = _draft_layers(draft_shape, args.draft_layers)  # checked before anything is built
    kw = dict(model_shape=args.model_shape, max_model_len=512, max_num_seqs=4,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager,
              **({"dtype": args.dtype} if args.dtype else {}))
    plain = LLM(**kw)
    tmp = None
    draft_note = ""
    if args.method == "draft_model":
        tmp = tempfile.TemporaryDirectory(prefix="spec_draft_")
        write_draft(plain, args.model_shape, draft_shape, layers, tmp.name)
        draft_note = f", draft {draft_shape} with {layers} layers"
        spec_cfg: dict[str, Any] = {"method": "draft_model", "model": tmp.name,
                                    "num_speculative_tokens": args.k}
    else:
        spec_cfg = {"num_speculative_tokens": args.k, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3}
    spec = LLM(**kw, speculative_config=spec_cfg)
    timer = _ProposalTimer(spec)
    vocab = plain.runner.vocab_size
    rng = random.Random(0)
    loop = [rng.randrange(vocab) for _ in range(8)] * 6
    prompts = {"repetitive": loop, "random": [rng.randrange(vocab) for _ in range(48)]}
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for llm in (plain, spec):  # compile, first shapes
        llm.generate(prompt_token_ids=[loop[:16]], sampling_params=SamplingParams(max_tokens=8),
                     use_tqdm=False)
    # the verify step on the speculating engine's runner: it runs the drafts as decode rows
    decode, verify = _step_costs(plain, spec, args.context, 1 + args.k, 5 * args.repeats)
    print(f"model step, 1 request at context {args.context}: decode {decode:.2f} ms, verify of "
          f"{1 + args.k} tokens {verify:.2f} ms = {verify / decode:.2f}x")
    print("| prompt | plain tok/s | spec tok/s | speed-up | acceptance | mean emitted/step | "
          "proposal ms/step | ideal speed-up | reached/ideal |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, prompt in prompts.items():
        rates: dict[str, list[float]] = {"plain": [], "spec": []}
        drafted = accepted = steps = 0.0
        proposal = 0.0
        for r in range(args.repeats):
            for label in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
                llm = plain if label == "plain" else spec
                before = [_metric(spec, n) for n in ("vllm:spec_decode_num_draft_tokens",
                                                     "vllm:spec_decode_num_accepted_tokens",
                                                     "vllm:spec_decode_num_drafts")]
                proposed = timer.seconds
                start = time.perf_counter()
                out = llm.generate(prompt_token_ids=[prompt], sampling_params=params,
                                   use_tqdm=False)
                rates[label].append(len(out[0].outputs[0].token_ids)
                                    / (time.perf_counter() - start))
                if label == "spec":
                    after = [_metric(spec, n) for n in ("vllm:spec_decode_num_draft_tokens",
                                                        "vllm:spec_decode_num_accepted_tokens",
                                                        "vllm:spec_decode_num_drafts")]
                    drafted += after[0] - before[0]
                    accepted += after[1] - before[1]
                    steps += after[2] - before[2]
                    proposal += timer.seconds - proposed
        p, s = statistics.median(rates["plain"]), statistics.median(rates["spec"])
        acceptance = accepted / drafted if drafted else 0.0
        emitted = 1 + accepted / steps if steps else 1.0
        runs = args.repeats  # one speculative run per round
        per_run_steps, per_run_accepted = steps / runs, accepted / runs
        undrafted = max(0.0, args.new_tokens - per_run_steps - per_run_accepted)
        per_run_proposal_ms = proposal / runs * 1e3
        ideal = args.new_tokens * decode / (per_run_steps * verify + per_run_proposal_ms
                                            + undrafted * decode)
        per_step = per_run_proposal_ms / per_run_steps if per_run_steps else 0.0
        print(f"| {name} | {p:.2f} | {s:.2f} | {s / p:.2f}x | {100 * acceptance:.0f}% | "
              f"{emitted:.2f} | {per_step:.2f} | {ideal:.2f}x | {s / p / ideal:.0%} |")
    print(f"\n{args.model_shape}, {str(plain.runner.dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads, {args.method}{draft_note}, k={args.k}, "
          f"medians of {args.repeats}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
