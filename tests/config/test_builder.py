"""build_engine_config: the one builder behind LLM(...) and the CLI flags (forwardkit.config.builder)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from forwardkit.commands.engine_flags import add_engine_args
from forwardkit.commands.flag_config import engine_config_from_args
from forwardkit.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    OptimizationLevel,
    build_engine_config,
    builder,
)
from forwardkit.config.builder import default_batch_limits, engine_kwarg_names
from forwardkit.config.model_shapes import BUILTIN_MODEL_SHAPE, model_shape_config
from forwardkit.platforms import CpuPlatform, CudaPlatform

HF = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
      "num_hidden_layers": 2, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def limits(cfg):
    return cfg.scheduler_config.max_num_seqs, cfg.scheduler_config.max_num_batched_tokens


@pytest.mark.parametrize(
    "seqs, tokens, chunked, model_len, expected",
    [
        (None, None, True, 4096, (128, 2048)),
        (4096, None, True, 4096, (4096, 4096)),
        (None, 64, True, 4096, (64, 64)),
        (8, 16, True, 4096, (8, 16)),
        (None, None, False, 4096, (128, 4096)),  # chunked prefill off: a whole prompt fits a step
        (None, None, False, 1024, (128, 2048)),
        (None, 8192, False, 4096, (128, 8192)),
        (8, None, False, 100, (8, 2048)),
    ],
)
def test_default_batch_limits(seqs, tokens, chunked, model_len, expected):
    assert default_batch_limits(seqs, tokens, max_model_len=model_len,
                                enable_chunked_prefill=chunked) == expected


def test_defaults_with_and_without_a_model(monkeypatch):
    # the checkpoint's bf16 is kept on a CPU with native bf16 (the fallback to float32 on
    # other CPUs is tested in test_model_shapes.py)
    monkeypatch.setattr(builder, "cpu_has_native_bf16", lambda: True)
    cfg = build_engine_config(default_hf_config=HF, platform="cpu")
    assert limits(cfg) == (128, 2048) and cfg.scheduler_config.enable_chunked_prefill
    assert cfg.model_config.model is None and cfg.model_config.dtype is torch.bfloat16
    assert cfg.cache_config.block_size == 16 and cfg.cache_config.num_gpu_blocks is None
    assert cfg.optimization_level == OptimizationLevel.O2 and cfg.platform.name == "cpu"
    bare = build_engine_config(platform="cpu", dtype="auto")  # no model: the built-in one
    assert bare.model_config.model is None and limits(bare) == (128, 2048)
    assert bare.model_config.hf_config == model_shape_config(BUILTIN_MODEL_SHAPE)


def test_chunked_prefill_off_raises_the_token_budget():
    cfg = build_engine_config(default_hf_config=HF, enable_chunked_prefill=False, platform="cpu")
    assert limits(cfg) == (128, 4096) and not cfg.scheduler_config.enable_chunked_prefill
    short = build_engine_config(default_hf_config=HF, enable_chunked_prefill=False, max_model_len=512)
    assert limits(short) == (128, 2048)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\).*max_model_len \(4096\)") as info:
        build_engine_config(default_hf_config=HF, enable_chunked_prefill=False, max_num_batched_tokens=64)
    assert "\n" not in str(info.value)


def test_model_dir_wins_over_default(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**HF, "max_position_embeddings": 512}))
    cfg = build_engine_config(tmp_path, default_hf_config=HF, dtype=torch.float16, max_model_len=256,
                              block_size=32, num_gpu_blocks=7, platform=CudaPlatform())
    assert cfg.model_config.model == str(tmp_path) and cfg.model_config.max_model_len == 256
    assert cfg.model_config.dtype is torch.float16
    assert (cfg.cache_config.block_size, cfg.cache_config.num_gpu_blocks) == (32, 7)
    assert cfg.compilation_config.cudagraph_mode != CUDAGraphMode.NONE


def test_routed_keyword_arguments():
    cfg = build_engine_config(default_hf_config=HF, data_parallel_size=2, data_parallel_rank=1,
                              enable_expert_parallel=True, all2all_backend="naive",
                              async_scheduling=False, tensor_parallel_size=None)
    p = cfg.parallel_config
    assert (p.data_parallel_size, p.data_parallel_rank, p.enable_expert_parallel) == (2, 1, True)
    assert p.all2all_backend == "naive" and p.tensor_parallel_size == 1  # None = the default
    assert cfg.scheduler_config.async_scheduling is False
    parallel, scheduler = engine_kwarg_names()
    assert "enable_expert_parallel" in parallel and "data_parallel_size" not in parallel
    assert "async_scheduling" in scheduler and "max_num_seqs" not in scheduler


def test_unknown_keyword_is_a_short_type_error():
    with pytest.raises(TypeError, match=r"unknown engine argument 'bogus': neither a vLLM engine "
                                        r"argument nor a forwardkit one") as info:
        build_engine_config(default_hf_config=HF, bogus=1)
    assert len(str(info.value)) < 200


@pytest.mark.parametrize("value", [{"mode": 1, "backend": "eager"}, '{"mode": 1, "backend": "eager"}'])
def test_compilation_config_dict_and_json(value):
    cc = build_engine_config(default_hf_config=HF, compilation_config=value, platform="cpu").compilation_config
    assert cc.mode == CompilationMode.STOCK_TORCH_COMPILE and cc.backend == "eager"


def test_compilation_config_instance_is_used():
    given = CompilationConfig(mode=0)
    cfg = build_engine_config(default_hf_config=HF, compilation_config=given, platform="cpu")
    assert cfg.compilation_config is given and given.mode == CompilationMode.NONE


@pytest.mark.parametrize(
    "value, names, message",
    [
        ({"mode": 9}, None, r"^compilation_config\.mode"),
        ({"pass_config": {"foo": 1}}, None, r"compilation_config\.pass_config\.foo"),
        ({"mode": 9}, {"compilation_config": "-cc"}, r"^-cc\.mode"),
        ([1, 2], None, "compilation_config must be a CompilationConfig, a dict"),
    ],
)
def test_compilation_config_errors_name_the_key(value, names, message):
    with pytest.raises(ValueError, match=message) as info:
        build_engine_config(default_hf_config=HF, compilation_config=value, arg_names=names)
    assert "\n" not in str(info.value)


def test_model_arguments_without_a_model_apply_to_the_builtin_model():
    cfg = build_engine_config(dtype="float16", enforce_eager=True, max_model_len=64, platform="cpu")
    model = cfg.model_config
    assert model.hf_config == model_shape_config(BUILTIN_MODEL_SHAPE) and model.model is None
    assert (model.dtype, model.enforce_eager, model.max_model_len) == (torch.float16, True, 64)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": 4096, "max_num_batched_tokens": 2048}, "max_num_batched_tokens"),
        ({"block_size": 0}, "block_size"),
        ({"dtype": "int3"}, "unknown dtype 'int3'"),
        ({"max_model_len": 10**6}, "max_position_embeddings"),
        ({"optimization_level": 7}, "optimization_level"),
        ({"platform": "tpu"}, "unknown platform 'tpu'"),
        ({"platform": 3}, "platform must be a Platform"),
        ({"data_parallel_size": 2, "data_parallel_rank": 5}, r"data_parallel_rank \(5\)"),
    ],
)
def test_invalid_values_are_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        build_engine_config(default_hf_config=HF, **kwargs)
    assert "\n" not in str(info.value)


def test_enforce_eager_forces_o0():
    cfg = build_engine_config(default_hf_config=HF, enforce_eager=True, optimization_level=3,
                              platform=CpuPlatform())
    assert cfg.optimization_level == OptimizationLevel.O0
    assert cfg.compilation_config.mode == CompilationMode.NONE


@pytest.mark.parametrize(
    "argv, kwargs",
    [
        ([], {}),
        (["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--block-size", "32"],
         {"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 32}),
        (["--no-enable-chunked-prefill"], {"enable_chunked_prefill": False}),
        (["-O3", "-O.cudagraph_mode=FULL"], {"optimization_level": 3, "compilation_config": {"cudagraph_mode": "FULL"}}),
        (["--enforce-eager", "-dp", "2", "--enable-expert-parallel"],
         {"enforce_eager": True, "data_parallel_size": 2, "enable_expert_parallel": True}),
    ],
)
def test_cli_and_keyword_paths_agree(argv, kwargs):
    ns = add_engine_args(argparse.ArgumentParser(prog="t")).parse_args([*argv, "--platform", "cuda"])
    cli = engine_config_from_args(ns, default_hf_config=HF)
    api = build_engine_config(default_hf_config=HF, platform="cuda", **kwargs)
    assert limits(cli) == limits(api)
    assert cli.scheduler_config.enable_chunked_prefill == api.scheduler_config.enable_chunked_prefill
    assert cli.cache_config == api.cache_config and cli.optimization_level == api.optimization_level
    assert cli.compilation_config.compute_hash() == api.compilation_config.compute_hash()
    assert cli.compilation_config.cudagraph_capture_sizes == api.compilation_config.cudagraph_capture_sizes
    assert cli.parallel_config.compute_hash() == api.parallel_config.compute_hash()
    assert cli.model_config.compute_hash() == api.model_config.compute_hash()


@pytest.mark.parametrize("kwargs, words", [
    ({"max_num_batched_tokens": -5}, ["max_num_batched_tokens must be >= 1, got -5"]),
    ({"max_num_seqs": "8"}, ["max_num_seqs must be an integer", "'8'", "str"]),
    ({"max_model_len": 1.5}, ["max_model_len must be an integer", "1.5"]),
    ({"enforce_eager": "yes"}, ["enforce_eager must be True or False", "'yes'"]),
    ({"default_hf_config": [1]}, ["default_hf_config must be a dict", "[1]"]),
    ({"dtype": 5}, ["dtype must be auto", "5"]),
    ({"optimization_level": True}, ["optimization_level must be an integer"]),
    ({"tensor_parallel_size": "x"}, ["tensor_parallel_size"]),
])
def test_wrong_typed_arguments_are_value_errors_naming_the_argument(kwargs, words):
    kwargs = {"default_hf_config": HF, "platform": "cpu", **kwargs}
    with pytest.raises(ValueError) as info:
        build_engine_config(**kwargs)
    assert not isinstance(info.value, TypeError)
    for word in words:
        assert word in str(info.value)
