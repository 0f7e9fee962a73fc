"""``LLM``: offline generation on one engine (vLLM's ``vllm.LLM`` for the reference engine).

    llm = LLM("path/to/hf-checkpoint", max_num_seqs=8)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)

Each step the scheduler picks requests (chunked prefill under the token budget), the runner
executes them and the sampler draws one token per request whose prompt is complete. With
``data_parallel_size > 1`` every rank runs its own ``LLM`` on its own prompts; the ranks keep
stepping together (a rank without work runs dummy steps) until all are done.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from forwardkit.config.builder import build_engine_config
from forwardkit.config.engine import EngineConfig
from forwardkit.engine.block_manager import BlockManager
from forwardkit.engine.outputs import CompletionOutput, RequestOutput
from forwardkit.engine.request import Request
from forwardkit.engine.sampler import Sampler
from forwardkit.engine.sampling_params import SamplingParams, as_params_list
from forwardkit.engine.scheduler import Scheduler
from forwardkit.engine.tokenizer import load_tokenizer
from forwardkit.logger import init_logger
from forwardkit.models.default import default_hf_config
from forwardkit.runner.model_runner import ModelRunner

__all__ = ["LLM"]

logger = init_logger(__name__)

PromptInput = str | dict[str, Any] | Sequence[int]


class LLM:
    """An offline engine: model runner + KV blocks + scheduler + sampler (+ tokenizer).

    Args:
        model: local Hugging Face checkpoint directory; None = the built-in default model.
        dtype: "auto" (from config.json), "float32", "bfloat16", "float16" or a torch dtype.
        max_num_seqs / max_num_batched_tokens: scheduler limits (defaults as ``forwardkit generate``).
        enforce_eager: no compilation and no CUDA graphs.
        compilation_config: a ``CompilationConfig``, a dict of its fields, or None.
        data_parallel_size: DP ranks; > 1 needs one ``LLM`` per rank (the DP group is created
            from the parallel config when not already initialised).
        block_size: tokens per KV block.
        seed: seeds the sampling of every request without its own ``SamplingParams.seed``
            (the built-in model's random weights are always the same).
        platform: "cpu", "cuda", a ``Platform`` or None (detected).
        engine_config: a ready ``EngineConfig`` (then the other config arguments must be left alone).
        **kwargs: more config fields (``max_model_len``, ``num_gpu_blocks``,
            ``enable_chunked_prefill``, ``optimization_level``, ``enable_expert_parallel`` ...).
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype = "auto",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = False,
        compilation_config: Any = None,
        data_parallel_size: int = 1,
        block_size: int = 16,
        seed: int = 0,
        platform: Any = None,
        engine_config: EngineConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {seed!r:.60} "
                             f"({type(seed).__name__})")
        if engine_config is None:
            engine_config = build_engine_config(
                model, default_hf_config=default_hf_config(), dtype=dtype, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager,
                compilation_config=compilation_config, data_parallel_size=data_parallel_size,
                block_size=block_size, platform=platform, **kwargs,
            )
        elif kwargs:
            raise TypeError(f"LLM(engine_config=...) takes no extra config arguments, got {sorted(kwargs)}")
        self.engine_config = cfg = engine_config
        self.seed = seed
        self._dp_group = self._init_dp(cfg)
        from forwardkit.platforms import use_platform

        with use_platform(cfg.platform):
            self.runner = ModelRunner(cfg)
            self.runner.warm_up_compile_ranges()
            self.runner.warm_up_compile_sizes()
            self.runner.capture_model()
        model_config = cfg.model_config
        self.tokenizer = load_tokenizer(model_config.model if model_config else None)
        self.eos_token_id = self._eos_token_id()
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=cfg.scheduler_config.max_num_seqs,
            max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
            enable_chunked_prefill=cfg.scheduler_config.enable_chunked_prefill,
            max_model_len=self.runner.max_model_len,
        )
        self.sampler = Sampler()
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()

    @classmethod
    def from_engine_config(cls, engine_config: EngineConfig, seed: int = 0) -> LLM:
        """An ``LLM`` over an already resolved config (used by ``forwardkit generate``)."""
        return cls(engine_config=engine_config, seed=seed)

    @staticmethod
    def _init_dp(cfg: EngineConfig) -> Any:
        parallel = cfg.parallel_config
        if parallel.data_parallel_size <= 1:
            return None
        from forwardkit.distributed import get_dp_group, init_dp_group, is_dp_group_initialized

        group = get_dp_group() if is_dp_group_initialized() else init_dp_group(parallel)
        if group.world_size != parallel.data_parallel_size:
            raise ValueError(
                f"data_parallel_size={parallel.data_parallel_size} but the DP group has "
                f"{group.world_size} ranks"
            )
        parallel.data_parallel_rank = group.rank
        return group

    def _eos_token_id(self) -> Any:
        hf = self.engine_config.model_config.hf_config if self.engine_config.model_config else {}
        eos = hf.get("eos_token_id")
        if eos is None and self.tokenizer is not None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        return eos

    def get_tokenizer(self) -> Any:
        """The checkpoint's tokenizer, or None when it ships none."""
        return self.tokenizer

    # ------------------------------------------------------------------ requests
    def _prompt_list(self, prompts: Any, prompt_token_ids: Any) -> list[tuple[str | None, list[int]]]:
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("pass either prompts or prompt_token_ids, not both")
        items: list[PromptInput]
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            items = [ids] if ids and isinstance(ids[0], int) else ids
        elif prompts is None:
            raise ValueError("generate() needs prompts (text or {'prompt_token_ids': [...]}) "
                             "or prompt_token_ids")
        elif isinstance(prompts, (str, dict)):
            items = [prompts]
        else:
            items = list(prompts)
        return [self._one_prompt(i, item) for i, item in enumerate(items)]

    def _one_prompt(self, index: int, item: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(item, dict):
            if "prompt_token_ids" in item:
                return item.get("prompt"), self._check_ids(index, item["prompt_token_ids"])
            if "prompt" in item:
                item = item["prompt"]
            else:
                raise ValueError(f"prompt {index}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(item, (str, list, tuple)):
            raise ValueError(
                f"prompt {index} is {type(item).__name__} {item!r}; expected text, a list of token "
                "ids, or a dict with 'prompt_token_ids' (token ids go in prompt_token_ids=[[...]])"
            )
        if isinstance(item, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt {index} is text but the model ships no tokenizer "
                    f"(model={self.engine_config.model_config.model!r}); pass prompt_token_ids"
                )
            return item, list(self.tokenizer.encode(item))
        return None, self._check_ids(index, item)

    def _check_ids(self, index: int, ids: Any) -> list[int]:
        ids = list(ids)
        vocab = self.runner.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt {index}: token id {t!r} is not an integer in [0, {vocab})")
        return ids

    def _generator(self, params: SamplingParams) -> torch.Generator:
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return torch.Generator(device=self.runner.device).manual_seed(seed)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Any = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Any = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions; returns one ``RequestOutput`` per prompt, in prompt order.

        ``prompts``: a string, a list of strings, or dicts with ``prompt_token_ids`` (or
        ``prompt``); ``prompt_token_ids``: one list of ids or a list of them. Text needs the
        checkpoint's tokenizer. Every prompt is checked before any runs: one that can never
        fit (longer than ``max_model_len`` or the whole KV cache) raises ``ValueError`` naming it.
        With DP > 1 every rank must call ``generate`` (an empty list is fine).
        """
        if prompts is not None and not isinstance(prompts, (str, dict)) and len(prompts) == 0:
            pairs: list[tuple[str | None, list[int]]] = []
        else:
            pairs = self._prompt_list(prompts, prompt_token_ids)
        params = as_params_list(sampling_params, len(pairs))
        requests = []
        for (text, ids), p in zip(pairs, params):
            rid = str(next(self._ids))
            req = Request(rid, ids, p, prompt=text, eos_token_id=self.eos_token_id,
                          max_model_len=self.runner.max_model_len, generator=self._generator(p))
            requests.append(req)
        self.scheduler.add_all(requests)
        self._run(len(requests), use_tqdm)
        return [self._output(r) for r in requests]

    def _run(self, total: int, use_tqdm: bool) -> None:
        bar = None
        if use_tqdm and total:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        try:
            while self._any_rank_busy():
                finished = self.step()
                if bar is not None and finished:
                    bar.update(len(finished))
        except BaseException:
            self.scheduler.abort_all()
            raise
        finally:
            if bar is not None:
                bar.close()

    def _any_rank_busy(self) -> bool:
        busy = self.scheduler.has_unfinished
        if self._dp_group is None:
            return busy
        flag = torch.tensor([1 if busy else 0], dtype=torch.int32)
        self._dp_group.all_reduce(flag, use_cpu=True)
        return bool(flag.item())

    def step(self) -> list[Request]:
        """Run one engine step (a dummy one on an idle DP rank); returns finished requests."""
        out = self.scheduler.schedule()
        if out.is_empty and self.scheduler.has_unfinished:
            raise RuntimeError(f"scheduler could not schedule any of {len(self.scheduler.waiting)} "
                               "waiting requests (KV cache too small?)")
        batch = out.to_batch()
        logits = self.runner.execute(batch)
        chosen = [r for r, s in zip(out.requests, batch.sample or ()) if s]
        tokens = self.sampler(logits, chosen)
        return self.scheduler.update(out, {r.request_id: t for r, t in zip(chosen, tokens)})

    def _output(self, req: Request) -> RequestOutput:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(
                req.output_token_ids, skip_special_tokens=req.sampling_params.skip_special_tokens
            )
        completion = CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason,
                                      req.stop_reason)
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [completion],
                             finished=req.is_finished)
