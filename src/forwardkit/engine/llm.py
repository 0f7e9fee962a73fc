"""``LLM``: offline generation on one engine (vLLM's ``vllm.LLM`` for the reference engine).

    llm = LLM("path/to/hf-checkpoint", max_num_seqs=8)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)

Each step the scheduler picks requests (chunked prefill under the token budget), the runner
executes them and the sampler draws one token per request whose prompt is complete. With
``data_parallel_size > 1`` every rank runs its own ``LLM`` on its own prompts; the ranks keep
stepping together (a rank without work runs dummy steps) until all are done. With
``tensor_parallel_size > 1`` the weights are split over TP ranks (``forwardkit.engine.tp``):
``LLM`` starts its own worker processes, or, under torchrun, every rank builds an ``LLM`` and
TP rank 0 of each replica drives the others.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from forwardkit.config.builder import build_engine_config, check_fits_machine
from forwardkit.config.engine import EngineConfig
from forwardkit.config.frozen import freeze, thawed_copy
from forwardkit.engine.block_manager import BlockManager
from forwardkit.engine.draft_model import DraftModelProposer
from forwardkit.engine.inputs import (
    ParsedPrompt,
    PromptsArg,
    TokenIdsArg,
    Tokenizer,
    build_requests,
    parse_prompts,
)
from forwardkit.engine.lora import (
    LoRAError,
    LoRAManager,
    LoRARequest,
    SlotWeights,
    pack_slot_weights,
)
from forwardkit.engine.metrics import EngineStats, Metric
from forwardkit.engine.outputs import RequestOutput
from forwardkit.engine.prompt_logprobs import plan_prompt_logprobs, record_prompt_logprobs
from forwardkit.engine.request import Request
from forwardkit.engine.result import build_output
from forwardkit.engine.sampler import Sampler
from forwardkit.engine.sampling_params import SamplingParams, as_params_list
from forwardkit.engine.scheduler import Scheduler
from forwardkit.engine.speculative import NgramProposer, SpecDecodeStats, check_runnable, verify
from forwardkit.engine.tokenizer import has_tokenizer_files, load_tokenizer
from forwardkit.engine.tp import (
    TPFollowerLink,
    TPWorkerPool,
    build_runner,
    prompts_digest,
    run_model_step,
    weight_bytes,
)
from forwardkit.engine.weight_update import (
    KVCacheSleeper,
    prepare_weight_update,
    update_model_weights,
)
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from forwardkit.config.compilation import CompilationConfig
    from forwardkit.distributed.parallel_state import RankGroup
    from forwardkit.platforms import Platform
    from forwardkit.runner.batch import StepBatch

__all__ = ["LLM"]

logger = init_logger(__name__)


def _check_llm_args(model: str | os.PathLike[str] | None, tokenizer: str | os.PathLike[str] | None,
                    skip_tokenizer_init: bool, trust_remote_code: bool,
                    max_logprobs: int) -> str | None:
    """Check the arguments that act on the ``LLM`` itself; returns the tokenizer directory."""
    for name, flag in (("skip_tokenizer_init", skip_tokenizer_init),
                       ("trust_remote_code", trust_remote_code)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r:.60}")
    if not isinstance(max_logprobs, int) or isinstance(max_logprobs, bool) or max_logprobs < -1:
        raise ValueError(f"max_logprobs must be an integer >= 0 or -1 (no cap), got "
                         f"{max_logprobs!r:.60}")
    tokenizer_dir = None
    if tokenizer is not None:
        if not isinstance(tokenizer, (str, os.PathLike)):
            raise ValueError(f"tokenizer must be a directory or None, got {tokenizer!r:.60}")
        tokenizer_dir = os.fspath(tokenizer)
        if not has_tokenizer_files(tokenizer_dir):
            raise ValueError(f"tokenizer={tokenizer_dir!r} is not a directory with tokenizer files "
                             "(tokenizer.json, tokenizer_config.json, ...); names on the Hub are "
                             "not downloaded")
    for directory in {os.fspath(d) for d in (model, tokenizer_dir) if d is not None}:
        for name in ("config.json", "tokenizer_config.json"):
            path = os.path.join(directory, name)
            if _has_auto_map(path):
                raise ValueError(
                    f"{path} names the checkpoint's own Python code (auto_map): forwardkit runs "
                    "only its built-in model and tokenizer code, with or without "
                    "trust_remote_code (which is accepted for checkpoints that need no code)")
    return tokenizer_dir


def _has_auto_map(path: str) -> bool:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False  # absent or unreadable: the loaders report it with their own context
    return isinstance(data, dict) and bool(data.get("auto_map"))


def _check_device(cfg: EngineConfig) -> None:
    """A CUDA config needs a CUDA device to run on (resolving one needs none)."""
    if cfg.platform.is_cuda_alike() and not torch.cuda.is_available():
        raise ValueError(f"platform {cfg.platform.name!r} needs a CUDA device, and this machine "
                         f"has none that torch {torch.__version__} can use; run on the CPU "
                         "(platform='cpu'), or inspect the CUDA config with forwardkit config "
                         "--platform cuda")


def _check_dp_launch(dp: int, launched: bool) -> None:
    """Data parallelism needs one process per DP rank, started together: refuse at once (not
    after the rendezvous times out) when this process was started by none of the launchers."""
    if dp > 1 and not launched and "FORWARDKIT_DP_SIZE" not in os.environ:
        raise ValueError(
            f"data_parallel_size={dp} needs one process per DP rank, and this process is a plain "
            f"one: launch {dp} processes with torchrun (torchrun --nproc-per-node {dp} "
            "script.py, each building its LLM), set FORWARDKIT_DP_SIZE / FORWARDKIT_DP_RANK / "
            "FORWARDKIT_DP_MASTER_PORT in each, or call forwardkit.distributed.init_distributed "
            "in each rank first (as forwardkit.distributed.launch.spawn does)")


class LLM:
    """An offline engine: model runner + KV blocks + scheduler + sampler (+ tokenizer).

    Args:
        model: local Hugging Face checkpoint directory; None = the built-in default model.
        dtype: "auto" (from config.json; on a CPU float32 for a model whose weights are all in
            quantized blocks, and for bf16 where bf16 products would be emulated), "float32",
            "bfloat16", "float16" or a torch dtype.
        max_num_seqs / max_num_batched_tokens: scheduler limits (defaults as ``forwardkit generate``).
        enforce_eager: no compilation and no CUDA graphs.
        compilation_config: a ``CompilationConfig``, a dict of its fields, or None.
        data_parallel_size: DP ranks; > 1 needs one ``LLM`` per rank (the DP group is created
            from the parallel config when not already initialised).
        tensor_parallel_size: TP ranks (``**kwargs``); > 1 splits the weights: this process
            starts ``N - 1`` worker processes, or under torchrun (``dp x tp`` processes) joins
            its replica's TP group. :meth:`shutdown` (or the process's exit) ends the workers.
        block_size: tokens per KV block.
        seed: seeds the sampling of every request without its own ``SamplingParams.seed``
            (the built-in model's random weights are always the same); None = a random seed.
        platform: "cpu", "cuda", a ``Platform`` or None (detected).
        engine_config: a ready ``EngineConfig`` (then the other config arguments must be left alone).
        tokenizer: a directory with the tokenizer to use instead of the model's.
        skip_tokenizer_init: no tokenizer (token-id prompts only, outputs without text).
        trust_remote_code: accepted for checkpoints that need no code of their own; one that
            ships code (``auto_map``) is refused either way.
        max_logprobs: most ``logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's
            default 20; -1 = no cap).
        **kwargs: every other vLLM engine argument, as the table in ``config/engine_args.py``
            (and the README) says: it acts, is an accepted no-op, or is refused by name; ``model_shape`` (a named real-architecture shape with seeded random weights,
            e.g. ``"llama-3.2-1b"``; see ``forwardkit.config.model_shapes``), ``max_model_len``,
            ``num_gpu_blocks``,
            ``enable_chunked_prefill``, ``optimization_level``, ``enable_expert_parallel`` ...).
    """

    # class-level defaults: readable before ``__init__`` sets them (``shutdown`` after a failed
    # start) and before the first ``sleep``
    _tp_pool: TPWorkerPool | None = None
    _sleeper: KVCacheSleeper | None = None

    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype = "auto",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = False,
        compilation_config: CompilationConfig | Mapping[str, object] | str | None = None,
        data_parallel_size: int = 1,
        block_size: int = 16,
        seed: int | None = 0,
        platform: str | Platform | None = None,
        engine_config: EngineConfig | None = None,
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        max_logprobs: int = 20,
        **kwargs: Any,
    ) -> None:
        if seed is None:  # unseeded: a fresh engine seed
            seed = int(torch.randint(0, 2**62, (1,)))
        if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None, got "
                             f"{seed!r:.60} ({type(seed).__name__})")
        tokenizer_dir = _check_llm_args(model, tokenizer, skip_tokenizer_init, trust_remote_code,
                                        max_logprobs)
        if engine_config is None:
            engine_config = build_engine_config(
                model, dtype=dtype, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager,
                compilation_config=compilation_config, data_parallel_size=data_parallel_size,
                block_size=block_size, platform=platform, **kwargs,
            )
        elif kwargs:
            raise TypeError(f"LLM(engine_config=...) takes no extra config arguments, got {sorted(kwargs)}")
        _check_device(engine_config)
        check_fits_machine(engine_config)  # before any buffer is allocated
        self._tp_pool = None
        self._tp_link: TPFollowerLink | None = None
        self._dp_group, cfg = self._init_parallel(engine_config)
        self.engine_config = cfg
        self.seed = seed
        try:
            self.runner = build_runner(cfg)
            if self._tp_pool is not None:
                self._tp_pool.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.model_config = self.runner.model_config
        self.max_logprobs = max_logprobs
        self.tokenizer: Tokenizer | None = None
        if not skip_tokenizer_init:
            self.tokenizer = load_tokenizer(tokenizer_dir or self.model_config.model)
        self.eos_token_id = self._eos_token_id()
        cache = cfg.cache_config
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.runner.block_size,
            enable_prefix_caching=cache.enable_prefix_caching,
            hash_algo=cache.prefix_caching_hash_algo,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=cfg.scheduler_config.max_num_seqs,
            max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
            enable_chunked_prefill=cfg.scheduler_config.enable_chunked_prefill,
            max_model_len=self.runner.max_model_len,
            # micro-batches of one step do not see each other's KV writes
            allow_pending_hits=not cfg.parallel_config.use_ubatching,
            max_loras=None if cfg.lora_config is None else cfg.lora_config.max_loras,
        )
        self.lora = self._init_lora(cfg)
        self.stats = EngineStats()
        spec = cfg.speculative_config
        check_runnable(spec, cfg.parallel_config.tensor_parallel_size)
        self._proposer: NgramProposer | DraftModelProposer | None = None
        if spec is not None and spec.method == "draft_model":
            try:  # draft_tensor_parallel_size > 1: sharded over this LLM's TP workers
                self._proposer = DraftModelProposer(spec, cfg, self.runner.num_blocks,
                                                    self.runner.max_model_len, self._tp_pool)
            except BaseException:
                self.shutdown()
                raise
        elif spec is not None:
            self._proposer = NgramProposer(spec, self.runner.max_model_len)
        self.spec_stats = SpecDecodeStats()
        self.sampler = Sampler()
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._next_id = 0

    def _init_lora(self, cfg: EngineConfig) -> LoRAManager | None:
        """The adapter manager over the runner's slots (None without ``enable_lora``)."""
        if cfg.lora_config is None:
            return None
        if self._tp_link is not None:
            raise ValueError("enable_lora=True with tensor_parallel_size > 1 under torchrun is "
                             "not supported (LLM's own TP workers are: run without torchrun)")
        if cfg.parallel_config.use_ubatching:
            raise ValueError("enable_lora=True with micro-batching (enable_dbo) is not "
                             "supported (each micro-batch would need its own token slots)")
        manager = LoRAManager(cfg.lora_config, self.runner.module, self.runner.lora_slots)
        pool = self._tp_pool
        if pool is not None:  # the TP workers fill their slots from the same full tensors

            def write_on_workers(slot: int, weights: SlotWeights | None) -> None:
                pool.call("lora_slot", (slot, pack_slot_weights(weights)))

            manager.on_slot_write = write_on_workers
        return manager

    def _require_lora(self, what: str) -> LoRAManager:
        if self.lora is None:
            raise ValueError(f"{what} needs LLM(enable_lora=True)")
        return self.lora

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and register a PEFT adapter (``lora_request.lora_path``); False when it is
        registered already. ``LoRAError`` names the file and field of a bad adapter."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"add_lora takes a LoRARequest, got {type(lora_request).__name__}")
        return self._require_lora("add_lora").add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` (``ValueError`` naming it when unknown)."""
        return self._require_lora("remove_lora").remove(lora_id)

    def list_loras(self) -> set[int]:
        """The registered adapters' ids."""
        return self._require_lora("list_loras").registered_ids()

    def update_lora(self, name: str, tensors: Mapping[str, torch.Tensor],
                    config: Mapping[str, object] | None = None) -> LoRARequest:
        """Load adapter ``name`` from tensors in memory (for RL: no disk round trip).

        ``tensors``: a PEFT-named state dict, as ``peft.get_peft_model_state_dict`` returns
        it (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``). ``config``: the
        adapter's ``adapter_config`` fields (``lora_alpha``, ``use_rslora``; ``r`` is read from
        the tensors when absent); needed for a new name, else the adapter's own are kept. All
        or nothing: a bad tensor raises ``LoRAError`` and the old adapter keeps serving.
        Cached prefixes computed with the old weights are not reused (the update is part of
        the blocks' hash). Returns the ``LoRARequest`` to generate with.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"update_lora: name must be a non-empty string, got {name!r:.60}")
        if not isinstance(tensors, Mapping):
            raise ValueError(f"update_lora({name!r}): tensors must be a mapping of PEFT names "
                             f"to tensors, got {type(tensors).__name__}")
        return self._require_lora("update_lora").update(name, tensors, config)

    def _lora_requests(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                       num_prompts: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, every one checked and loaded (all or nothing)."""
        if lora_request is None:
            return [None] * num_prompts
        manager = self._require_lora("generate(lora_request=...)")
        if isinstance(lora_request, LoRARequest):
            per_prompt: list[LoRARequest | None] = [lora_request] * num_prompts
        elif isinstance(lora_request, Sequence) and not isinstance(lora_request, str):
            per_prompt = list(lora_request)
            if len(per_prompt) != num_prompts:
                raise ValueError(f"lora_request has {len(per_prompt)} entries for {num_prompts} "
                                 "prompts; give one LoRARequest or one per prompt")
        else:
            raise ValueError(f"lora_request must be a LoRARequest, a list of them or None, got "
                             f"{type(lora_request).__name__}")
        new: dict[int, LoRARequest] = {}
        for i, r in enumerate(per_prompt):
            if r is None:
                continue
            if not isinstance(r, LoRARequest):
                raise ValueError(f"prompt {i}: lora_request is a {type(r).__name__}, not a "
                                 "LoRARequest")
            manager.check_request(r)
            if r.lora_int_id not in manager.requests:
                seen = new.setdefault(r.lora_int_id, r)
                if seen != r:
                    raise ValueError(f"prompt {i}: lora_int_id={r.lora_int_id} names two "
                                     f"adapters ({seen.lora_name!r}, {r.lora_name!r})")
        for r in new.values():
            if not r.lora_path:
                raise LoRAError(f"LoRARequest {r.lora_name!r} is not registered and has no "
                                "lora_path")
        adapters = [manager.adapter_from_dir(r) for r in new.values()]  # every one checked ...
        for adapter in adapters:  # ... before any is registered
            manager.register(adapter)
        return per_prompt

    @classmethod
    def from_engine_config(cls, engine_config: EngineConfig, seed: int = 0,
                           tokenizer: str | os.PathLike[str] | None = None) -> LLM:
        """An ``LLM`` over an already resolved config (used by ``forwardkit generate``);
        ``tokenizer``: a directory with the tokenizer to use instead of the model's."""
        return cls(engine_config=engine_config, seed=seed, tokenizer=tokenizer)

    def _init_parallel(self, cfg: EngineConfig) -> tuple[RankGroup | None, EngineConfig]:
        """Join (or start) the DP and TP ranks; returns (the DP group or None, the engine
        config with this process's DP rank)."""
        parallel = cfg.parallel_config
        tp, dp = parallel.tensor_parallel_size, parallel.data_parallel_size
        if tp == 1 and dp == 1:
            return None, cfg
        from forwardkit.distributed import (
            get_dp_group,
            get_tp_group,
            init_distributed,
            is_dp_group_initialized,
        )

        launched = all(v in os.environ for v in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"))
        if tp > 1 and not is_dp_group_initialized() and not launched:
            if dp > 1:
                raise ValueError(
                    f"tensor_parallel_size={tp} with data_parallel_size={dp} needs one process "
                    f"per rank: launch {dp * tp} processes with torchrun (LLM starts its own "
                    "TP workers only for data_parallel_size=1)")
            self._tp_pool = TPWorkerPool(cfg)
            weakref.finalize(self, self._tp_pool.close)
            return None, cfg
        if not is_dp_group_initialized():
            _check_dp_launch(dp, launched)
            init_distributed(parallel)
        group = get_dp_group()
        if group.world_size != dp:
            raise ValueError(
                f"data_parallel_size={dp} but the DP group has {group.world_size} ranks"
            )
        if get_tp_group().world_size != tp:
            raise ValueError(f"tensor_parallel_size={tp} but the TP group has "
                             f"{get_tp_group().world_size} ranks")
        if tp > 1:
            self._tp_link = TPFollowerLink(get_tp_group())
        if group.rank != parallel.data_parallel_rank:
            # The config is read-only: a copy with the group's rank. The rank is no input of
            # resolution, so the copy is not resolved again (everything else stays identical).
            ranked = thawed_copy(cfg)
            ranked.parallel_config.data_parallel_rank = group.rank
            freeze(ranked)
            cfg = ranked
        return (group if dp > 1 else None), cfg

    def weight_bytes_per_rank(self) -> list[int]:
        """Bytes of model weights each rank of this replica holds, TP rank order (one entry
        without TP; under torchrun, each rank's own entry is its own, the others' are
        gathered)."""
        mine = weight_bytes(self.runner.module)
        if self._tp_pool is not None:
            return [mine, *self._tp_pool.call("weight_bytes", None)]
        if self._tp_link is not None:
            counts = self._tp_link.group.all_gather(torch.tensor([mine], dtype=torch.int64),
                                                    use_cpu=True)
            return [int(c) for c in counts.flatten().tolist()]
        return [mine]

    @property
    def is_tp_driver(self) -> bool:
        """Whether this process is TP rank 0 of its replica (always True without TP): under
        torchrun every TP rank's ``generate`` returns the same outputs, and only the driver
        needs to report them."""
        return self._tp_link is None or self._tp_link.is_driver

    def shutdown(self) -> None:
        """End the TP worker processes this ``LLM`` started (if any) and leave their groups.
        The engine cannot generate afterwards. Also runs when the ``LLM`` is collected."""
        pool, self._tp_pool = self._tp_pool, None
        if pool is not None:
            pool.close()

    def _eos_token_id(self) -> int | list[int] | None:
        hf = self.model_config.hf_config
        eos: int | list[int] | None = hf.get("eos_token_id")  # config.json: an id or a list
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return eos

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer (the checkpoint's, or the ``tokenizer`` argument's); ``ValueError``
        when there is none (the model ships none, or ``skip_tokenizer_init=True``)."""
        if self.tokenizer is None:
            raise ValueError(f"this LLM has no tokenizer (model {self.model_config.model or '<built-in>'!r} "
                             "ships none, or skip_tokenizer_init=True); pass tokenizer=DIR")
        return self.tokenizer

    def _check_logprobs(self, params: list[SamplingParams]) -> None:
        """vLLM's ``max_logprobs`` cap (-1 = the vocabulary size) on every request."""
        cap = self.runner.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        for i, p in enumerate(params):
            for name in ("logprobs", "prompt_logprobs"):
                asked = getattr(p, name)
                if asked is None:
                    continue
                count = self.runner.vocab_size if asked == -1 else asked
                if count > cap:
                    raise ValueError(f"prompt {i}: SamplingParams.{name}={asked} asks for {count} "
                                     f"logprobs, more than max_logprobs={self.max_logprobs} "
                                     "(LLM(max_logprobs=...) raises the cap; -1 = no cap)")

    # ------------------------------------------------------------------ requests
    def _generator(self, params: SamplingParams) -> torch.Generator:
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return torch.Generator(device=self.runner.device).manual_seed(seed)

    def _decoder(self, params: SamplingParams) -> Callable[[list[int]], str] | None:
        """Output ids -> text for stop-string checks (None when ``params`` has no stop strings)."""
        if not params.stop:
            return None
        tokenizer, skip = self.tokenizer, params.skip_special_tokens
        assert tokenizer is not None  # generate() refuses stop strings without one
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: PromptsArg = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: TokenIdsArg = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions; returns one ``RequestOutput`` per prompt, in prompt order.

        ``lora_request``: the adapter of every prompt, or a list with one per prompt (None:
        the base model); needs ``enable_lora=True``. Adapters not registered yet are loaded.

        ``prompts``: a string, a list of strings, or dicts with ``prompt_token_ids`` (or
        ``prompt``); ``prompt_token_ids``: one list of ids or a list of them. Text and stop
        strings need the checkpoint's tokenizer. Every input is checked before anything runs
        (nor are request ids or the engine's seeded generator consumed by a rejected call): a
        prompt that can never fit (longer than ``max_model_len`` or the whole KV cache) raises
        ``ValueError`` naming it. With DP > 1 every rank must call ``generate`` (an empty list
        is fine).
        """
        if self.is_sleeping():
            raise RuntimeError("the LLM is asleep (its KV cache is released); call wake_up() first")
        if isinstance(prompts, (list, tuple)) and len(prompts) == 0 and prompt_token_ids is None:
            pairs: list[ParsedPrompt] = []
        else:
            pairs = parse_prompts(prompts, prompt_token_ids, self.tokenizer, self.runner.vocab_size,
                                  self.model_config.model)
        params = as_params_list(sampling_params, len(pairs))
        self._check_logprobs(params)
        if self.tokenizer is None:
            for i, p in enumerate(params):
                if p.stop:
                    raise ValueError(f"prompt {i}: SamplingParams.stop={p.stop!r} needs the model's "
                                     "tokenizer, and this model ships none; use stop_token_ids")
        if self._tp_link is not None and self._tp_link_agrees(pairs, params):
            return self._follow()
        loras = self._lora_requests(lora_request, len(pairs))
        groups = build_requests(pairs, params, self._next_id, self.eos_token_id,
                                self.runner.max_model_len, self._decoder)
        requests = [r for _, children in groups for r in children]
        for (_, children), lr in zip(groups, loras):
            if lr is not None and self.lora is not None:
                for req in children:
                    req.lora_int_id = lr.lora_int_id
                    req.lora_cache_key = self.lora.cache_key(lr.lora_int_id)
        for req in requests:
            self.scheduler.check_fits(req)
        # Everything is valid: now commit ids, draw seeds and queue.
        self._next_id += len(groups)
        for req in requests:
            req.generator = self._generator(req.sampling_params)
        self.scheduler.queue_all(requests)  # each was checked once, above
        self.stats.record_added(requests)
        self._run(len(requests), use_tqdm)
        outputs = [build_output(rid, children, self.tokenizer) for rid, children in groups]
        if self._tp_link is not None:
            self._tp_link.send(("done", outputs))
        return outputs

    # ------------------------------------------------------------------ chat
    def chat(
        self,
        messages: Sequence[Mapping[str, object]] | Sequence[Sequence[Mapping[str, object]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, object] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to chat conversations (vLLM's ``LLM.chat``).

        ``messages``: one conversation (a list of ``{"role", "content"}`` dicts) or a list of
        them. Each is rendered with the tokenizer's chat template (or ``chat_template``), the
        text tokenized without adding special tokens (the template writes them), then generated
        as :meth:`generate` does; one ``RequestOutput`` per conversation, in order.
        ``chat_template_kwargs`` go to the template (e.g. ``{"enable_thinking": False}``);
        ``lora_request`` as for :meth:`generate` (one per conversation, or one for all).
        """
        from forwardkit.engine.chat import ChatTokenizer, render_chats

        tokenizer = cast(ChatTokenizer, self.get_tokenizer())
        ids = render_chats(tokenizer, messages, chat_template, add_generation_prompt,
                           continue_final_message, chat_template_kwargs)
        return self.generate([{"prompt_token_ids": p} for p in ids], sampling_params,
                             use_tqdm=use_tqdm, lora_request=lora_request)

    def _tp_link_agrees(self, pairs: list[ParsedPrompt],
                        params: list[SamplingParams]) -> bool:
        """torchrun TP: check that every TP rank of the replica was given the same inputs;
        True on a follower (which then follows the driver's steps)."""
        link = self._tp_link
        assert link is not None
        digest = prompts_digest(pairs, params)
        if link.is_driver:
            link.send(("generate", digest))
            mismatch = False
        else:
            mismatch = link.recv() != ("generate", digest)
        if link.agree(mismatch):
            raise ValueError("generate() was called with different prompts or sampling params "
                             "on the TP ranks of one data-parallel replica; under torchrun every "
                             "TP rank must pass the same ones")
        return not link.is_driver

    def _follow(self) -> list[RequestOutput]:
        """A TP follower's ``generate``: run the driver's steps, return the driver's outputs."""
        link = self._tp_link
        assert link is not None
        while True:
            msg = link.recv()
            if msg[0] == "step":
                run_model_step(self.runner, msg[1], msg[2])
            elif msg[0] == "done":
                outputs: list[RequestOutput] = msg[1]
                return outputs
            else:
                raise RuntimeError(f"the TP driver (rank 0 of this replica) stopped generate: "
                                   f"{msg[1]}")

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
        except BaseException as exc:
            self.scheduler.abort_all()
            if self._tp_link is not None and not isinstance(exc, RuntimeError):
                with contextlib.suppress(Exception):  # followers end their generate too
                    self._tp_link.send(("abort", f"{type(exc).__name__}: {exc}"))
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
        self._propose_drafts()
        out = self.scheduler.schedule()
        if out.is_empty and self.scheduler.has_unfinished:
            raise RuntimeError(f"scheduler could not schedule any of {len(self.scheduler.waiting)} "
                               "waiting requests (KV cache too small?)")
        batch = out.to_batch()
        if self.lora is not None and any(r.lora_int_id for r in out.requests):
            batch.lora_slots = self.lora.activate([r.lora_int_id for r in out.requests])
        plan = plan_prompt_logprobs(out.requests, out.num_scheduled_tokens)
        # hidden-state rows scored by the LM head besides each request's last token: the
        # prompt-logprob rows, then each draft-carrying request's rows before its last
        rows = list(plan.rows) if plan is not None else []
        spec_rows: dict[str, list[int]] = {}
        offset = 0
        for req, n in zip(out.requests, out.num_scheduled_tokens):
            if req.spec_token_ids:
                last = offset + n - 1
                spec_rows[req.request_id] = list(range(len(rows), len(rows) + len(req.spec_token_ids)))
                rows += range(last - len(req.spec_token_ids), last)
            offset += n
        extra_rows = rows or None
        if self._tp_pool is not None:
            self._tp_pool.send_step(batch, extra_rows)
        elif self._tp_link is not None:
            self._tp_link.send(("step", batch, extra_rows))
        self.runner.keep_hidden = extra_rows is not None
        logits = self._execute(batch)
        extra = None
        hidden, self.runner.last_hidden = self.runner.last_hidden, None
        if extra_rows is not None and hidden is not None:
            index = torch.tensor(extra_rows, dtype=torch.long, device=hidden.device)
            extra = self.runner.model.compute_logits(hidden.index_select(0, index))
            if plan is not None:
                record_prompt_logprobs(extra[: len(plan.rows)], plan)
        chosen = [r for r, s in zip(out.requests, batch.sample or ()) if s]
        plain = [i for i, r in enumerate(chosen) if r.request_id not in spec_rows]
        sampled: dict[str, int | list[int]] = {}
        by_id: dict[str, Any] = {}
        if len(plain) == len(chosen):
            tokens, logprobs = self.sampler.sample(logits, chosen)
        else:
            tokens, logprobs = self.sampler.sample(logits[plain], [chosen[i] for i in plain])
        for j, i in enumerate(plain):
            sampled[chosen[i].request_id] = tokens[j]
            if logprobs is not None and logprobs[j] is not None:
                by_id[chosen[i].request_id] = logprobs[j]
        for i, req in enumerate(chosen):
            own = spec_rows.get(req.request_id)
            if own is None:
                continue
            assert extra is not None
            drafts = req.spec_token_ids
            assert self._proposer is not None
            emitted, lps = verify(self.sampler, torch.cat([extra[own], logits[i: i + 1]]), req,
                                  drafts, self._proposer.draft_probs(req))
            self.spec_stats.record(len(drafts), len(emitted) - 1)
            sampled[req.request_id] = emitted
            if lps is not None:
                by_id[req.request_id] = lps
        self.stats.record_step(out.requests, out.num_scheduled_tokens, len(out.preempted),
                               sum(1 if isinstance(t, int) else len(t) for t in sampled.values()))
        finished = self.scheduler.update(out, sampled, by_id or None)
        self.stats.record_finished(finished)
        return finished

    def _propose_drafts(self) -> None:
        """Draft tokens for every running request that is decoding (speculative decoding)."""
        proposer = self._proposer
        if proposer is None:
            return
        running = self.scheduler.running
        limit = proposer.disable_by_batch_size
        if limit is not None and len(running) + len(self.scheduler.waiting) > limit:
            return
        decoding = [r for r in running if r.num_pending_tokens == 1 and r.output_token_ids]
        proposer.propose_all(running, decoding)

    # ------------------------------------------------------------------ prefix cache, metrics
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (as vLLM's ``reset_prefix_cache``); returns False,
        with a warning, while a request holds blocks. ``update_weights``, ``sleep`` and
        ``wake_up`` already do it, so an RL loop never decodes new weights on stale KV."""
        if self.block_manager.reset_prefix_cache():
            return True
        logger.warning("reset_prefix_cache: %d KV blocks are held by running requests; "
                       "nothing was reset", self.block_manager.num_blocks
                       - self.block_manager.num_free_blocks)
        return False

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges (vLLM's names: ``vllm:prefix_cache_queries`` /
        ``vllm:prefix_cache_hits`` in tokens, ``vllm:prompt_tokens``, ...; ``forwardkit:``
        ones where vLLM has none, e.g. ``forwardkit:prompt_tokens_computed``, and
        ``forwardkit:native_kernel_calls`` per native CPU kernel: the calls it served in this
        process, the evidence that the kernel and not its PyTorch fallback ran)."""
        sched = self.scheduler
        from forwardkit.kernels.cpu.native_build import kernel_calls

        return self.stats.metrics(self.block_manager, len(sched.running), len(sched.waiting),
                                  self.spec_stats if self._proposer is not None else None,
                                  kernel_calls.snapshot())

    def _execute(self, batch: StepBatch) -> torch.Tensor:
        """The runner's step; a collective failure names what the TP workers reported."""
        try:
            return self.runner.execute(batch)
        except Exception as exc:
            note = self._tp_pool.failure_note() if self._tp_pool is not None else ""
            if note:
                raise RuntimeError(f"{type(exc).__name__}: {exc} [{note}]") from exc
            raise

    # ------------------------------------------------------------------ RL: weights, sleep
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> dict[str, int | float]:
        """Copy new weights into the running model in place (no recompilation, no re-capture).

        ``named_tensors``: ``(hf_name, tensor)`` pairs (or a dict) in Hugging Face naming, a full
        or partial set, any real dtype (cast on copy). All or nothing: unknown names and wrong
        shapes raise ``WeightLoadError`` before any parameter changes. Refused (``ValueError``)
        when Inductor freezing would keep the old weights in compiled code. Returns
        ``{"num_tensors", "num_parameters", "seconds"}``.
        """
        if self._tp_pool is not None:  # every check first, then the workers, then here
            named_tensors = prepare_weight_update(self.engine_config, self.runner.module,
                                                  named_tensors)
            self._tp_pool.update_weights(named_tensors)
        result = update_model_weights(self.engine_config, self.runner.module, named_tensors)
        self.block_manager.invalidate()  # cached KV was computed with the old weights
        return result

    def sleep(self, level: int = 1) -> int:
        """Release the KV cache's memory (level 1; the weights stay); returns the bytes freed.

        ``generate`` is refused until ``wake_up``. Level 2 (also discarding weights) is not
        supported by the reference engine. A draft model's KV cache (``method="draft_model"``,
        on every TP rank it is split over) is released with the target's and its requests'
        draft KV forgotten; ``wake_up`` gives it back zeroed.
        """
        freed = self._kv_sleeper().sleep(level)
        self.block_manager.invalidate()  # the cache's content is gone
        if isinstance(self._proposer, DraftModelProposer):  # the draft's KV cache too
            freed += self._proposer.sleep(level)
        if self._tp_pool is not None:
            freed += sum(self._tp_pool.call("sleep", level))
        return freed

    def wake_up(self, tags: list[str] | None = None) -> int:
        """Re-allocate the KV cache released by ``sleep``; returns the bytes allocated."""
        allocated = self._kv_sleeper().wake_up(tags)
        self.block_manager.invalidate()  # the cache comes back zeroed
        if isinstance(self._proposer, DraftModelProposer):
            allocated += self._proposer.wake_up(tags)
        if self._tp_pool is not None:
            allocated += sum(self._tp_pool.call("wake_up", tags))
        return allocated

    def is_sleeping(self) -> bool:
        """Whether ``sleep`` released the KV cache."""
        sleeper = self._sleeper
        return sleeper is not None and sleeper.asleep

    def _kv_sleeper(self) -> KVCacheSleeper:
        if self._sleeper is None:
            self._sleeper = KVCacheSleeper(self.runner)
        return self._sleeper
