"""End-to-end generation benchmark: forwardkit's ``LLM`` against the code a user would write.

Contenders, all on the same weights and dtype, in one process, taking turns:

- ``forwardkit``: ``LLM`` with the resolved configuration (compiled, CPU linear fast paths);
- ``eager``: ``LLM`` running the same model as plain PyTorch (mode NONE, native ops, plain
  ``F.linear`` weights);
- ``torch.compile``: that eager model under stock ``torch.compile(dynamic=True)``;
- ``transformers``: Hugging Face ``generate`` on a ``transformers`` model holding the same
  weights (Llama-family shapes; greedy, KV cache on, its default attention);
- ``llama.cpp``: llama.cpp on a GGUF of the same weights, same dtype and thread count, when
  its Python binding is installed (:mod:`forwardkit.bench.llamacpp`).

For each batch size ``B``: the time of a greedy generate of 1 token (prefill and first
token) and of ``1 + N`` tokens; decode tokens/s = ``B * N / (t(1+N) - t(1))``. Time to first
token is ``t(1)`` at batch 1. Bandwidth use = weight bytes one decode step reads / step time,
as a fraction of the streaming bandwidth measured on the spot (a GEMV over 1 GiB).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["GENERATION_CONTENDERS", "SPEC_CONTENDER", "GenerationResult", "StreamProbe", "hf_state_dict",
           "measure_stream_bandwidth", "time_generation"]

GENERATION_CONTENDERS = ("eager", "torch.compile", "forwardkit", "transformers", "llama.cpp")
SPEC_CONTENDER = "forwardkit+spec"
"""forwardkit with ``--speculative-config``, beside plain forwardkit (the other contenders run
without speculation); in the default list when the flag is given."""
GenerateFn = Callable[[list[list[int]], int], list[list[int]]]


@dataclass
class GenerationResult:
    """Figures of one contender (medians over the repeats)."""

    name: str
    startup_s: float = 0.0
    ttft_ms: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: dict[int, float] = field(default_factory=dict)
    bandwidth_use: dict[int, float] = field(default_factory=dict)
    weight_bytes_per_rank: list[int] = field(default_factory=list)
    note: str | None = None  # how the contender ran, where it differs from its default
    samples: dict[str, list[float]] = field(default_factory=dict, repr=False)


def measure_stream_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s the memory streams: the best of a GEMV over a 1 GiB matrix (fp32 ``torch.mv``,
    and forwardkit's bf16 linear where bf16 packing is supported) and a plain read of 1 GiB
    (``sum``), each on 4 KiB pages and on huge pages where the system gives them. The highest
    figure is the roof, so bandwidth use is never flattered by a slow kernel or small pages."""
    cols = 4096
    rows = int(gib * 2**30) // (4 * cols)
    return max(_best_stream_rate(rows, cols, huge, repeats) for huge in (False, True))


def _best_stream_rate(rows: int, cols: int, huge: bool, repeats: int) -> float:
    from forwardkit.kernels.cpu import hugepages, router

    matrix = torch.empty(rows, cols)
    if huge:
        hugepages.advise(matrix)  # before the first write
    matrix.normal_()
    vec = torch.randn(cols)
    best = _rate(lambda: torch.mv(matrix, vec), matrix.numel() * 4, repeats)
    best = max(best, _rate(lambda: matrix.sum(), matrix.numel() * 4, repeats))
    halves = matrix.view(-1).to(torch.bfloat16)  # 0.5 GiB; read twice as one 1 GiB stream
    if huge:
        hugepages.collapse(halves)
    best = max(best, _rate(lambda: (halves.sum(), halves.sum()), halves.numel() * 4, repeats))
    if router.prepack_supported(torch.bfloat16):
        bf = torch.cat([halves, halves]).view(2 * rows, cols)  # same bytes as the fp32 matrix
        if huge:
            hugepages.collapse(bf)
        packed = router.CpuLinearRouter(timing=False)
        packed.pack(bf)
        x = torch.randn(1, cols, dtype=torch.bfloat16)
        with router.bind(packed):
            best = max(best, _rate(lambda: router.linear(x, bf), bf.numel() * 2, repeats))
    return best


class StreamProbe:
    """Quick re-measurements of the streaming bandwidth, taken right before each timed run.

    On a shared machine the bandwidth the memory gives moves from minute to minute (here 30 to
    60 GB/s); a roof measured once would flatter or punish runs taken at other moments. The
    probe keeps a 1 GiB float32 matrix and a 1 GiB bf16 matrix on huge pages and returns the
    best of reading each and a GEMV over each (~0.3 s)."""

    def __init__(self, gib: float = 1.0) -> None:
        from forwardkit.kernels.cpu import hugepages

        cols = 4096
        rows = int(gib * 2**30) // (4 * cols)
        self.f32 = torch.empty(rows, cols)
        self.bf16 = torch.empty(2 * rows, cols, dtype=torch.bfloat16)
        for t in (self.f32, self.bf16):
            hugepages.advise(t)  # before the first write
            t.normal_()
        self.vec = torch.randn(cols)
        self.row = torch.randn(1, cols, dtype=torch.bfloat16)

    def probe(self, repeats: int = 2) -> float:
        """Bytes/s: the best of the four streams."""
        from forwardkit.kernels.cpu import native_linear

        n = self.f32.numel() * 4
        best = max(_rate(lambda: torch.mv(self.f32, self.vec), n, repeats),
                   _rate(lambda: self.f32.sum(), n, repeats),
                   _rate(lambda: self.bf16.sum(), n, repeats))
        if native_linear.available(torch.bfloat16):
            best = max(best, _rate(lambda: native_linear.linear_rows(self.row, self.bf16, None), n,
                                   repeats))
        return best


def _rate(fn: Callable[[], Any], nbytes: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


def time_generation(fn: GenerateFn, prompts: list[list[int]], new_tokens: int,
                    tries: int = 3) -> tuple[float, float]:
    """``(seconds for 1 token, seconds for 1 + new_tokens)`` of a greedy generate of ``prompts``.

    Decode time is the difference. When it is not clearly above the noise (less than half the
    1-token time: short runs of small models), both are measured again, up to ``tries`` times,
    and the fastest of each is kept; while the difference is not even positive (the two runs
    are timed apart, so a busy machine can make the 1-token run the slower), up to
    ``4 * tries`` times. Raises RuntimeError if it stays so (a negative decode time is no
    figure)."""
    best_first = best_full = float("inf")
    most = 4 * tries  # the tries while the difference is not positive
    for attempt in range(most):
        start = time.perf_counter()
        fn(prompts, 1)
        best_first = min(best_first, time.perf_counter() - start)
        start = time.perf_counter()
        out = fn(prompts, 1 + new_tokens)
        best_full = min(best_full, time.perf_counter() - start)
        short = [len(o) for o in out if len(o) != 1 + new_tokens]
        if short:
            raise RuntimeError(f"a contender generated {short[0]} tokens instead of {1 + new_tokens}")
        if best_full - best_first > 0.5 * best_first or (attempt + 1 >= tries
                                                           and best_full > best_first):
            break
    if best_full <= best_first:
        raise RuntimeError(
            f"decode time not measurable: {1 + new_tokens} tokens took {best_full:.4f} s, 1 token "
            f"{best_first:.4f} s (fastest of {most} tries each); the machine is too busy "
            "or --new-tokens too small")
    return best_first, best_full


# ---------------------------------------------------------------------------- transformers
def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """forwardkit Llama-family parameters under Hugging Face names, merged projections split
    back into views (no copy: the transformers model shares forwardkit's weights)."""
    from forwardkit.layers.linear import MergedLinear

    stacked = getattr(model, "stacked_params", ())
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if not isinstance(owner, MergedLinear):
            out[name] = param.detach()
            continue
        for shard, (offset, size) in owner.shard_offsets.items():
            hf_name = next((name.replace(ours, hf) for hf, ours, sid in stacked
                            if ours in name and sid == shard), None)
            if hf_name is None:
                raise ValueError(f"no Hugging Face name for shard {shard!r} of {name}")
            out[hf_name] = param.detach().narrow(0, offset, size)
    return out


def hf_quant_formats(model: torch.nn.Module) -> dict[str, str]:
    """Hugging Face name -> block format (``q4_0``, ...) of every packed quantized weight of
    ``model``, under the names :func:`hf_state_dict` gives them (merged projections split)."""
    stacked = getattr(model, "stacked_params", ())
    out: dict[str, str] = {}
    for name, param in model.named_parameters():
        fmt = getattr(param, "quant_format", None)
        if fmt is None:
            continue
        merged = [name.replace(ours, hf) for hf, ours, _ in stacked if ours in name]
        for hf_name in merged or [name]:
            out[hf_name] = str(fmt)
    return out


def build_transformers_model(hf_config: dict[str, Any], dtype: torch.dtype,
                             fk_model: torch.nn.Module) -> Any:
    """A ``transformers`` causal LM of ``hf_config`` holding ``fk_model``'s weights."""
    import transformers

    if hf_config.get("num_local_experts"):
        raise ValueError("the transformers contender supports Llama-family (dense) shapes only")
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config.items()
                                                   if k not in ("torch_dtype", "dtype")})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = hf_state_dict(fk_model)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the transformers model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    # non-persistent buffers (the rotary inverse frequencies) are rebuilt on the CPU
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise ValueError(f"transformers model tensors left unset: {still_meta[:5]}")
    return model.eval()


def transformers_generate(model: Any) -> GenerateFn:
    """Greedy ``model.generate`` over equal-length prompts, EOS ignored."""

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    return generate


def llm_generate(llm: Any, loras: Sequence[Any] = ()) -> GenerateFn:
    """Greedy ``LLM.generate`` over prompts, EOS ignored; with ``loras`` (``LoRARequest``s)
    prompt ``i`` uses adapter ``i mod len(loras)``."""
    from forwardkit.engine.sampling_params import SamplingParams

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        # The timing runs repeat the same prompts: each must compute them, as the other
        # contenders do (shared prefixes are measured by ``--workload``).
        llm.reset_prefix_cache()
        per_prompt = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False,
                            lora_request=per_prompt)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate
