"""The engine-argument table (``config/engine_args.py``) against the code: every vLLM 0.14.0
``EngineArgs`` field has a row, every argument the engine takes has a row, acting rows change
the config, refused rows are refused by name, and the README carries the table as generated."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

import pytest

from forwardkit.config.builder import build_engine_config, routed_field_names
from forwardkit.config.cache import CacheConfig
from forwardkit.config.engine_args import ENGINE_ARGS, LLM_LEVEL_ARGS, markdown_table
from forwardkit.engine.llm import LLM

# The EngineArgs fields of vLLM 0.14.0 (vllm/engine/arg_utils.py), by name.
VLLM_0_14_0_ENGINE_ARGS = frozenset(["model", "enable_return_routed_experts", "model_weights", "served_model_name", "tokenizer", "hf_config_path", "runner", "convert", "skip_tokenizer_init", "enable_prompt_embeds", "tokenizer_mode", "trust_remote_code", "allowed_local_media_path", "allowed_media_domains", "download_dir", "safetensors_load_strategy", "load_format", "config_format", "dtype", "kv_cache_dtype", "seed", "max_model_len", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "distributed_executor_backend", "pipeline_parallel_size", "master_addr", "master_port", "nnodes", "node_rank", "tensor_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size", "dcp_kv_cache_interleave_size", "cp_kv_cache_interleave_size", "data_parallel_size", "data_parallel_rank", "data_parallel_start_rank", "data_parallel_size_local", "data_parallel_address", "data_parallel_rpc_port", "data_parallel_hybrid_lb", "data_parallel_external_lb", "data_parallel_backend", "enable_expert_parallel", "all2all_backend", "enable_dbo", "ubatch_size", "dbo_decode_token_threshold", "dbo_prefill_token_threshold", "disable_nccl_for_dp_synchronization", "eplb_config", "enable_eplb", "expert_placement_strategy", "_api_process_count", "_api_process_rank", "max_parallel_loading_workers", "block_size", "enable_prefix_caching", "prefix_caching_hash_algo", "disable_sliding_window", "disable_cascade_attn", "swap_space", "cpu_offload_gb", "gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_batched_tokens", "max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold", "max_num_seqs", "max_logprobs", "logprobs_mode", "disable_log_stats", "aggregate_engine_logging", "revision", "code_revision", "hf_token", "hf_overrides", "tokenizer_revision", "quantization", "allow_deprecated_quantization", "enforce_eager", "disable_custom_all_reduce", "limit_mm_per_prompt", "enable_mm_embeds", "interleave_mm_strings", "media_io_kwargs", "mm_processor_kwargs", "mm_processor_cache_gb", "mm_processor_cache_type", "mm_shm_cache_max_object_size_mb", "mm_encoder_tp_mode", "mm_encoder_attn_backend", "io_processor_plugin", "skip_mm_profiling", "video_pruning_rate", "enable_lora", "max_loras", "max_lora_rank", "default_mm_loras", "fully_sharded_loras", "max_cpu_loras", "lora_dtype", "enable_tower_connector_lora", "ray_workers_use_nsight", "num_gpu_blocks_override", "model_loader_extra_config", "ignore_patterns", "enable_chunked_prefill", "disable_chunked_mm_input", "disable_hybrid_kv_cache_manager", "structured_outputs_config", "reasoning_parser", "reasoning_parser_plugin", "logits_processor_pattern", "speculative_config", "show_hidden_metrics_for_version", "otlp_traces_endpoint", "collect_detailed_traces", "kv_cache_metrics", "kv_cache_metrics_sample", "cudagraph_metrics", "enable_layerwise_nvtx_tracing", "enable_mfu_metrics", "enable_logging_iteration_details", "enable_mm_processor_stats", "scheduling_policy", "scheduler_cls", "pooler_config", "compilation_config", "attention_config", "worker_cls", "worker_extension_cls", "profiler_config", "kv_transfer_config", "kv_events_config", "ec_transfer_config", "generation_config", "enable_sleep_mode", "override_generation_config", "model_impl", "override_attention_dtype", "attention_backend", "calculate_kv_scales", "mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_block_size", "additional_config", "use_tqdm_on_load", "pt_load_map_location", "logits_processors", "async_scheduling", "stream_interval", "kv_sharing_fast_prefill", "optimization_level", "kv_offloading_size", "kv_offloading_backend", "tokens_only"])

# build_engine_config's plumbing for the CLI, not user arguments
BUILDER_ONLY = {"default_hf_config", "arg_names"}
# rows that act once prefix caching lands (CacheConfig fields, routed by name from then on)
PREFIX_CACHING = {"enable_prefix_caching", "prefix_caching_hash_algo"}

BASE = {"platform": "cpu"}


def test_every_vllm_engine_arg_has_exactly_one_row():
    assert len(VLLM_0_14_0_ENGINE_ARGS) == 159
    vllm_rows = {name for name, row in ENGINE_ARGS.items() if row.vllm}
    assert vllm_rows == VLLM_0_14_0_ENGINE_ARGS


def test_every_argument_the_engine_takes_has_a_row():
    taken = set().union(*routed_field_names().values())
    taken |= set(inspect.signature(build_engine_config).parameters) - {"kwargs"} - BUILDER_ONLY
    taken |= set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"}
    missing = sorted(taken - set(ENGINE_ARGS))
    assert not missing, f"arguments the engine takes without a row in config/engine_args.py: {missing}"


def test_a_new_config_field_without_a_row_is_caught(monkeypatch):
    """The check above sees a field added to a routed config (here a stand-in CacheConfig)."""
    @dataclasses.dataclass
    class Grown(CacheConfig):
        brand_new_knob: int = 0

    monkeypatch.setattr("forwardkit.config.builder.CacheConfig", Grown)
    with pytest.raises(AssertionError, match="brand_new_knob"):
        test_every_argument_the_engine_takes_has_a_row()


def _bad_value(allowed: tuple) -> object:
    sample = next((a for a in allowed if a is not None), None)
    if isinstance(sample, bool):
        return not sample
    if isinstance(sample, (int, float)):
        return sample + 1
    if isinstance(sample, str):
        return sample + "-unsupported"
    return "unsupported"


@pytest.mark.parametrize("name", sorted(n for n, r in ENGINE_ARGS.items() if r.kind == "refused"))
def test_refused_rows_name_the_argument_and_why(name):
    row = ENGINE_ARGS[name]
    bad = _bad_value(row.allowed or ())
    with pytest.raises(ValueError) as info:
        build_engine_config(**BASE, **{name: bad})
    message = str(info.value)
    assert message.startswith(f"{name}=") and row.note in message and len(message) < 200
    for ok in row.allowed or ():  # the values that change nothing pass
        build_engine_config(**BASE, **{name: ok})


# An acting argument, a value, and where the config shows it.
ACTING = {
    "dtype": ("float16", lambda c: str(c.model_config.dtype), "torch.float16"),
    "max_model_len": (64, lambda c: c.model_config.max_model_len, 64),
    "enforce_eager": (True, lambda c: c.model_config.enforce_eager, True),
    "tensor_parallel_size": (2, lambda c: c.parallel_config.tensor_parallel_size, 2),
    "data_parallel_size": (2, lambda c: c.parallel_config.data_parallel_size, 2),
    "data_parallel_rank": (1, lambda c: c.parallel_config.data_parallel_rank, 1),
    "enable_expert_parallel": (True, lambda c: c.parallel_config.enable_expert_parallel, True),
    "all2all_backend": ("naive", lambda c: c.parallel_config.all2all_backend, "naive"),
    "enable_dbo": (True, lambda c: c.parallel_config.enable_dbo, True),
    "ubatch_size": (3, lambda c: c.parallel_config.ubatch_size, 3),
    "dbo_decode_token_threshold": (8, lambda c: c.parallel_config.dbo_decode_token_threshold, 8),
    "dbo_prefill_token_threshold": (64, lambda c: c.parallel_config.dbo_prefill_token_threshold, 64),
    "disable_nccl_for_dp_synchronization": (
        False, lambda c: c.parallel_config.disable_nccl_for_dp_synchronization, False),
    "block_size": (32, lambda c: c.cache_config.block_size, 32),
    "quantization": ("q8_0", lambda c: c.model_config.quantization, "q8_0"),
    "speculative_config": ({"num_speculative_tokens": 2},
                           lambda c: getattr(c.speculative_config, "num_speculative_tokens", None),
                           2),
    "num_gpu_blocks_override": (7, lambda c: c.cache_config.num_gpu_blocks, 7),
    "num_gpu_blocks": (9, lambda c: c.cache_config.num_gpu_blocks, 9),
    "max_num_seqs": (3, lambda c: c.scheduler_config.max_num_seqs, 3),
    "max_num_batched_tokens": (300, lambda c: c.scheduler_config.max_num_batched_tokens, 300),
    "enable_chunked_prefill": (False, lambda c: c.scheduler_config.enable_chunked_prefill, False),
    "compilation_config": ({"mode": 1}, lambda c: int(c.compilation_config.mode), 1),
    "optimization_level": (1, lambda c: int(c.optimization_level), 1),
    "cudagraph_capture_sizes": ([1, 2], lambda c: c.compilation_config.cudagraph_capture_sizes,
                                [1, 2]),
    "max_cudagraph_capture_size": (4, lambda c: c.compilation_config.max_cudagraph_capture_size, 4),
    "cudagraph_metrics": (True, lambda c: c.observability_config.cudagraph_metrics, True),
    "model_shape": ("mixtral-small", lambda c: c.model_config.is_moe, True),
    "platform": ("cuda", lambda c: c.platform.name, "cuda"),
    "enable_lora": (True, lambda c: c.lora_config is not None, True),
    "max_loras": (3, lambda c: getattr(c.lora_config, "max_loras", None), 3),
    "max_lora_rank": (64, lambda c: getattr(c.lora_config, "max_lora_rank", None), 64),
    "max_cpu_loras": (5, lambda c: getattr(c.lora_config, "max_cpu_loras", None), 5),
    "lora_dtype": ("float16", lambda c: getattr(c.lora_config, "lora_dtype", None), "float16"),
}
NEEDS_CUDA = {"cudagraph_capture_sizes", "max_cudagraph_capture_size"}
WITH = {"data_parallel_rank": {"data_parallel_size": 2},  # a rank acts with DP only
        # the LoRA slots act with enable_lora only (tests/engine/test_lora_config.py)
        **{n: {"enable_lora": True} for n in ("max_loras", "max_lora_rank", "max_cpu_loras",
                                               "lora_dtype")}}
ACTS_ON_LLM = LLM_LEVEL_ARGS | {"model"}  # shown by tests/engine/test_engine_args_llm.py


def test_every_acting_row_is_shown_to_act():
    acting = {n for n, r in ENGINE_ARGS.items() if r.kind == "acts"}
    assert acting == set(ACTING) | ACTS_ON_LLM | PREFIX_CACHING


@pytest.mark.parametrize("name", sorted(ACTING))
def test_acting_rows_change_the_config(name):
    value, read, expected = ACTING[name]
    base = {**({"platform": "cuda"} if name in NEEDS_CUDA else BASE), **WITH.get(name, {})}
    kwargs = {**base, name: value}
    if name == "platform":
        kwargs = {name: value}
    assert read(build_engine_config(**kwargs)) == expected
    assert read(build_engine_config(**base)) != expected  # not the default anyway


@pytest.mark.parametrize("name", sorted(PREFIX_CACHING))
def test_prefix_caching_rows(name):
    """Routed by name into CacheConfig once it has the field; until then refused as unrouted."""
    value = True if name == "enable_prefix_caching" else "sha256"
    if name in {f.name for f in dataclasses.fields(CacheConfig)}:
        assert getattr(build_engine_config(**BASE, **{name: value}).cache_config, name) == value
    else:
        with pytest.raises(TypeError, match=f"{name}.*does not route it"):
            build_engine_config(**BASE, **{name: value})


@pytest.mark.parametrize("name", sorted(n for n, r in ENGINE_ARGS.items() if r.kind == "accepted"))
def test_accepted_rows_are_taken(name):
    row = ENGINE_ARGS[name]
    value = row.allowed[-1] if row.allowed else True
    if name in {"gpu_memory_utilization"}:
        value = 0.5
    elif name in {"swap_space", "max_parallel_loading_workers", "stream_interval"}:
        value = 2
    elif name == "served_model_name":
        value = "my-model"
    cfg = build_engine_config(**BASE, **{name: value})
    assert cfg.compute_hash() == build_engine_config(**BASE).compute_hash()
    if row.allowed is not None:
        with pytest.raises(ValueError, match=rf"^{name}="):
            build_engine_config(**BASE, **{name: _bad_value(row.allowed)})


@pytest.mark.parametrize("kwargs", [
    {"pipeline_parallel_size": 2}, {"decode_context_parallel_size": 2}, {"nnodes": 2},
    {"is_moe_model": True}, {"rank": 5}, {"master_port": -1},
])
def test_silently_ignored_arguments_are_refused(kwargs):
    (name, _), = kwargs.items()
    with pytest.raises(ValueError, match=rf"^{name}=\S+ is not supported: "):
        LLM(enforce_eager=True, platform="cpu", **kwargs)


def test_cpu_refuses_all2all_backends_it_cannot_run():
    with pytest.raises(ValueError, match=r"all2all_backend='pplx' needs its CUDA kernels"):
        build_engine_config(platform="cpu", all2all_backend="pplx")
    assert build_engine_config(platform="cuda", all2all_backend="pplx").parallel_config.all2all_backend == "pplx"


@pytest.mark.parametrize("name", ["gpu_memory_utilization", "disable_log_stats"])
def test_common_vllm_arguments_are_accepted_by_llm(name):
    value = 0.5 if name == "gpu_memory_utilization" else True
    llm = LLM(enforce_eager=True, platform="cpu", max_model_len=32, **{name: value})
    assert llm.generate(prompt_token_ids=[[1, 2]], use_tqdm=False)[0].outputs[0].token_ids


def test_unknown_argument_is_a_short_type_error_with_a_suggestion():
    with pytest.raises(TypeError) as info:
        LLM(enforce_eager=True, platform="cpu", tokenizr="x")
    message = str(info.value)
    assert "'tokenizr'" in message and "did you mean 'tokenizer'" in message
    assert len(message) < 200 and "is_moe_model" not in message


def test_readme_carries_the_generated_table():
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    found = re.search(r"<!-- engine-args:start -->\n(.*?)\n<!-- engine-args:end -->", readme, re.S)
    assert found, "README lacks the engine-args section"
    assert found.group(1).strip() == markdown_table().strip(), (
        "README's engine-argument table is stale: python -m forwardkit.config.engine_args")
