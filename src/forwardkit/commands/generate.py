"""``forwardkit generate``: run the reference engine on a few prompts and print the results.

    forwardkit generate --prompt-token-ids 1,2,3 --max-tokens 8          # built-in model
    forwardkit generate --model ./ckpt --prompt "Hello" --temperature 0.8 --seed 1
    forwardkit generate -tp 2 --prompt-token-ids 1,2,3      # 2 tensor-parallel worker ranks
"""

from __future__ import annotations

import argparse
import json
import os

from forwardkit.config.args import (
    FLAG_NAMES,
    add_engine_args,
    engine_config_from_args,
    non_negative_float,
)
from forwardkit.config.builder import check_fits_machine

__all__ = ["register", "run"]


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integer token ids like 1,2,3, got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError(f"expected at least one token id, got {text!r}")
    return ids


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand."""
    parser = subparsers.add_parser(
        "generate",
        help="generate tokens for prompts with the reference engine",
        description="Generate completions with forwardkit's reference engine (LLM.generate). "
                    "Without --model the built-in small model (random weights) is used.",
    )
    add_engine_args(parser)
    g = parser.add_argument_group("prompts and sampling")
    g.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a text prompt (repeatable); needs a checkpoint that ships a tokenizer")
    g.add_argument("--prompt-token-ids", action="append", default=[], type=_token_ids,
                   metavar="IDS", help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable)")
    g.add_argument("--max-tokens", type=int, default=16, metavar="N",
                   help="most tokens to generate per prompt (default 16)")
    g.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                   help="sampling temperature; 0 = greedy (default 0)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens; 0 or -1 = all (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample from the smallest token set with probability mass P, in (0, 1] "
                        "(default 1 = off)")
    g.add_argument("--seed", type=int, default=None, metavar="S",
                   help="random seed of the engine and of every request (default: engine seed 0)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating after the end-of-sequence token")
    g.add_argument("--output", choices=("auto", "text", "ids", "json"), default="auto",
                   help="what to print per prompt: generated text, token ids, or one JSON object "
                        "per line; auto = text when the model has a tokenizer, else ids")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Build the engine from the arguments, generate, print; returns the exit code."""
    from forwardkit.engine import LLM, SamplingParams

    if not args.prompt and not args.prompt_token_ids:
        raise ValueError("no prompts: pass --prompt TEXT or --prompt-token-ids 1,2,3 (repeatable)")
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
    )
    config = engine_config_from_args(args)
    check_fits_machine(config, FLAG_NAMES)
    dp = config.parallel_config.data_parallel_size
    if dp > 1 and "WORLD_SIZE" not in os.environ:
        raise ValueError(
            f"--data-parallel-size {dp} needs one process per rank; launch with "
            f"torchrun --nproc-per-node {dp} -m forwardkit.cli generate ... (every rank runs "
            "the given prompts)"
        )
    llm = LLM.from_engine_config(config, seed=0 if args.seed is None else args.seed)
    prompts: list[str | dict[str, list[int]]] = list(args.prompt) + [{"prompt_token_ids": ids} for ids in args.prompt_token_ids]
    if args.prompt and llm.tokenizer is None:
        raise ValueError(
            f"--prompt needs a tokenizer but model "
            f"{(config.model_config.model if config.model_config else None) or '<built-in>'} "
            "ships none; use --prompt-token-ids"
        )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if not llm.is_tp_driver:
        return 0  # under torchrun with TP: the replica's TP rank 0 prints its outputs
    mode = args.output
    if mode == "auto":
        mode = "text" if llm.tokenizer is not None else "ids"
    for out in outputs:
        completion = out.outputs[0]
        if mode == "json":
            print(json.dumps({
                "prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
                "text": completion.text, "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
            }))
        elif mode == "text":
            print(completion.text)
        else:
            print(",".join(str(t) for t in completion.token_ids))
    return 0
