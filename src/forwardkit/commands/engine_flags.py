"""The engine flags of ``forwardkit config``, ``generate`` and ``bench`` and strict argument
types, without importing torch or the config package (``forwardkit --help`` stays quick).

``add_engine_args(parser)`` adds the vLLM-style flags; ``forwardkit.commands.flag_config`` turns the
parsed namespace into an engine config. Numbers are parsed strictly: ``1_000``, an empty item
of a list (``1,,3``) or a stray comma is refused, and argparse names the flag.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["ALL2ALL_BACKENDS", "DEFAULT_MAX_NUM_BATCHED_TOKENS", "DEFAULT_MAX_NUM_SEQS",
           "add_engine_args", "int_list", "lora_spec", "non_negative_float", "normalize_engine_argv",
           "positive_int", "strict_float", "strict_int", "token_ids"]

# Copies of the config layer's values (importing it would import torch); a test keeps them equal.
ALL2ALL_BACKENDS: tuple[str, ...] = (
    "naive",
    "pplx",
    "deepep_high_throughput",
    "deepep_low_latency",
    "allgather_reducescatter",
    "flashinfer_all2allv",
)
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def strict_int(text: str) -> int:
    """argparse type: an integer written with digits only (no ``_``, no spaces inside)."""
    stripped = text.strip()
    if not _INT.fullmatch(stripped):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    return int(stripped)


def strict_float(text: str) -> float:
    """argparse type: a finite decimal number (no ``_``, no ``nan`` / ``inf``)."""
    stripped = text.strip()
    if not _FLOAT.fullmatch(stripped):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return float(stripped)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = strict_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def quantization_format(text: str) -> str:
    """argparse type: a block format the loader quantizes to (checked here, before any model or
    progress output, with the same list the model config checks)."""
    from forwardkit.config.model import QUANTIZATION_FORMATS

    if text not in QUANTIZATION_FORMATS:
        raise argparse.ArgumentTypeError(f"must be one of {list(QUANTIZATION_FORMATS)}, got {text!r}")
    return text


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    value = strict_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def _items(text: str, what: str) -> list[int]:
    parts = text.split(",")
    if any(not p.strip() for p in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated {what} like 1,2,3 with no "
                                         f"empty item, got {text!r}")
    try:
        return [strict_int(p) for p in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what} like 1,2,3, got "
                                         f"{text!r}") from None


def token_ids(text: str) -> list[int]:
    """argparse type: comma-separated integer token ids (``1,2,3``; spaces allowed)."""
    return _items(text, "integer token ids")


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers, sorted, without repeats."""
    values = _items(text, "positive integers")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return sorted(set(values))


_DOTTED = re.compile(r"^(?:-cc|--compilation-config|-O)\.(.*)$")
_NUMBER = re.compile(r"^-?\d+(\.\d*)?$")


# config.cache.HASH_ALGOS, repeated so --help imports no config module (a test compares them)
PREFIX_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def json_object(text: str) -> dict[str, Any]:
    """argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def normalize_engine_argv(argv: Sequence[str]) -> list[str]:
    """Rewrite ``-cc.k=v`` / ``--compilation-config.k=v`` to ``-O.k=v`` (argparse can't match them).

    As in vLLM, the value may also follow as the next token (``-cc.mode 3``), unless that
    token is another flag. Tokens after a literal ``--`` are left alone.
    """
    out: list[str] = []
    rest = False
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not rest and token == "--":
            rest = True
        match = None if rest else _DOTTED.match(token)
        if not match:
            out.append(token)
            continue
        key = match.group(1)
        if "=" not in key and i < len(tokens) and tokens[i] != "--" and (
                not tokens[i].startswith("-") or _NUMBER.match(tokens[i])):
            key = f"{key}={tokens[i]}"
            i += 1
        out.append(f"-O.{key}")
    return out


def lora_spec(text: str) -> tuple[str, str]:
    """argparse type of ``--lora NAME=DIR``: ``(name, directory)``, both non-empty."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=DIR (a PEFT adapter directory), got "
                                         f"{text!r}")
    return name.strip(), path.strip()


def _install_normalizer(parser: argparse.ArgumentParser) -> None:
    original = parser.parse_known_args

    def parse_known_args(args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        argv = sys.argv[1:] if args is None else args
        return original(normalize_engine_argv(list(argv)), namespace)

    # NOTE: set on the instance, so it also runs when this parser is a subcommand parser
    # (argparse calls the subparser's parse_known_args with the remaining tokens).
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign,assignment]  # instance patch


def add_engine_args(parser: argparse.ArgumentParser, *, max_num_seqs: int | None = None,
                    max_num_batched_tokens: int | None = None,
                    batch_defaults: tuple[str, str] | None = None) -> argparse.ArgumentParser:
    """Add the engine flags (model, batch limits, parallelism, optimisation, compilation).

    ``max_num_seqs`` / ``max_num_batched_tokens``: this command's own defaults of the batch
    limits (shown in ``--help`` as the ones used); None = the engine's. ``batch_defaults``:
    the ``--help`` words for those defaults, (requests, tokens), for a command whose modes pick
    them (its flags then default to None)."""
    _install_normalizer(parser)
    g = parser.add_argument_group("engine configuration")
    g.add_argument("--model", default=None, metavar="DIR",
                   help="local Hugging Face checkpoint directory (config.json + safetensors) "
                        "or GGUF file; default: the built-in small model")
    g.add_argument("--dtype", default=None,
                   help="model dtype: auto (from config.json), float32, bfloat16 or float16")
    g.add_argument("--max-model-len", type=positive_int, default=None, metavar="N",
                   help="longest sequence (default: max_position_embeddings of the model)")
    seqs_default, tokens_default = batch_defaults or (
        f"default {max_num_seqs or DEFAULT_MAX_NUM_SEQS}",
        f"default {max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS}, at least max-num-seqs")
    g.add_argument("--max-num-seqs", type=positive_int, default=max_num_seqs, metavar="N",
                   help=f"most requests per step ({seqs_default})")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=max_num_batched_tokens,
                   metavar="N", help=f"most tokens per step ({tokens_default})")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts over several steps (default on); with "
                        "--no-enable-chunked-prefill max-num-batched-tokens defaults to at least "
                        "max-model-len")
    g.add_argument("--block-size", type=positive_int, default=None, metavar="N",
                   help="tokens per KV-cache block (default 16)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of prompt prefixes already computed (default on)")
    g.add_argument("--prefix-caching-hash-algo", default=None, choices=PREFIX_HASH_ALGOS,
                   help="how full KV blocks are hashed for prefix caching (default sha256)")
    g.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 3}\' (default off)')
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (implied by --lora)")
    g.add_argument("--lora", dest="loras", action="append", type=lora_spec, default=None,
                   metavar="NAME=DIR", help="a PEFT LoRA adapter directory (repeatable; prompts "
                   "take the adapters in turn: prompt i uses adapter i mod count)")
    g.add_argument("--max-loras", type=positive_int, default=None, metavar="N",
                   help="adapters one step may hold (default: the number of --lora, else 1)")
    g.add_argument("--max-lora-rank", type=positive_int, default=None, metavar="R",
                   help="largest adapter rank: 1, 8, 16, 32, 64, 128, 256, 320 or 512 "
                        "(default 16)")
    g.add_argument("--max-cpu-loras", type=positive_int, default=None, metavar="N",
                   help="adapters kept loaded in host memory (default: --max-loras)")
    g.add_argument("--quantization", type=quantization_format, default=None, metavar="FORMAT",
                   help="quantize the attention/MLP projections on load: q8_0, q4_0 or q4_1 "
                        "(the token embedding and the LM head: q8_0)")
    g.add_argument("--data-parallel-size", "-dp", type=positive_int, default=None, metavar="N",
                   help="data-parallel replicas (default 1)")
    g.add_argument("--data-parallel-rank", type=strict_int, default=None, metavar="R",
                   help="this process's data-parallel rank (default 0)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=None, metavar="N",
                   help="tensor-parallel ranks: the weights split over N processes (this one "
                        "starts N - 1 workers, or under torchrun each rank is one) (default 1)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="shard MoE experts over data-parallel ranks")
    g.add_argument("--all2all-backend", choices=ALL2ALL_BACKENDS, default=None,
                   help="MoE all-to-all backend (default allgather_reducescatter)")
    g.add_argument("--enable-dbo", action="store_true",
                   help="dual-batch overlap: with data parallelism, split a step every DP rank "
                        "agrees on into two micro-batches so one's MoE communication overlaps "
                        "the other's compute")
    g.add_argument("--ubatch-size", type=strict_int, default=None, metavar="N",
                   help="micro-batches per step when > 1 (without --enable-dbo; default 0)")
    g.add_argument("--dbo-decode-token-threshold", type=positive_int, default=None, metavar="N",
                   help="micro-batch a decode-only step from N tokens (default 32)")
    g.add_argument("--dbo-prefill-token-threshold", type=positive_int, default=None, metavar="N",
                   help="micro-batch a step with a prefill from N tokens (default 512)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no torch.compile and no CUDA graphs (mode 0, optimisation level O0)")
    g.add_argument("--platform", choices=("cuda", "cpu"), default=None,
                   help="resolve for this platform (default: detected); 'cuda' works without a GPU "
                        "for inspecting configs")
    g.add_argument("-O", "--optimization-level", dest="engine_O", action="append", default=[],
                   metavar="LEVEL|.KEY=VALUE",
                   help="optimisation level 0-3 (-O3, -O 3, -O=3; default 2), or a dotted "
                        "compilation-config key: -O.cudagraph_mode=FULL, -O.pass_config.eliminate_noops=false")
    g.add_argument("--compilation-config", "-cc", dest="compilation_config", default=None,
                   metavar="JSON",
                   help="compilation config as a JSON object, e.g. '{\"mode\": 3, "
                        "\"cudagraph_capture_sizes\": [1, 2, 4]}'; single keys: -cc.KEY=VALUE")
    return parser


