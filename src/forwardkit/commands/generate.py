"""``forwardkit generate``: run the reference engine on a few prompts and print the results.

    forwardkit generate --prompt-token-ids 1,2,3 --max-tokens 8          # built-in model
    forwardkit generate --model ./ckpt --prompt "Hello" --temperature 0.8 --seed 1 -n 2
    forwardkit generate -tp 2 --prompt-token-ids 1,2,3      # 2 tensor-parallel worker ranks
    torchrun --nproc-per-node 2 -m forwardkit.cli generate -dp 2 --prompt ... --prompt ...

Completions are printed in the order the prompts were given (``--prompt`` and
``--prompt-token-ids`` mixed), ``n`` consecutive lines per prompt. ``--output text`` prints each
completion as one JSON string (newlines escaped, so one completion is one line); ``ids`` its
token ids; ``json`` one object per completion with the prompt's index. Under torchrun with
``-dp N`` the prompts are split over the data-parallel ranks (a dense model runs as N
independent replicas, a mixture-of-experts model as one DP engine) and global rank 0 prints
every completion once, in prompt order.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

from forwardkit.commands.engine_flags import (
    add_engine_args,
    non_negative_float,
    strict_float,
    strict_int,
    token_ids,
)

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig
    from forwardkit.engine.lora import LoRARequest
    from forwardkit.engine.outputs import CompletionOutput, RequestOutput
    from forwardkit.engine.sampling_params import SamplingParams

__all__ = ["register", "run"]


class _TextPrompt(argparse.Action):
    """``--prompt TEXT`` appended to the one ordered prompt list."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items.append(values)
        setattr(namespace, self.dest, items)


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand."""
    parser = subparsers.add_parser(
        "generate",
        help="generate tokens for prompts with the reference engine",
        description="Generate completions with forwardkit's reference engine (LLM.generate). "
                    "Without --model the built-in small model (random weights) is used. "
                    "Completions print in prompt order, n per prompt.",
    )
    add_engine_args(parser)
    g = parser.add_argument_group("prompts and output")
    g.add_argument("--prompt", dest="prompts", action=_TextPrompt, default=[], metavar="TEXT",
                   help="a text prompt (repeatable; kept in order with --prompt-token-ids); "
                        "needs a checkpoint that ships a tokenizer, or --tokenizer")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a directory with the tokenizer to use instead of the model's (a GGUF "
                        "file's own vocabulary is used when transformers can read it)")
    g.add_argument("--prompt-token-ids", dest="prompts", action=_TextPrompt, type=token_ids,
                   metavar="IDS", help="a prompt as comma-separated token ids, e.g. 1,2,3 "
                                       "(repeatable)")
    g.add_argument("--output", choices=("auto", "text", "ids", "json"), default="auto",
                   help="per completion, one line: text = the generated text as a JSON string "
                        "(newlines escaped); ids = comma-separated token ids; json = an object "
                        "with the prompt's index, the completion's index, text, token ids, "
                        "finish and stop reason (and logprobs when asked); auto = text when the "
                        "model has a tokenizer, else ids")
    s = parser.add_argument_group("sampling (vLLM's SamplingParams)")
    s.add_argument("-n", "--n", dest="n", type=strict_int, default=1, metavar="N",
                   help="completions per prompt (default 1)")
    s.add_argument("--max-tokens", type=strict_int, default=16, metavar="N",
                   help="most tokens to generate per completion (default 16)")
    s.add_argument("--min-tokens", type=strict_int, default=0, metavar="N",
                   help="EOS, stop tokens and stop strings are ignored before N tokens (default 0)")
    s.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                   help="sampling temperature; 0 = greedy (default 0)")
    s.add_argument("--top-k", type=strict_int, default=0, metavar="K",
                   help="sample among the K most likely tokens; 0 or -1 = all (default 0)")
    s.add_argument("--top-p", type=strict_float, default=1.0, metavar="P",
                   help="sample from the smallest token set with probability mass P, in (0, 1] "
                        "(default 1 = off)")
    s.add_argument("--min-p", type=strict_float, default=0.0, metavar="P",
                   help="drop tokens below P times the top one's probability (default 0 = off)")
    s.add_argument("--presence-penalty", type=strict_float, default=0.0, metavar="X",
                   help="subtracted once per token already generated, in [-2, 2] (default 0)")
    s.add_argument("--frequency-penalty", type=strict_float, default=0.0, metavar="X",
                   help="subtracted per earlier occurrence in the output, in [-2, 2] (default 0)")
    s.add_argument("--repetition-penalty", type=strict_float, default=1.0, metavar="X",
                   help="divides positive / multiplies negative logits of seen tokens, > 0 "
                        "(default 1 = off)")
    s.add_argument("--seed", type=strict_int, default=None, metavar="S",
                   help="random seed of the engine and of every request (default: engine seed 0)")
    s.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="a stop string (repeatable; needs the model's tokenizer)")
    s.add_argument("--stop-token-ids", type=token_ids, default=None, metavar="IDS",
                   help="comma-separated token ids that end a completion")
    s.add_argument("--include-stop-str-in-output", action="store_true",
                   help="keep the stop string in the text")
    s.add_argument("--ignore-eos", action="store_true",
                   help="keep generating after the end-of-sequence token")
    s.add_argument("--logprobs", type=strict_int, default=None, metavar="K",
                   help="per generated token, the K most likely tokens' logprobs and the sampled "
                        "one's (-1 = the whole vocabulary; shown with --output json)")
    s.add_argument("--prompt-logprobs", type=strict_int, default=None, metavar="K",
                   help="the same for every prompt token after the first (--output json)")
    s.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="drop special tokens from the text (default on)")
    parser.set_defaults(func=run)
    return parser


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from forwardkit.engine import SamplingParams

    return SamplingParams(
        n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, stop=args.stop,
        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs, skip_special_tokens=args.skip_special_tokens,
        include_stop_str_in_output=args.include_stop_str_in_output,
    )


def _torchrun_rank(world: int) -> int | None:
    """This process's global rank under torchrun (None when not launched by it)."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    if int(os.environ["WORLD_SIZE"]) != world:
        raise ValueError(f"--data-parallel-size x --tensor-parallel-size = {world} but torchrun "
                         f"started WORLD_SIZE={os.environ['WORLD_SIZE']} ranks")
    return int(os.environ["RANK"])


def run(args: argparse.Namespace) -> int:
    """Build the engine from the arguments, generate, print; returns the exit code."""
    from forwardkit.commands.flag_config import FLAG_NAMES, engine_config_from_args
    from forwardkit.config.builder import check_fits_machine
    from forwardkit.engine import LLM

    prompts: list[str | list[int]] = list(args.prompts)
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT or --prompt-token-ids 1,2,3 (repeatable)")
    params = _sampling_params(args)  # bad values fail before any model is built
    dp = int(args.data_parallel_size or 1)
    tp = int(args.tensor_parallel_size or 1)
    rank = _torchrun_rank(dp * tp) if dp > 1 else None
    if dp > 1 and rank is None:
        raise ValueError(
            f"--data-parallel-size {dp} needs one process per rank; launch with "
            f"torchrun --nproc-per-node {dp * tp} -m forwardkit.cli generate ... (the prompts "
            "are split over the ranks; rank 0 prints them all)")
    config = engine_config_from_args(args)
    if dp > 1 and not config.require_model_config().is_moe:
        if tp > 1:
            raise ValueError("-dp with -tp under torchrun needs a mixture-of-experts model; a "
                             "dense model runs -dp (independent replicas) or -tp, not both")
        args.data_parallel_size = None  # a dense model: dp independent one-process replicas
        config = engine_config_from_args(args)
    check_fits_machine(config, FLAG_NAMES)
    output = args.output
    if dp > 1:
        assert rank is not None
        if getattr(args, "loras", None):
            raise ValueError("--lora with --data-parallel-size > 1 is not supported")
        return _run_data_parallel(args, config, prompts, params, rank, dp, tp, output)
    llm = LLM.from_engine_config(config, seed=0 if args.seed is None else args.seed,
                                 tokenizer=args.tokenizer)
    mode = _output_mode(output, llm, config)
    outputs = llm.generate(_prompt_dicts(prompts, llm), params, use_tqdm=False,
                           lora_request=lora_requests(args, len(prompts)))
    if not llm.is_tp_driver:
        return 0  # under torchrun with TP: the replica's TP rank 0 prints its outputs
    _print(list(enumerate(outputs)), mode)
    return 0


def lora_requests(args: argparse.Namespace, count: int) -> list[LoRARequest | None] | None:
    """The adapters of ``--lora NAME=DIR`` (ids 1, 2, ... in flag order) given to ``count``
    prompts in turn; None without ``--lora``."""
    from forwardkit.engine.lora import LoRARequest

    specs = getattr(args, "loras", None) or []
    if not specs:
        return None
    names = [n for n, _ in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora {dup[0]}=... is given twice; each adapter needs its own NAME")
    reqs = [LoRARequest(n, i + 1, d) for i, (n, d) in enumerate(specs)]
    return [reqs[i % len(reqs)] for i in range(count)]


def _output_mode(output: str, llm: object, config: EngineConfig) -> str:
    from forwardkit.engine import LLM

    assert isinstance(llm, LLM)
    if output == "auto":
        return "text" if llm.tokenizer is not None else "ids"
    if output == "text" and llm.tokenizer is None:
        model = config.require_model_config().model or "<built-in>"
        raise ValueError(f"--output text needs a tokenizer but model {model} ships none; use "
                         "--output ids or json")
    return output


def _prompt_dicts(prompts: list[str | list[int]], llm: object) -> list[str | dict[str, list[int]]]:
    from forwardkit.engine import LLM

    assert isinstance(llm, LLM)
    if any(isinstance(p, str) for p in prompts) and llm.tokenizer is None:
        model = llm.model_config.model or "<built-in>"
        raise ValueError(f"--prompt needs a tokenizer but model {model} ships none; use "
                         "--prompt-token-ids or --tokenizer DIR")
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]


def _run_data_parallel(args: argparse.Namespace, config: EngineConfig,
                       prompts: list[str | list[int]], params: SamplingParams, rank: int,
                       dp: int, tp: int, output: str) -> int:
    """One torchrun rank of ``-dp``: generate this DP rank's share of the prompts (every
    ``dp``-th, from its DP rank), gather every share at global rank 0, which prints them in
    prompt order."""
    import torch.distributed as dist

    from forwardkit.distributed.parallel_state import quiesce_collectives_at_exit
    from forwardkit.engine import LLM

    dp_rank = rank // tp
    moe = config.parallel_config.data_parallel_size > 1
    if not moe and not dist.is_initialized():
        dist.init_process_group("gloo")  # only to gather the outputs; the model steps alone
        quiesce_collectives_at_exit()
    llm = LLM.from_engine_config(config, seed=0 if args.seed is None else args.seed,
                                 tokenizer=args.tokenizer)
    mode = _output_mode(output, llm, config)
    mine = list(range(dp_rank, len(prompts), dp))
    outputs = llm.generate(_prompt_dicts([prompts[i] for i in mine], llm), params, use_tqdm=False)
    share = list(zip(mine, outputs)) if llm.is_tp_driver else []
    gathered: list[list[tuple[int, RequestOutput]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, share)
    if rank == 0:
        _print(sorted((item for part in gathered for item in part or []),
                      key=lambda pair: pair[0]), mode)
    if not moe:
        dist.destroy_process_group()
    return 0


def _completion_json(index: int, out: RequestOutput, c: CompletionOutput) -> dict[str, object]:
    record: dict[str, object] = {
        "index": index, "completion": c.index, "prompt": out.prompt,
        "prompt_token_ids": out.prompt_token_ids, "text": c.text, "token_ids": c.token_ids,
        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
    }
    if c.logprobs is not None:
        record["cumulative_logprob"] = c.cumulative_logprob
        record["logprobs"] = [{str(t): lp.logprob for t, lp in d.items()} for d in c.logprobs]
    if out.prompt_logprobs is not None and c.index == 0:
        record["prompt_logprobs"] = [None if d is None else {str(t): lp.logprob
                                                             for t, lp in d.items()}
                                     for d in out.prompt_logprobs]
    return record


def _print(outputs: list[tuple[int, RequestOutput]], mode: str) -> None:
    """One line per completion, prompts in the order given, ``n`` completions each."""
    lines = []
    for index, out in outputs:
        for c in out.outputs:
            if mode == "json":
                lines.append(json.dumps(_completion_json(index, out, c)))
            elif mode == "text":
                lines.append(json.dumps(c.text, ensure_ascii=False))
            else:
                lines.append(",".join(str(t) for t in c.token_ids))
    if lines:
        print("\n".join(lines), flush=True)
