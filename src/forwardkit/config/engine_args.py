"""What becomes of each vLLM engine argument here: one row per ``EngineArgs`` field of vLLM
0.14.0 (the keywords ``vllm.LLM(...)`` takes), plus forwardkit's own arguments.

Each row says whether the argument **acts** (changes what runs), is **accepted** as a
documented no-op (honest on this layer: ``gpu_memory_utilization`` on the CPU), or is
**refused** with a short message naming it and saying why. A refused argument is still
accepted at the values that change nothing (vLLM's default, e.g. ``pipeline_parallel_size=1``),
so code written for vLLM runs unchanged as long as it asks for nothing missing here.

:func:`screen_engine_args` applies the table to the keywords of ``LLM(...)`` /
``build_engine_config(...)``; :func:`markdown_table` renders it for the README (a test keeps
the README's copy and the code in step, and fails when an argument the engine takes has no row).
Adding an argument that acts is one row here (config fields are routed by name).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from forwardkit.config.utils import short_repr

__all__ = ["ENGINE_ARGS", "LLM_LEVEL_ARGS", "EngineArg", "markdown_table", "screen_engine_args"]

Kind = Literal["acts", "accepted", "refused"]


@dataclass(frozen=True)
class EngineArg:
    """One argument: its fate here, what it does or why it is refused."""

    name: str
    kind: Kind
    note: str
    # refused: the values accepted anyway (they change nothing); acts / accepted: None = any
    # value (checked where it is used), else the only values accepted (others refused, ``note``)
    allowed: tuple[object, ...] | None = None
    vllm: bool = True  # an EngineArgs field of vLLM 0.14.0 (False: forwardkit's own)
    rename: str | None = None  # the build_engine_config argument it becomes

    def accepts(self, value: object) -> bool:
        """Whether ``value`` passes (refused rows: only the values that change nothing)."""
        if self.allowed is None:
            return self.kind != "refused"
        return any(value is a or (type(value) is type(a) and value == a) for a in self.allowed)


def _acts(name: str, note: str, allowed: tuple[object, ...] | None = None, *,
          rename: str | None = None, vllm: bool = True) -> EngineArg:
    return EngineArg(name, "acts", note, allowed, vllm, rename)


def _noop(name: str, note: str, allowed: tuple[object, ...] | None = None) -> EngineArg:
    return EngineArg(name, "accepted", note, allowed)


def _no(name: str, why: str, *allowed: object, vllm: bool = True) -> EngineArg:
    return EngineArg(name, "refused", why, tuple(allowed), vllm)


_MM = "no multimodal models here"
_LOCAL = "models are local directories (nothing is downloaded)"
_TRACE = "no tracing or metrics export here"
_CUDA_KV = "the KV cache holds the model dtype only"

_ROWS: tuple[EngineArg, ...] = (
    # ---- model and tokenizer
    _acts("model", "local Hugging Face checkpoint directory or GGUF file; None = the built-in model"),
    _acts("tokenizer", "directory of the tokenizer when it is not the model's"),
    _acts("skip_tokenizer_init", "no tokenizer: token-id prompts only, outputs without text"),
    _noop("tokenizer_mode", "the checkpoint's tokenizer loads through `transformers`",
          ("auto", "hf")),
    _acts("trust_remote_code", "True is accepted for configs that need no code; a checkpoint "
          "that ships its own Python code (`auto_map`) is refused either way"),
    _acts("dtype", "auto (config.json; on a CPU float32 for a model whose weights are all in quantized "
          "blocks, and for bf16 on CPUs with neither native bf16 nor AVX2), float32, bfloat16, "
          "float16"),
    _acts("seed", "seed of the requests without their own; None = a fresh random seed"),
    _acts("max_model_len", "longest sequence; None = the model's max_position_embeddings"),
    _acts("max_logprobs", "most logprobs a request may ask for (-1 = no cap)"),
    _noop("logprobs_mode", "logprobs are the raw log-softmax", ("raw_logprobs",)),
    _acts("enforce_eager", "no compilation, no CUDA graphs (mode 0)"),
    _noop("served_model_name", "a server name; nothing is served"),
    _no("model_weights", _LOCAL, ""),
    _no("hf_config_path", "config.json is read from the model directory", None),
    _no("runner", "only generation runs here", "auto", "generate"),
    _no("convert", "only generation runs here", "auto", "none"),
    _no("enable_prompt_embeds", "prompts are text or token ids", False),
    _no("enable_return_routed_experts", "routed experts are not reported", False),
    _no("allowed_local_media_path", _MM, ""),
    _no("allowed_media_domains", _MM, None),
    _no("download_dir", _LOCAL, None),
    _noop("safetensors_load_strategy", "safetensors files are read whole", ("lazy", "eager")),
    _no("load_format", "weights load from safetensors", "auto", "safetensors"),
    _no("config_format", "config.json in Hugging Face format", "auto", "hf"),
    _no("revision", _LOCAL, None),
    _no("code_revision", _LOCAL, None),
    _no("tokenizer_revision", _LOCAL, None),
    _no("hf_token", _LOCAL, None),
    _no("hf_overrides", "config.json is used as saved", None, {}),
    _acts("quantization", "quantize the attention/MLP projections on load: q8_0, q4_0, q4_1 "
          "(GGUF block layouts; the token embedding and LM head in q8_0)"),
    _no("allow_deprecated_quantization", "weights run unquantized", False),
    _no("generation_config", "sampling defaults are vLLM's own; the model's "
        "generation_config.json is not read (pass SamplingParams)", "vllm"),
    _no("override_generation_config", "the model's generation_config.json is not read", None, {}),
    _no("model_impl", "the models are forwardkit's own", "auto", "vllm"),
    _no("disable_sliding_window", "the models here attend over the whole context", False),
    _no("disable_cascade_attn", "there is no cascade attention", False),
    _no("pooler_config", "only generation runs here", None),
    _no("logits_processors", "logits processors are not supported", None),
    _no("logits_processor_pattern", "logits processors are not supported", None),
    _no("tokens_only", "outputs carry text when there is a tokenizer", False),
    _no("io_processor_plugin", "plugins are not supported", None),
    # ---- parallelism
    _acts("tensor_parallel_size", "weights split over worker processes (or torchrun ranks)"),
    _acts("data_parallel_size", "one process per DP rank (torchrun); MoE ranks meet in the "
          "expert layers"),
    _acts("data_parallel_rank", "this process's DP rank (the DP group's rank wins)"),
    _acts("enable_expert_parallel", "MoE experts sharded over the DP x TP ranks"),
    _acts("all2all_backend", "allgather_reducescatter or naive on the CPU; the CUDA kernel "
          "backends only for resolving CUDA configs"),
    _acts("enable_dbo", "dual-batch overlap across DP ranks"),
    _acts("ubatch_size", "micro-batches per step"),
    _acts("dbo_decode_token_threshold", "micro-batch decode steps from this many tokens"),
    _acts("dbo_prefill_token_threshold", "micro-batch prefill steps from this many tokens"),
    _acts("disable_nccl_for_dp_synchronization", "the DP step agreement runs on the CPU"),
    _noop("distributed_executor_backend", "processes follow the launch (workers or torchrun)",
          (None, "mp", "uni", "external_launcher")),
    _no("pipeline_parallel_size", "pipeline parallelism is not supported; use "
        "tensor_parallel_size", 1),
    _no("prefill_context_parallel_size", "context parallelism is not supported", 1),
    _no("decode_context_parallel_size", "context parallelism is not supported", 1),
    _no("dcp_kv_cache_interleave_size", "context parallelism is not supported", 1),
    _no("cp_kv_cache_interleave_size", "context parallelism is not supported", 1),
    _no("master_addr", "one machine only; torchrun's environment sets the rendezvous",
        "127.0.0.1"),
    _no("master_port", "one machine only; torchrun's environment sets the rendezvous", 29501),
    _no("nnodes", "one machine only", 1),
    _no("node_rank", "one machine only", 0),
    _no("data_parallel_start_rank", "DP ranks come from the launch", None),
    _no("data_parallel_size_local", "DP ranks come from the launch", None, 1),
    _no("data_parallel_address", "DP ranks come from the launch", None),
    _no("data_parallel_rpc_port", "there is no DP coordinator process", None),
    _no("data_parallel_hybrid_lb", "there is no load balancer", False),
    _no("data_parallel_external_lb", "there is no load balancer", False),
    _no("data_parallel_backend", "DP ranks are processes", "mp"),
    _no("enable_eplb", "no expert load balancer runs here", False),
    _no("eplb_config", "no expert load balancer runs here", None, {}),
    _no("expert_placement_strategy", "experts are placed linearly", "linear"),
    _no("_api_process_count", "there is no API server", 1),
    _no("_api_process_rank", "there is no API server", 0),
    _noop("max_parallel_loading_workers", "weights load in this process"),
    _noop("disable_custom_all_reduce", "there is no custom all-reduce kernel"),
    _no("ray_workers_use_nsight", "Ray is not used", False),
    _no("worker_cls", "workers are forwardkit's own", "auto"),
    _no("worker_extension_cls", "workers are forwardkit's own", ""),
    # ---- KV cache and memory
    _acts("block_size", "tokens per KV block"),
    _acts("enable_prefix_caching", "reuse the KV blocks of a shared prompt prefix"),
    _acts("prefix_caching_hash_algo", "hash of a full block's tokens for prefix caching"),
    _acts("num_gpu_blocks_override", "KV blocks to allocate (also on the CPU)",
          rename="num_gpu_blocks"),
    _noop("gpu_memory_utilization", "the KV cache takes at most 512 MiB on the CPU and half the "
          "free memory on a GPU; set num_gpu_blocks_override for an exact size"),
    _noop("swap_space", "preempted requests are recomputed, never swapped"),
    _no("cpu_offload_gb", "weights stay in the device's memory", 0),
    _no("kv_cache_memory_bytes", "set num_gpu_blocks_override instead", None),
    _no("kv_cache_dtype", _CUDA_KV, "auto"),
    _no("calculate_kv_scales", _CUDA_KV, False),
    _no("kv_sharing_fast_prefill", "KV sharing across layers is not supported", False),
    _no("kv_offloading_size", "KV offloading is not supported", None),
    _no("kv_offloading_backend", "KV offloading is not supported", "native"),
    _no("mamba_cache_dtype", "no Mamba models here", "auto"),
    _no("mamba_ssm_cache_dtype", "no Mamba models here", "auto"),
    _no("mamba_block_size", "no Mamba models here", None),
    _noop("disable_hybrid_kv_cache_manager", "one KV layout for every layer"),
    _no("kv_transfer_config", "KV transfer is not supported", None),
    _no("kv_events_config", "KV events are not published", None),
    _no("ec_transfer_config", "encoder-cache transfer is not supported", None),
    # ---- scheduling
    _acts("max_num_seqs", "most requests per step"),
    _acts("max_num_batched_tokens", "most tokens per step"),
    _acts("enable_chunked_prefill", "long prompts over several steps"),
    _noop("async_scheduling", "resolved as in vLLM (it sets the DP-sync default); steps run "
          "one after another here"),
    _no("max_num_partial_prefills", "partial prefills are not limited separately", 1),
    _no("max_long_partial_prefills", "partial prefills are not limited separately", 1),
    _no("long_prefill_token_threshold", "partial prefills are not limited separately", 0),
    _no("scheduling_policy", "requests are served first come, first served", "fcfs"),
    _no("scheduler_cls", "the scheduler is forwardkit's own", None),
    _noop("stream_interval", "offline generation returns whole outputs"),
    _no("disable_chunked_mm_input", _MM, False),
    _acts("speculative_config", "speculative decoding: methods ngram (prompt lookup) and "
          "draft_model (a second checkpoint with the target's vocabulary) with exact rejection "
          "sampling; other methods are refused naming the field"),
    _no("structured_outputs_config", "structured outputs are not supported", None),
    _no("reasoning_parser", "reasoning parsers are not supported", ""),
    _no("reasoning_parser_plugin", "reasoning parsers are not supported", None),
    # ---- compilation
    _acts("compilation_config", "a CompilationConfig, a dict of its fields, or a mode"),
    _acts("optimization_level", "O0-O3 defaults of the compilation config"),
    _acts("cudagraph_capture_sizes", "the compilation config's capture sizes"),
    _acts("max_cudagraph_capture_size", "the compilation config's largest capture size"),
    _no("attention_config", "one attention backend per platform", None),
    _no("attention_backend", "one attention backend per platform", None),
    _no("override_attention_dtype", "attention runs in the model dtype", None),
    # ---- logging, metrics, tracing
    _noop("disable_log_stats", "no periodic statistics are logged"),
    _noop("aggregate_engine_logging", "one engine, nothing to aggregate"),
    _acts("cudagraph_metrics", "per-step CUDA-graph statistics"),
    _noop("use_tqdm_on_load", "weights load without a progress bar"),
    _noop("enable_sleep_mode", "sleep() and wake_up() are always available"),
    _no("show_hidden_metrics_for_version", _TRACE, None),
    _no("otlp_traces_endpoint", _TRACE, None),
    _no("collect_detailed_traces", _TRACE, None),
    _no("kv_cache_metrics", _TRACE, False),
    _no("kv_cache_metrics_sample", _TRACE, None, 0.01),
    _no("enable_layerwise_nvtx_tracing", _TRACE, False),
    _no("enable_mfu_metrics", _TRACE, False),
    _no("enable_logging_iteration_details", _TRACE, False),
    _no("enable_mm_processor_stats", _MM, False),
    _no("profiler_config", "use forwardkit bench --generation --profile", None),
    _no("additional_config", "there are no platform plugins", None, {}),
    _no("pt_load_map_location", "weights load onto the engine's device", "cpu"),
    _no("model_loader_extra_config", "weights load from safetensors", None, {}),
    _no("ignore_patterns", "weights load from safetensors", None),
    # ---- multimodal, LoRA
    _no("limit_mm_per_prompt", _MM, None, {}),
    _no("enable_mm_embeds", _MM, False),
    _no("interleave_mm_strings", _MM, False),
    _no("media_io_kwargs", _MM, None, {}),
    _no("mm_processor_kwargs", _MM, None),
    _no("mm_processor_cache_gb", _MM, 4),
    _no("mm_processor_cache_type", _MM, "lru"),
    _no("mm_shm_cache_max_object_size_mb", _MM, 128),
    _no("mm_encoder_tp_mode", _MM, "weights"),
    _no("mm_encoder_attn_backend", _MM, None),
    _no("skip_mm_profiling", _MM, False),
    _no("video_pruning_rate", _MM, None),
    _acts("enable_lora", "serve PEFT LoRA adapters (`generate(..., lora_request=)`, "
          "`add_lora`, `update_lora`); builds the LoRA config"),
    _acts("max_loras", "adapters one step may hold (slots); needs enable_lora"),
    _acts("max_lora_rank", "largest adapter rank (1, 8, 16, 32, 64, 128, 256, 320, 512); "
          "needs enable_lora"),
    _acts("max_cpu_loras", "adapters kept loaded in host memory (>= max_loras); needs "
          "enable_lora"),
    _acts("lora_dtype", "dtype of the adapter slots: auto (the model's), float32, bfloat16, "
          "float16; needs enable_lora"),
    _no("default_mm_loras", _MM, None),
    _no("fully_sharded_loras", "the LoRA A of column-parallel layers is replicated", False),
    _no("enable_tower_connector_lora", _MM, False),
    # ---- forwardkit's own
    _acts("model_shape", "a named real architecture with seeded random weights "
          "(`llama-3.2-1b`, ...)", vllm=False),
    _acts("num_gpu_blocks", "KV blocks to allocate (vLLM: num_gpu_blocks_override)", vllm=False),
    _acts("platform", "cpu, cuda, or a Platform (default: detected)", vllm=False),
    _acts("engine_config", "a resolved EngineConfig instead of the other arguments", vllm=False),
    _no("is_moe_model", "set from the model", None, vllm=False),
    _no("rank", "ranks come from the launch", 0, vllm=False),
    _no("data_parallel_rank_local", "ranks come from the launch", None, vllm=False),
    _no("data_parallel_master_ip", "set by the launch (torchrun or FORWARDKIT_DP_MASTER_IP)",
        "127.0.0.1", vllm=False),
    _no("data_parallel_master_port", "set by the launch (torchrun or "
        "FORWARDKIT_DP_MASTER_PORT)", 29500, vllm=False),
)

ENGINE_ARGS: dict[str, EngineArg] = {row.name: row for row in _ROWS}

# Rows that act on the LLM itself (its tokenizer, sampling checks, seeds), not on the config.
LLM_LEVEL_ARGS = frozenset({"tokenizer", "skip_tokenizer_init", "trust_remote_code",
                            "max_logprobs", "seed", "engine_config"})


def screen_engine_args(kwargs: Mapping[str, object]) -> dict[str, object]:
    """The arguments of ``kwargs`` that act or are accepted, renamed ones
    (``num_gpu_blocks_override``) under their forwardkit name; refused arguments left at values
    that change nothing are dropped.

    Raises ``ValueError`` for a refused argument (or a refused value), naming it and why, and
    ``TypeError`` for a name that is neither vLLM's nor forwardkit's.
    """
    out: dict[str, object] = {}
    for name, value in kwargs.items():
        row = ENGINE_ARGS.get(name)
        if row is None:
            import difflib

            close = difflib.get_close_matches(name, ENGINE_ARGS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"unknown engine argument {name!r}{hint}: neither a vLLM engine "
                            "argument nor a forwardkit one (README: Differences from vLLM)")
        if not row.accepts(value):
            raise ValueError(f"{name}={short_repr(value)} is not supported: {row.note}")
        if row.kind != "refused":
            out[row.rename or name] = value
    return out


def markdown_table() -> str:
    """The table as Markdown, for the README."""
    lines = ["| argument | here | what it does / why refused |", "| --- | --- | --- |"]
    for row in sorted(_ROWS, key=lambda r: (not r.vllm, r.name.lstrip("_"))):
        name = f"`{row.name}`" + ("" if row.vllm else " (forwardkit)")
        kind: str = row.kind
        if row.kind == "refused" and row.allowed:
            kind = "refused unless " + " / ".join(f"`{a!r}`" for a in row.allowed)
        elif row.allowed is not None:
            kind = f"{row.kind}: " + " / ".join(f"`{a!r}`" for a in row.allowed)
        lines.append(f"| {name} | {kind} | {row.note} |")
    return "\n".join(lines)


if __name__ == "__main__":  # the README's copy: python -m forwardkit.config.engine_args
    print(markdown_table())
