"""vLLM-style engine arguments: every flag form and the errors (forwardkit.commands.flag_config)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from forwardkit.commands.engine_flags import add_engine_args, normalize_engine_argv
from forwardkit.commands.flag_config import compilation_overrides_from_args, engine_config_from_args
from forwardkit.config import CompilationMode, CUDAGraphMode, OptimizationLevel

HF = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
      "num_hidden_layers": 2, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def parse(*argv: str) -> argparse.Namespace:
    return add_engine_args(argparse.ArgumentParser(prog="t")).parse_args(list(argv))


def resolve(*argv: str, hf=HF):
    return engine_config_from_args(parse(*argv), default_hf_config=hf)


@pytest.mark.parametrize("argv", [["-O3"], ["-O", "3"], ["-O=3"], ["--optimization-level", "3"],
                                  ["--optimization-level=3"], ["-O1", "-O3"]])
def test_level_forms(argv):
    assert compilation_overrides_from_args(parse(*argv)) == (3, {})
    assert resolve(*argv).optimization_level == OptimizationLevel.O3


def test_default_level_is_o2():
    assert compilation_overrides_from_args(parse()) == (None, {})
    assert resolve().optimization_level == OptimizationLevel.O2


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["-O.cudagraph_mode=FULL"], {"cudagraph_mode": "FULL"}),
        (["-O.mode=3"], {"mode": 3}),
        (["-O.pass_config.eliminate_noops=false"], {"pass_config": {"eliminate_noops": False}}),
        (["-O.cudagraph_capture_sizes=[1, 2, 4]"], {"cudagraph_capture_sizes": [1, 2, 4]}),
        (["-cc.mode=1"], {"mode": 1}),
        (["-cc.mode", "1"], {"mode": 1}),  # value after a space, as vLLM accepts
        (["--compilation-config.cudagraph_capture_sizes", "[1, 2]"], {"cudagraph_capture_sizes": [1, 2]}),
        (["-O.cudagraph_num_of_warmups", "2"], {"cudagraph_num_of_warmups": 2}),
        (["--compilation-config.backend=eager"], {"backend": "eager"}),
        (["--compilation-config", '{"mode": 3, "custom_ops": ["+rms_norm"]}'], {"mode": 3, "custom_ops": ["+rms_norm"]}),
        (["-cc", '{"mode": 0}'], {"mode": 0}),
        (["-cc", "3"], {"mode": 3}),
        (["-cc", "vllm_compile"], {"mode": "VLLM_COMPILE"}),
        (["-cc", '{"mode": 0, "pass_config": {"enable_sp": true}}', "-O.mode=3", "-O.pass_config.fuse_norm_quant=true"],
         {"mode": 3, "pass_config": {"enable_sp": True, "fuse_norm_quant": True}}),
    ],
)
def test_compilation_forms(argv, expected):
    assert compilation_overrides_from_args(parse(*argv))[1] == expected


def test_dotted_and_level_together():
    cfg = resolve("-O1", "-O.cudagraph_mode=FULL", "-O.pass_config.eliminate_noops=false", "--platform", "cuda")
    cc = cfg.compilation_config
    assert cfg.optimization_level == OptimizationLevel.O1
    assert cc.cudagraph_mode == CUDAGraphMode.FULL and cc.pass_config.eliminate_noops is False
    assert cc.mode == CompilationMode.VLLM_COMPILE


def test_engine_flags(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF))
    cfg = resolve("--model", str(tmp_path), "--dtype", "float16", "--max-num-seqs", "8",
                  "--max-num-batched-tokens", "64", "--block-size", "32", "--platform", "cuda",
                  "--max-model-len", "1024", "--tensor-parallel-size", "2")
    assert cfg.model_config.model == str(tmp_path) and cfg.model_config.dtype is torch.float16
    assert cfg.model_config.max_model_len == 1024
    assert (cfg.scheduler_config.max_num_seqs, cfg.scheduler_config.max_num_batched_tokens) == (8, 64)
    assert cfg.cache_config.block_size == 32 and cfg.platform.name == "cuda"
    assert cfg.parallel_config.tensor_parallel_size == 2
    assert cfg.compilation_config.cudagraph_capture_sizes == [1, 2, 4, 8, 16]


def test_enforce_eager_and_dp():
    cfg = resolve("--enforce-eager", "--data-parallel-size", "2", "--platform", "cuda")
    assert cfg.model_config.enforce_eager and cfg.optimization_level == OptimizationLevel.O0
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert cfg.parallel_config.data_parallel_size == 2
    assert resolve("-dp", "2", "--data-parallel-rank", "1").parallel_config.data_parallel_rank == 1
    moe = resolve("--enable-expert-parallel", "--all2all-backend", "deepep_low_latency", "-dp", "2",
                  "--platform", "cuda")
    assert moe.parallel_config.enable_expert_parallel
    assert moe.parallel_config.all2all_backend == "deepep_low_latency"


def test_dbo_flags():
    dbo = resolve("--enable-expert-parallel", "-dp", "2", "--enable-dbo",
                  "--dbo-decode-token-threshold", "8", "--dbo-prefill-token-threshold", "64")
    pc = dbo.parallel_config
    assert (pc.enable_dbo, pc.use_ubatching, pc.num_ubatches) == (True, True, 2)
    assert (pc.dbo_decode_token_threshold, pc.dbo_prefill_token_threshold) == (8, 64)
    three = resolve("--enable-expert-parallel", "-dp", "2", "--ubatch-size", "3").parallel_config
    assert (three.enable_dbo, three.use_ubatching, three.num_ubatches) == (False, True, 3)
    off = resolve().parallel_config
    assert not off.use_ubatching and off.dbo_decode_token_threshold == 32
    with pytest.raises(ValueError, match="naive is not supported"):
        resolve("-dp", "2", "--enable-dbo", "--all2all-backend", "naive")


def test_defaults_and_limits():
    cfg = resolve()
    assert (cfg.scheduler_config.max_num_seqs, cfg.scheduler_config.max_num_batched_tokens) == (128, 2048)
    assert cfg.platform.name in ("cpu", "cuda") and cfg.model_config.model is None
    big = resolve("--max-num-seqs", "4096")
    assert big.scheduler_config.max_num_batched_tokens == 4096
    small = resolve("--max-num-batched-tokens", "64")
    assert small.scheduler_config.max_num_seqs == 64
    assert resolve(hf=None).model_config.hf_config["num_hidden_layers"] == 4  # the built-in model


def test_platform_cpu_has_no_graphs():
    cc = resolve("--platform", "cpu").compilation_config
    assert cc.cudagraph_mode == CUDAGraphMode.NONE and cc.bs_to_padded_graph_size is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-O7"], "invalid optimization level '7'"),
        (["-Ofast"], "invalid -O value 'fast'"),
        (["-O.mode"], "expected -O.KEY=VALUE"),
        (["-O.=3"], "expected -O.KEY=VALUE"),
        (["-O.a..b=3"], "empty part"),
        (["-cc", "{bad json"], "--compilation-config is not valid JSON"),
        (["-cc", "[1, 2]"], "must be a JSON object"),
        (["-O.nope=1"], "unknown compilation-config key 'nope'"),
        (["-O.pass_config.foo=1"], r"compilation-config\.pass_config\.foo"),
        (["-O.mode=9"], r"compilation-config\.mode"),
        (["-O.cudagraph_mode=BOGUS"], "BOGUS"),
        (["-cc", '{"mode": 0}', "-O.mode.x=1"], "is not an object"),
        (["--max-num-seqs", "4096", "--max-num-batched-tokens", "2048"], "max_num_batched_tokens"),
        (["--model", "/definitely/not/here"], "/definitely/not/here"),
        (["--dtype", "int3"], "unknown dtype 'int3'"),
        (["--platform", "cuda", "-O.cudagraph_capture_sizes=[1,2,4]", "-O.max_cudagraph_capture_size=8"],
         r"max_cudagraph_capture_size\(=8\)"),
    ],
)
def test_errors(argv, message):
    with pytest.raises(ValueError, match=message) as info:
        resolve(*argv)
    assert "\n" not in str(info.value)


def test_model_flags_without_a_model_apply_to_the_builtin_model():
    cfg = resolve("--dtype", "float16", "--enforce-eager", hf=None)
    assert cfg.model_config.model is None and cfg.model_config.dtype is torch.float16
    assert cfg.model_config.enforce_eager


@pytest.mark.parametrize("argv", [["--max-num-seqs", "0"], ["--block-size", "x"], ["--platform", "tpu"],
                                  ["--all2all-backend", "nope"], ["--bogus"]])
def test_argparse_rejects(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2


def test_normalize_argv():
    assert normalize_engine_argv(["-cc.mode=3", "--compilation-config.backend=eager", "-O3", "--", "-cc.x=1"]) == [
        "-O.mode=3", "-O.backend=eager", "-O3", "--", "-cc.x=1"]
    assert normalize_engine_argv(["-cc.mode", "3", "-cc.x", "-1", "-cc.y", "--json", "-cc.z"]) == [
        "-O.mode=3", "-O.x=-1", "-O.y", "--json", "-O.z"]


def test_works_as_subcommand_parser():
    top = argparse.ArgumentParser(prog="t")
    sub = top.add_subparsers(dest="cmd")
    add_engine_args(sub.add_parser("x"))
    ns = top.parse_args(["x", "-cc.mode=1", "-O", "2"])
    assert compilation_overrides_from_args(ns) == (2, {"mode": 1})


def test_chunked_prefill_flag():
    assert resolve().scheduler_config.enable_chunked_prefill
    off = resolve("--no-enable-chunked-prefill").scheduler_config
    assert not off.enable_chunked_prefill and off.max_num_batched_tokens == 4096  # >= max_model_len
    assert resolve("--enable-chunked-prefill").scheduler_config.max_num_batched_tokens == 2048
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) is smaller") as info:
        resolve("--no-enable-chunked-prefill", "--max-num-batched-tokens", "64")
    assert "\n" not in str(info.value)


def test_typed_flags_cover_every_engine_flag():
    """Every flag add_engine_args defines is a typed EngineFlags field (and nothing else is),
    so a new flag cannot reach the config as an untyped namespace probe."""
    import argparse
    import dataclasses

    from forwardkit.commands.engine_flags import add_engine_args
    from forwardkit.commands.flag_config import EngineFlags

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert set(vars(parser.parse_args([]))) == {f.name for f in dataclasses.fields(EngineFlags)}
