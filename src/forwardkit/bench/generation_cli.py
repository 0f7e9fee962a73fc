"""``forwardkit bench --generation``: builds the contenders, times them in turns, prints the table.

    forwardkit bench --generation --model-shape llama-3.2-1b --batch-sizes 1,16 --json out.json

See :mod:`forwardkit.bench.generation` for what each figure means.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform as host
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict, cast

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch

    from forwardkit.bench.generation import GenerateFn, GenerationResult
    from forwardkit.bench.llamacpp import LlamaCppGenerator
    from forwardkit.config.engine import EngineConfig
    from forwardkit.engine.llm import LLM

    # what a contender's generate function keeps alive: a forwardkit ``LLM``, llama.cpp, or the
    # transformers model
    Contender: TypeAlias = LLM | LlamaCppGenerator | torch.nn.Module

from forwardkit.commands.engine_flags import int_list, strict_int

__all__ = ["add_generation_args", "run_generation"]



class Settings(TypedDict):
    """The run's shape: the flags, else these defaults."""

    batch_sizes: list[int]
    prompt_len: int
    new_tokens: int
    repeats: int


QUICK: Settings = {"batch_sizes": [1, 4], "prompt_len": 16, "new_tokens": 4, "repeats": 1}


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``--generation`` mode's flags to ``forwardkit bench``."""
    g = parser.add_argument_group("end-to-end generation (--generation)")
    g.add_argument("--generation", action="store_true",
                   help="measure greedy generation end to end (decode tokens/s per batch size, "
                        "prefill tokens/s, time to first token, start-up, bandwidth use) for "
                        "eager, torch.compile, forwardkit and Hugging Face transformers generate")
    g.add_argument("--batch-sizes", type=int_list, default=None, metavar="LIST",
                   help="decode batch sizes (default 1,16; 1,4 with --quick)")
    g.add_argument("--prompt-len", type=strict_int, default=None, metavar="N",
                   help="prompt tokens per request (default 128; 16 with --quick)")
    g.add_argument("--new-tokens", type=strict_int, default=None, metavar="N",
                   help="decode tokens timed per request (default 32; 4 with --quick)")
    g.add_argument("--repeats", type=strict_int, default=None, metavar="N",
                   help="timed repeats per batch size, medians reported (default 3; 1 with --quick)")
    g.add_argument("--bandwidth-probe", choices=("per-run", "once", "off"), default=None,
                   help="the streaming-bandwidth roof of the BW use column: measured once per "
                        "bench (the default), re-measured before every timed run (per-run, "
                        "~0.3 s each, 3 GiB held: for hosts whose bandwidth drifts), or not at "
                        "all (off: no BW use column)")
    g.add_argument("--profile", action="store_true",
                   help="instead of timing the contenders, take forwardkit's decode steps apart "
                        "per batch size: time per linear shape (incl. the LM head), attention, "
                        "norms/rotary/activation, sampling and the engine's host work")


def _settings(args: argparse.Namespace) -> Settings:
    defaults: Settings = QUICK if args.quick else {"batch_sizes": [1, 16], "prompt_len": 128,
                                                   "new_tokens": 32, "repeats": 3}
    # a flag left out is None (or absent from a hand-made namespace): the default
    out = cast(Settings, {k: getattr(args, k, None) if getattr(args, k, None) is not None else v
                          for k, v in defaults.items()})
    for key in ("prompt_len", "new_tokens", "repeats"):
        if out[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {out[key]}")
    # the token budget is the engine's (2048, or the largest batch) unless given: a batch's
    # prompts prefill together up to it, as llama.cpp takes them in one pass; a smaller budget
    # splits the prefill and leaves part of the batch a step behind the rest for all its decode
    tokens, largest = getattr(args, "max_num_batched_tokens", None), max(out["batch_sizes"])
    if tokens is not None and tokens < largest:
        raise ValueError(f"--max-num-batched-tokens {tokens} is below the largest --batch-sizes "
                         f"{largest}: a decode step of that batch takes one token per sequence")
    return out


def _engine_config(name: str, args: argparse.Namespace, hf_config: dict[str, Any] | None,
                   s: Settings) -> EngineConfig:
    from forwardkit.bench.contenders import NATIVE_EAGER
    from forwardkit.bench.generation import SPEC_CONTENDER
    from forwardkit.commands.flag_config import engine_config_from_args

    ns = copy.copy(args)
    ns.tensor_parallel_size = _tp_of(name)  # -tp N: only the "forwardkit tp=N" contender
    if name != SPEC_CONTENDER:  # --speculative-config: only the forwardkit+spec contender
        ns.speculative_config = None
    name = "forwardkit" if name.startswith("forwardkit") else name
    longest = s["prompt_len"] + s["new_tokens"] + 1
    _check_length(ns, hf_config, longest)
    ns.max_model_len = ns.max_model_len or longest
    ns.max_num_seqs = max(s["batch_sizes"])  # the token budget: see _settings
    if name != "forwardkit":
        ns.enforce_eager, ns.engine_O, ns.compilation_config = False, ["0"], NATIVE_EAGER
    cfg = engine_config_from_args(ns, default_hf_config=hf_config)
    if cfg.model_config is None:  # max_model_len is set above, and that needs a model config
        raise RuntimeError("the generation benchmark's engine config has no model config")
    from forwardkit.config.builder import check_fits_machine

    block = int(cfg.cache_config.block_size)
    blocks = ns.max_num_seqs * -(-cfg.model_config.get_max_model_len() // block) + 1
    sized = dataclasses.replace(cfg, cache_config=dataclasses.replace(cfg.cache_config,
                                                                      num_gpu_blocks=blocks))
    # every batch size gets its full KV cache: the largest one decides what is allocated
    names = {"max_num_seqs": "--batch-sizes", "max_num_batched_tokens": "--max-num-batched-tokens",
             "num_gpu_blocks": f"--batch-sizes {max(s['batch_sizes'])}"}
    check_fits_machine(sized, names)
    return sized


def _check_length(ns: argparse.Namespace, hf_config: dict[str, Any] | None, longest: int) -> None:
    """--prompt-len + --new-tokens (+1) must fit --max-model-len, or the model's limit when
    that flag is not given; the error names the flags the user set."""
    from forwardkit.commands.flag_config import engine_config_from_args

    if ns.max_model_len is not None:
        if longest > ns.max_model_len:
            raise ValueError(f"--prompt-len + --new-tokens (+1) = {longest} tokens do not fit "
                             f"--max-model-len "
                             f"{ns.max_model_len}; lower them or raise --max-model-len")
        return
    probe = copy.copy(ns)
    probe.tensor_parallel_size = None
    model = engine_config_from_args(probe, default_hf_config=hf_config).require_model_config()
    model_len = int(model.get_max_model_len())
    if longest > model_len:
        raise ValueError(f"--prompt-len + --new-tokens (+1) = {longest} tokens exceed the model's "
                         f"max_position_embeddings ({model_len}); lower --prompt-len or "
                         "--new-tokens")


def _with_llamacpp(names: list[str], explicit: bool) -> list[str]:
    """``names`` without llama.cpp when its binding is missing (a note says so; an error when
    it was asked for by name)."""
    from forwardkit.bench.llamacpp import llamacpp_available, llamacpp_missing_note

    if "llama.cpp" not in names or llamacpp_available():
        return names
    if explicit:
        raise ValueError(f"--contenders llama.cpp: {llamacpp_missing_note()}")
    print(f"forwardkit bench --generation: {llamacpp_missing_note()}", file=sys.stderr)
    return [n for n in names if n != "llama.cpp"]


def _with_spec(names: list[str], args: argparse.Namespace) -> list[str]:
    """With ``--speculative-config``, the ``forwardkit+spec`` contender after plain forwardkit
    (when the list is the default); without it, naming that contender is an error."""
    from forwardkit.bench.generation import SPEC_CONTENDER

    spec = getattr(args, "speculative_config", None)
    if spec is None:
        if SPEC_CONTENDER in names:
            raise ValueError(f"--contenders {SPEC_CONTENDER} needs --speculative-config JSON "
                             "(the drafting method it runs)")
        return names
    if args.contenders is not None or SPEC_CONTENDER in names:
        return names
    at = names.index("forwardkit") + 1 if "forwardkit" in names else len(names)
    return names[:at] + [SPEC_CONTENDER] + names[at:]


def _tp_of(name: str) -> int:
    """The tensor-parallel size of contender ``name`` ("forwardkit tp=N" -> N, else 1)."""
    return int(name.rpartition("tp=")[2]) if name.startswith("forwardkit tp=") else 1


def _with_threads(fn: GenerateFn, threads: int) -> GenerateFn:
    """``fn`` run with ``threads`` intra-op threads: a TP driver gives its share of the cores to
    its workers, and the contenders in this process take turns."""
    import torch

    def run(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        torch.set_num_threads(threads)
        return fn(prompts, new_tokens)

    return run


def _weight_bytes_per_rank(obj: Contender) -> list[int]:
    """Bytes of weights each rank of a contender holds (one entry without TP)."""
    import torch

    if not isinstance(obj, torch.nn.Module):  # LLM, llama.cpp: they know their ranks
        return [int(b) for b in obj.weight_bytes_per_rank()]
    return [sum(p.numel() * p.element_size() for p in obj.parameters())]


def _llm_of(obj: Contender | None) -> LLM | None:
    """``obj`` when it is a forwardkit ``LLM`` (the forwardkit, eager and torch.compile
    contenders), else None."""
    from forwardkit.engine.llm import LLM

    return obj if isinstance(obj, LLM) else None


def _build(name: str, args: argparse.Namespace, hf_config: dict[str, Any] | None,
           s: Settings, fk_llm: LLM | None) -> tuple[GenerateFn, Contender]:
    """(generate function, keep-alive object) of contender ``name``."""
    import torch

    threads = torch.get_num_threads()
    fn, keep = _build_contender(name, args, hf_config, s, fk_llm)
    # a TP driver keeps cores / tp threads for itself; the others keep the process's count
    return _with_threads(fn, torch.get_num_threads() if _tp_of(name) > 1 else threads), keep


def _build_contender(name: str, args: argparse.Namespace, hf_config: dict[str, Any] | None,
                     s: Settings, fk_llm: LLM | None) -> tuple[GenerateFn, Contender]:
    from forwardkit.bench import generation as gen
    from forwardkit.engine.llm import LLM

    if name == "llama.cpp":
        if fk_llm is None:
            raise ValueError("the llama.cpp contender needs the forwardkit contender (it takes "
                             "forwardkit's weights)")
        import torch

        from forwardkit.bench.llamacpp import LlamaCppGenerator

        runner = fk_llm.runner
        # quantized weights go over as the same packed blocks (GGUF Q8_0 / Q4_0 / Q4_1)
        cpp = LlamaCppGenerator(runner.model_config.hf_config, gen.hf_state_dict(runner.module),
                                max_seqs=max(s["batch_sizes"]),
                                max_len=s["prompt_len"] + s["new_tokens"] + 2,
                                threads=torch.get_num_threads(),
                                formats=gen.hf_quant_formats(runner.module))
        return cpp.generate, cpp
    if name == "transformers":
        if fk_llm is None:
            raise ValueError("the transformers contender needs the forwardkit contender (it "
                             "takes forwardkit's weights)")
        runner = fk_llm.runner
        model = gen.build_transformers_model(runner.model_config.hf_config, runner.dtype,
                                             runner.module)
        return gen.transformers_generate(model), model
    cfg = _engine_config(name, args, hf_config, s)
    # baselines: "-cpu_linear", "-cpu_attention": plain F.linear, attention by torch ops
    llm = LLM(engine_config=cfg, seed=args.seed)
    if name == "torch.compile":
        import torch

        module = llm.runner.module
        compiled = torch.compile(module.get_submodule("model"), dynamic=True)
        module.add_module("model", cast(torch.nn.Module, compiled))
    from forwardkit.commands.generate import lora_requests

    loras = lora_requests(args, len(getattr(args, "loras", None) or [])) or []
    return gen.llm_generate(llm, [r for r in loras if r is not None]), llm


def run_generation(args: argparse.Namespace) -> int:
    """Run the end-to-end generation benchmark and print its table."""
    import torch
    from tqdm import tqdm

    from forwardkit.bench import generation as gen
    from forwardkit.config.model_shapes import (
        BUILTIN_MODEL_SHAPE,
        model_shape_config,
        weight_bytes_per_token,
    )

    s = _settings(args)
    names = args.contenders or list(gen.GENERATION_CONTENDERS)
    hf_config = None if args.model is not None else model_shape_config(args.model_shape or BUILTIN_MODEL_SHAPE)
    if getattr(args, "profile", False):
        return _run_profile(args, hf_config, s)
    names = _with_llamacpp(names, explicit=args.contenders is not None)
    names = _with_spec(names, args)
    if getattr(args, "quantization", None):
        # transformers borrows forwardkit's weights as float tensors; quantized ones are packed
        # blocks (llama.cpp takes those blocks as they are)
        borrowers = [n for n in names if n == "transformers"]
        if borrowers and args.contenders is not None:
            raise ValueError(f"--contenders {borrowers[0]} cannot run with --quantization (it "
                             "takes forwardkit's weights, which are packed quantized blocks); "
                             "leave it out")
        if borrowers:
            print(f"forwardkit bench --generation: --quantization {args.quantization}: "
                  f"{' and '.join(borrowers)} left out (it takes forwardkit's float weights)",
                  file=sys.stderr)
            names = [n for n in names if n not in borrowers]
    if getattr(args, "loras", None):
        plain = [n for n in names if n in ("transformers", "llama.cpp")]
        if plain and args.contenders is not None:
            raise ValueError(f"--contenders {plain[0]} cannot run with --lora (it serves no "
                             "adapters); leave it out")
        if plain:
            print(f"forwardkit bench --generation: --lora: {' and '.join(plain)} left out "
                  "(they serve no adapters)", file=sys.stderr)
            names = [n for n in names if n not in plain]
    for borrower in ("transformers", "llama.cpp"):  # they take forwardkit's weights: after it
        if borrower in names and "forwardkit" in names:
            names = [n for n in names if n != borrower] + [borrower]
    tp = int(getattr(args, "tensor_parallel_size", None) or 1)
    if tp > 1:  # every contender at tp=1, and forwardkit at tp=N beside them
        names.append(f"forwardkit tp={tp}")
        print(f"forwardkit bench --generation: forwardkit also runs with {tp} tensor-parallel "
              "ranks (worker processes sharing this machine's cores), beside the others at 1",
              file=sys.stderr)
    progress = not args.no_progress
    results = {n: gen.GenerationResult(n) for n in names}
    fns: dict[str, GenerateFn] = {}
    keep: dict[str, Contender] = {}
    rng = random.Random(args.seed)
    for name in tqdm(names, desc="build + first token", unit="contender", disable=not progress):
        start = time.perf_counter()
        fns[name], keep[name] = _build(name, args, hf_config, s,
                                          _llm_of(keep.get("forwardkit")))
        vocab = _vocab(keep)
        fns[name]([[rng.randrange(vocab) for _ in range(s["prompt_len"])]], 1)
        # less the llama.cpp contender's crash probe (a child process forwardkit runs first)
        results[name].startup_s = (time.perf_counter() - start
                                   - getattr(keep[name], "probe_seconds", 0.0))
        results[name].weight_bytes_per_rank = _weight_bytes_per_rank(keep[name])
        off = getattr(keep[name], "extra_buffers_off", None)
        if off is not None:  # llama.cpp fell back from a crash of its extra buffer types
            results[name].note = (f"without its extra buffer types (AMX tiles, repacked "
                                  f"rows): {off}")
        for b in s["batch_sizes"]:  # untimed: every compile and first-shape cost paid here
            fns[name]([[rng.randrange(vocab) for _ in range(s["prompt_len"])]] * b, 2)
    runner_cfg = _fk_model_info(keep)
    # the weights' move onto huge pages (each engine starts one after its first step) ends
    # before anything is timed: while it runs it takes a core and memory bandwidth
    from forwardkit.kernels.cpu import hugepages

    hugepages.wait_for_moves(timeout=300)  # warns when time runs out
    probe_mode = args.bandwidth_probe or "once"
    stream: float | None = None
    roof_fn: Callable[[], float] | None = None
    if probe_mode != "off":
        measured = gen.measure_stream_bandwidth()  # 4 KiB and huge pages, once
        stream = measured
        roof_fn = (lambda: measured) if probe_mode == "once" else gen.StreamProbe().probe
    roofs = _timed_runs(fns, names, results, s, roof_fn, rng, vocab, progress)
    del roof_fn  # the per-run probe's 3 GiB go before the report
    hf, dtype, model_name = runner_cfg
    bytes_per_step = {b: weight_bytes_per_token(hf, dtype.itemsize, b) for b in s["batch_sizes"]}
    packed = _packed_step_bytes(keep, hf)
    if packed is not None:  # quantized projections: what the model holds, not the shape's dtype
        bytes_per_step = dict.fromkeys(s["batch_sizes"], packed)
    for r in results.values():
        for b in s["batch_sizes"]:
            decode_s = statistics.median(r.samples[f"decode_{b}"])
            r.decode_tok_s[b] = b * s["new_tokens"] / decode_s
            if not roofs:  # --bandwidth-probe off
                continue
            # each run against the bandwidth measured just before it, then the median
            r.bandwidth_use[b] = statistics.median(
                bytes_per_step[b] * s["new_tokens"] / d / roof
                for d, roof in zip(r.samples[f"decode_{b}"], r.samples[f"roof_{b}"]))
        b0, b1 = min(s["batch_sizes"]), max(s["batch_sizes"])
        r.ttft_ms = statistics.median(r.samples[f"first_{b0}"]) * 1e3
        r.prefill_tok_s = b1 * s["prompt_len"] / statistics.median(r.samples[f"first_{b1}"])
    spec_figures = _spec_figures(keep)
    for obj in keep.values():  # TP workers end before the report (their cores come back)
        if not isinstance(obj, torch.nn.Module):  # LLM, llama.cpp
            obj.shutdown()
    report = _report(results, s, stream, bytes_per_step, model_name, dtype, roofs)
    if spec_figures is not None:
        report["contenders"][spec_figures.pop("contender")]["spec_decode"] = spec_figures
    print(_format(report), file=sys.stdout)
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json_path}")
    return 0


def _run_profile(args: argparse.Namespace, hf_config: dict[str, Any] | None,
                 s: Settings) -> int:
    """``--profile``: forwardkit's decode steps taken apart, one column per batch size."""
    import torch

    from forwardkit.bench.decode_profile import format_profiles, profile_decode

    steps = max(4, s["new_tokens"] // 4)
    built = _llm_of(_build("forwardkit", args, hf_config, s, None)[1])
    assert built is not None  # the forwardkit contender keeps its LLM
    llm = built
    profiles = []
    for b in s["batch_sizes"]:
        profile_decode(llm, b, s["prompt_len"], steps=1, warmup=1, seed=args.seed)  # compiles
        profiles.append(profile_decode(llm, b, s["prompt_len"], steps=steps, seed=args.seed))
    mc = llm.runner.model_config
    title = (f"forwardkit bench --generation --profile: model {mc.model or 'random weights'} "
             f"({str(llm.runner.dtype).removeprefix('torch.')}), prompts of {s['prompt_len']} "
             f"tokens, median of {steps} profiled decode steps per batch size; {host.machine()} "
             f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(format_profiles(profiles, title))
    data: dict[str, Any] = {
        "model": mc.model or "random weights", "dtype": str(llm.runner.dtype),
        "profiles": {str(p.batch_size): [dataclasses.asdict(r) for r in p.rows]
                     for p in profiles}}
    if getattr(args, "speculative_config", None) is not None:
        data["spec_profiles"] = _run_spec_profile(args, hf_config, s)
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
        print(f"\nwrote {args.json_path}")
    return 0


def _run_spec_profile(args: argparse.Namespace, hf_config: dict[str, Any] | None,
                      s: Settings) -> dict[str, Any]:
    """``--profile --speculative-config``: the speculating engine's decode steps split into
    draft, verify, sampling and host time, one column per batch size; returns them for JSON."""
    from forwardkit.bench.generation import SPEC_CONTENDER
    from forwardkit.bench.spec_profile import format_spec_profiles, profile_spec_steps

    llm = _llm_of(_build(SPEC_CONTENDER, args, hf_config, s, None)[1])
    assert llm is not None
    new_tokens = max(8, s["new_tokens"])
    profiles = []
    for b in s["batch_sizes"]:
        profile_spec_steps(llm, b, s["prompt_len"], 4, seed=args.seed)  # compiles, first shapes
        profiles.append(profile_spec_steps(llm, b, s["prompt_len"], new_tokens, seed=args.seed))
    spec = llm.engine_config.speculative_config
    assert spec is not None
    print(format_spec_profiles(profiles, f"{SPEC_CONTENDER} ({spec.method}, k="
                               f"{spec.num_speculative_tokens}): decode steps of {new_tokens} "
                               "greedy tokens per request, medians (wall clock, no profiler)"))
    llm.shutdown()
    return {str(p.batch_size): dataclasses.asdict(p) for p in profiles}


def _timed_runs(fns: dict[str, GenerateFn], names: list[str],
                results: dict[str, GenerationResult], s: Settings,
                roof_fn: Callable[[], float] | None, rng: random.Random, vocab: int,
                progress: bool) -> list[float]:
    """Every contender's timed generations per batch size, in rotating order; returns the
    bandwidth roof of each (also kept per contender as ``roof_B`` samples; none without
    ``roof_fn``)."""
    from tqdm import tqdm

    from forwardkit.bench import generation as gen

    roofs: list[float] = []
    total = len(s["batch_sizes"]) * s["repeats"] * len(names)
    bar = tqdm(total=total, desc="timed generations", unit="run", disable=not progress)
    for b in s["batch_sizes"]:
        prompts = [[rng.randrange(vocab) for _ in range(s["prompt_len"])] for _ in range(b)]
        for rep in range(s["repeats"]):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for name in order:
                if roof_fn is not None:
                    roof = max(roof_fn(), 1.0)
                    roofs.append(roof)
                    results[name].samples.setdefault(f"roof_{b}", []).append(roof)
                fns[name](prompts[:1], 1)  # untimed: brings the weights back into the caches
                first, full = gen.time_generation(fns[name], prompts, s["new_tokens"])
                results[name].samples.setdefault(f"first_{b}", []).append(first)
                results[name].samples.setdefault(f"decode_{b}", []).append(full - first)
                bar.update(1)
    bar.close()
    return roofs


def _vocab(keep: dict[str, Contender]) -> int:
    for obj in keep.values():
        llm = _llm_of(obj)
        if llm is not None:
            return int(llm.runner.vocab_size)
    return 1000


def _fk_model_info(keep: dict[str, Contender]) -> tuple[dict[str, Any], torch.dtype, str]:
    for obj in keep.values():
        llm = _llm_of(obj)
        if llm is not None:
            runner = llm.runner
            mc = runner.model_config
            name = mc.model or "random weights"
            return mc.hf_config, runner.dtype, name
    raise ValueError("the generation benchmark needs at least one forwardkit LLM contender")


def _packed_step_bytes(keep: dict[str, Contender], hf: dict[str, Any]) -> int | None:
    """Weight bytes a decode step of a dense model with quantized (packed) projections reads:
    every parameter it holds (packed projections, the LM head) less an untied embedding table,
    whose rows alone are read. None when nothing is packed, or for a mixture of experts
    (the shape's formula counts the experts a step touches)."""
    from forwardkit.bench.generation import hf_quant_formats

    llm = next((m for m in map(_llm_of, keep.values()) if m is not None), None)
    if llm is None or hf.get("num_local_experts"):
        return None
    module = llm.runner.module
    if not hf_quant_formats(module):
        return None
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    if not hf.get("tie_word_embeddings", False):
        total -= sum(p.numel() * p.element_size() for n, p in module.named_parameters()
                     if "embed_tokens" in n)
    return total


def _spec_figures(keep: dict[str, Contender]) -> dict[str, Any] | None:
    """The ``forwardkit+spec`` contender's draft counters over all its runs (warm-up
    included): drafts, acceptance, mean tokens emitted per verification; None without it."""
    from forwardkit.bench.generation import SPEC_CONTENDER

    llm = _llm_of(keep.get(SPEC_CONTENDER))
    if llm is None:
        return None
    from forwardkit.engine.metrics import Vector

    m = {x.name: x for x in llm.get_metrics()}
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    drafted = m["vllm:spec_decode_num_draft_tokens"].value
    accepted = m["vllm:spec_decode_num_accepted_tokens"].value
    spec = llm.engine_config.speculative_config
    assert spec is not None
    return {"contender": SPEC_CONTENDER, "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else 0.0,
            "accepted_per_pos": list(per_pos.values) if isinstance(per_pos, Vector) else [],
            "mean_accepted_length": m["forwardkit:spec_decode_mean_accepted_length"].value}


def _report(results: dict[str, GenerationResult], s: Settings, stream: float | None,
            bytes_per_step: dict[int, int], model_name: str, dtype: torch.dtype,
            roofs: list[float]) -> dict[str, Any]:
    import torch

    ref = results.get("transformers")
    contenders = {}
    for name, r in results.items():
        entry = {
            "startup_s": r.startup_s,
            "ttft_ms": r.ttft_ms,
            "prefill_tok_s": r.prefill_tok_s,
            "decode_tok_s": {str(b): v for b, v in r.decode_tok_s.items()},
            "bandwidth_use": {str(b): v for b, v in r.bandwidth_use.items()},
            "weight_bytes_per_rank": list(r.weight_bytes_per_rank),
        }
        if r.note is not None:
            entry["note"] = r.note
        if ref is not None:
            entry["decode_speedup_vs_transformers"] = {
                str(b): v / ref.decode_tok_s[b] for b, v in r.decode_tok_s.items()}
        contenders[name] = entry
    return {
        "model": model_name,
        "dtype": str(dtype).removeprefix("torch."),  # the forwardkit contender's
        "batch_sizes": s["batch_sizes"],
        "prompt_len": s["prompt_len"],
        "new_tokens": s["new_tokens"],
        "repeats": s["repeats"],
        "stream_gb_s": None if stream is None else stream / 1e9,
        "stream_gb_s_per_run": None if not roofs else {
            "min": min(roofs) / 1e9, "median": statistics.median(roofs) / 1e9,
            "max": max(roofs) / 1e9},
        "weight_bytes_per_step": {str(b): v for b, v in bytes_per_step.items()},
        "machine": f"{host.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "contenders": contenders,
    }


def _format(report: dict[str, Any]) -> str:
    sizes = [str(b) for b in report["batch_sizes"]]
    bw = report["stream_gb_s_per_run"] is not None
    head = (f"{'contender':<16}{'weights/rank GB':>16}{'startup s':>10}{'TTFT ms':>9}"
            f"{'prefill tok/s':>14}")
    for b in sizes:
        head += f"{f'B={b} tok/s':>13}" + (f"{'BW use':>8}" if bw else "")
    has_ref = any("decode_speedup_vs_transformers" in c for c in report["contenders"].values())
    if has_ref:
        head += f"  {'vs transformers':>15}"
    lines = [
        f"\nforwardkit bench --generation: model {report['model']} ({report['dtype']}), "
        f"prompts of {report['prompt_len']} tokens, {report['new_tokens']} decode tokens timed, "
        f"median of {report['repeats']}",
        f"machine: {report['machine']}; {_bandwidth_note(report)}; weight bytes per decode step "
        + ", ".join(f"B={b}: {int(v) / 1e9:.2f} GB" for b, v in report["weight_bytes_per_step"].items()),
        "", head, "-" * len(head)]
    for name, c in report["contenders"].items():
        per_rank = c["weight_bytes_per_rank"]
        row = (f"{name:<16}{max(per_rank) / 1e9:>16.3f}{c['startup_s']:>10.1f}"
               f"{c['ttft_ms']:>9.0f}{c['prefill_tok_s']:>14.0f}")
        for b in sizes:
            row += f"{c['decode_tok_s'][b]:>13.1f}"
            if bw:
                row += f"{c['bandwidth_use'][b]:>8.0%}"
        if has_ref:
            ratio = c.get("decode_speedup_vs_transformers", {})
            row += f"  {' / '.join(f'{ratio[b]:.2f}x' for b in sizes):>15}"
        lines.append(row)
    lines.extend(f"{name}: {c['note']}" for name, c in report["contenders"].items()
                 if "note" in c)
    lines.extend(_tp_lines(report))
    lines.extend(_spec_lines(report))
    if bw:
        lines.append("\nBW use = weight bytes one decode step reads / step time / the streaming "
                     "bandwidth measured for that run (median over runs)")
    if has_ref:
        lines.append("vs transformers = decode tokens/s ratio per batch size")
    return "\n".join(lines)


def _bandwidth_note(report: dict[str, Any]) -> str:
    per_run = report["stream_gb_s_per_run"]
    if per_run is None:
        return "streaming bandwidth not measured (--bandwidth-probe off)"
    note = (f"streaming bandwidth {report['stream_gb_s']:.1f} GB/s (best of a 1 GiB GEMV and a "
            "1 GiB read)")
    if per_run["min"] == per_run["max"] == report["stream_gb_s"]:
        return note + ", measured once"
    return note + f", re-measured before each timed run: {per_run['min']:.1f}-{per_run['max']:.1f} GB/s"


def _spec_lines(report: dict[str, Any]) -> list[str]:
    """The speculating contender against plain forwardkit: decode tok/s, acceptance."""
    lines = []
    one = report["contenders"].get("forwardkit")
    for name, c in report["contenders"].items():
        sd = c.get("spec_decode")
        if sd is None:
            continue
        speed = "" if one is None else ", decode tok/s vs forwardkit " + ", ".join(
            f"B={b}: {c['decode_tok_s'][b] / one['decode_tok_s'][b]:.2f}x" for b in c["decode_tok_s"])
        lines.append(f"\n{name} ({sd['method']}, k={sd['num_speculative_tokens']}): "
                     f"{sd['accepted_tokens']:.0f} of {sd['draft_tokens']:.0f} drafts accepted "
                     f"({sd['acceptance']:.0%}), {sd['mean_accepted_length']:.2f} tokens per "
                     f"verification (all runs, warm-up included){speed}")
    return lines


def _tp_lines(report: dict[str, Any]) -> list[str]:
    """Tensor-parallel contenders against forwardkit at tp=1: weights per rank, decode tok/s."""
    contenders = report["contenders"]
    one = contenders.get("forwardkit")
    lines = []
    for name, c in contenders.items():
        if not name.startswith("forwardkit tp=") or one is None:
            continue
        ratio = max(c["weight_bytes_per_rank"]) / max(one["weight_bytes_per_rank"])
        speed = ", ".join(f"B={b}: {c['decode_tok_s'][b] / one['decode_tok_s'][b]:.2f}x"
                          for b in c["decode_tok_s"])
        lines.append(f"\n{name} vs forwardkit (tp=1): weights per rank {ratio:.2f}x "
                     f"({', '.join(f'{b / 1e9:.3f}' for b in c['weight_bytes_per_rank'])} GB by "
                     f"rank), decode tok/s {speed} (the ranks share this machine's cores)")
    return lines
