"""Fuzz properties of the config layer (hypothesis, bounded time).

* any input to ``CompilationConfig(**d)``, ``CompilationConfig.from_cli``, ``EngineConfig``,
  ``build_engine_config`` and ``forwardkit config`` argv either works or raises ``ValueError``
  (pydantic's ``ValidationError`` is one) -- never ``TypeError``, ``RecursionError``, ...;
* every accepted config prints, serialises to JSON and hashes;
* resolving a resolved config gives the same config, on CPU and on an emulated CUDA platform.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forwardkit.commands.engine_flags import add_engine_args
from forwardkit.commands.flag_config import engine_config_from_args
from forwardkit.config import CompilationConfig, EngineConfig, ModelConfig, build_engine_config
from forwardkit.platforms import CpuPlatform, CudaPlatform

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 2, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
PLATFORMS = {"cpu": CpuPlatform(), "cuda": CudaPlatform(device_capability=90)}
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CC_FIELDS = [f.name for f in dataclasses.fields(CompilationConfig) if f.init]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0, 1, 4, 8, 512, 10**9, 2**70]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.sampled_from(["", "3", "FULL", "NONE", "PIECEWISE", "all", "none", "+rms_norm", "-rms_norm",
                     "inductor", "eager", "aot_eager", "cudagraph_capture_sizes", "os.path.join",
                     "backed", "unbacked", "VLLM_COMPILE"]),
)
json_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(st.sampled_from(["enable_sp", "type", "x", "fuse_gemm_comms",
                                                                      "eliminate_noops", "evaluate_guards",
                                                                      "fi_allreduce_fusion_max_size_mb"]),
                                                     inner, max_size=3)),
    max_leaves=12)


def _deep(depth: int, kind: str):
    value: object = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"x": value}
    return value


deep_values = st.builds(_deep, st.sampled_from([20, 200, 5000]), st.sampled_from(["list", "dict"]))
field_values = st.one_of(json_values, deep_values,
                         st.sampled_from([{"x": object()}, {"x": {1, 2}}, object(), (1, 2), {1: 2}]))
cc_dicts = st.dictionaries(st.sampled_from([*CC_FIELDS, "bogus"]), field_values, max_size=4)

# Valid-looking inputs, for the idempotence property (most of them resolve).
plausible_cc = st.fixed_dictionaries({}, optional={
    "mode": st.sampled_from([0, 1, 2, 3, "VLLM_COMPILE"]),
    "backend": st.sampled_from(["", "eager", "inductor", "aot_eager"]),
    "cudagraph_mode": st.sampled_from(["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]),
    "cudagraph_capture_sizes": st.lists(st.sampled_from([0, 1, 2, 3, 4, 8, 16, 24, 600]), max_size=5),
    "max_cudagraph_capture_size": st.integers(0, 600),
    "compile_sizes": st.lists(st.sampled_from([0, 1, 2, 3, 8, 600, "cudagraph_capture_sizes"]), max_size=3),
    "custom_ops": st.sampled_from([[], ["all"], ["none", "+rms_norm"], ["-rms_norm"], ["+rotary_embedding"]]),
    "splitting_ops": st.sampled_from([None, [], ["forwardkit::unified_attention"]]),
    "compile_ranges_split_points": st.lists(st.integers(1, 4000), max_size=3),
    "pass_config": st.fixed_dictionaries({}, optional={
        "eliminate_noops": st.booleans(), "enable_sp": st.booleans(), "fuse_gemm_comms": st.booleans(),
        "fuse_allreduce_rms": st.booleans(), "enable_qk_norm_rope_fusion": st.booleans(),
        "fi_allreduce_fusion_max_size_mb": st.sampled_from([0.5, 64, 1e9])}),
    "cudagraph_num_of_warmups": st.integers(0, 3),
    "inductor_compile_config": st.sampled_from([{}, {"max_autotune": True}, {"combo_kernels": False}]),
})
engine_kwargs = st.fixed_dictionaries({}, optional={
    "parallel_config": st.fixed_dictionaries({}, optional={
        "tensor_parallel_size": st.sampled_from([1, 2, 4]), "data_parallel_size": st.sampled_from([1, 2]),
        "pipeline_parallel_size": st.sampled_from([1, 2])}),
    "scheduler_config": st.builds(lambda s, extra: {"max_num_seqs": s, "max_num_batched_tokens": s + extra},
                                  st.integers(1, 256), st.integers(0, 4096)),
    "optimization_level": st.sampled_from([0, 1, 2, 3]),
})


def _model(with_model: bool, eager: bool = False) -> ModelConfig | None:
    return ModelConfig(hf_config=LLAMA, enforce_eager=eager) if with_model else None


def _check_usable(cfg: EngineConfig) -> None:
    cc = cfg.compilation_config
    assert repr(cc) and str(cc)
    json.dumps(json.loads(cc.to_json()))
    assert len(cfg.compute_hash()) == 10 and len(cc.compute_hash()) == 64


@FUZZ
@given(cc_dicts, st.sampled_from(sorted(PLATFORMS)), st.booleans())
def test_any_compilation_dict_resolves_or_raises_value_error(d, platform, with_model):
    try:
        cfg = EngineConfig(model_config=_model(with_model), platform=PLATFORMS[platform], compilation_config=d)
    except ValueError as exc:
        assert str(exc)
        return
    _check_usable(cfg)


@FUZZ
@given(st.one_of(st.text(max_size=40), st.builds(json.dumps, json_values),
                 st.builds(lambda n: "[" * n + "]" * n, st.integers(1, 100000)),
                 st.builds(lambda n: '{"compile_sizes": ' + "[" * n + "]" * n + "}", st.integers(1, 5000))))
def test_from_cli_accepts_or_raises_value_error(text):
    try:
        cc = CompilationConfig.from_cli(text)
    except ValueError:
        return
    assert repr(cc) and cc.to_json()


builder_values = st.one_of(json_values, st.sampled_from([object(), b"x", 1.5, -5, "x", [1], {"a": 1}]))
builder_args = st.dictionaries(
    st.sampled_from(["dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                     "enforce_eager", "compilation_config", "optimization_level", "data_parallel_size",
                     "block_size", "num_gpu_blocks", "platform", "tensor_parallel_size", "all2all_backend",
                     "enable_expert_parallel", "data_parallel_rank", "async_scheduling", "default_hf_config"]),
    builder_values, max_size=3)


@FUZZ
@given(builder_args)
def test_build_engine_config_accepts_or_raises_value_error(kwargs):
    kwargs.setdefault("default_hf_config", LLAMA)
    kwargs.setdefault("platform", "cpu")
    try:
        cfg = build_engine_config(**kwargs)
    except ValueError as exc:
        assert str(exc)
        return
    _check_usable(cfg)


argv_tokens = st.sampled_from([
    "-O3", "-O", "3", "-O0", "-O.mode=3", "-O.mode", "-cc.mode", "-cc.mode=x", "-O.cudagraph_mode=FULL",
    "-O.pass_config.enable_sp=true", "-O.pass_config=1", "-O.compile_sizes=[0]", "-O.bogus=1",
    "--compilation-config", '{"mode": 3}', "[1]", "--max-num-seqs", "8", "--max-num-batched-tokens",
    "100000000", "-O.max_cudagraph_capture_size=100000000", "--platform", "cuda", "-O.x.y.z=1", "{",
    "-O.cudagraph_capture_sizes=[1,2,4]", "-tp", "2", "-O.inductor_compile_config={\"a\":1}",
    "-O.compile_sizes=" + "[" * 3000 + "]" * 3000, "-cc", "[" * 3000 + "]" * 3000, "-O.cudagraph_mode",
    "-O.max_cudagraph_capture_size=-1", "--max-num-batched-tokens", "-5",
])


@FUZZ
@given(st.lists(argv_tokens, max_size=6))
def test_config_argv_accepts_or_raises_value_error(argv):
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(parser)
    try:
        ns, _ = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit):
        return  # argparse's own usage errors
    try:
        cfg = engine_config_from_args(ns, default_hf_config=LLAMA)
    except ValueError as exc:
        assert str(exc)
        return
    _check_usable(cfg)


def _resolved(platform: str, with_model: bool, eager: bool, cc, kwargs) -> EngineConfig:
    return EngineConfig(model_config=_model(with_model, eager), platform=PLATFORMS[platform],
                        compilation_config=cc, **json.loads(json.dumps(kwargs)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plausible_cc, engine_kwargs, st.sampled_from(sorted(PLATFORMS)), st.booleans(), st.booleans(),
       st.booleans())
def test_resolution_is_idempotent(cc, kwargs, platform, with_model, eager, as_object):
    """resolve(resolve(x)) == resolve(x), passing the resolved config as a dict or as the object."""
    try:
        first = _resolved(platform, with_model, eager, cc, kwargs)
    except ValueError:
        return
    _check_usable(first)
    resolved = first.compilation_config
    before = resolved.to_dict()
    again_input = resolved if as_object else json.loads(resolved.to_json())
    second = _resolved(platform, with_model, eager, again_input, kwargs)
    assert second.compilation_config.to_dict() == before
    assert second.compute_hash() == first.compute_hash()


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
@pytest.mark.parametrize("cc", [
    {"pass_config": {"enable_sp": True}},
    {"compile_sizes": ["cudagraph_capture_sizes", 3]},
    {"compile_sizes": [2, "cudagraph_capture_sizes"]},
    {"backend": "aot_eager", "mode": 2},
    {"cudagraph_capture_sizes": [1, 2], "cudagraph_mode": "FULL"},
])
def test_known_non_idempotent_cases_are_now_stable(cc, platform):
    first = _resolved(platform, True, False, cc, {})
    second = _resolved(platform, True, False, first.compilation_config.to_dict(), {})
    third = _resolved(platform, True, False, second.compilation_config, {})
    assert second.compilation_config.to_dict() == first.compilation_config.to_dict()
    assert third.compilation_config.to_dict() == first.compilation_config.to_dict()
    assert first.compilation_config.custom_ops.count("+rms_norm") <= 1


@pytest.mark.parametrize("cc, words", [
    ({"cudagraph_capture_sizes": [0]}, ["cudagraph_capture_sizes", "got 0", "1.."]),
    ({"compile_sizes": [0]}, ["compile_sizes", "got 0", ">= 1"]),
    ({"backend": "aot_eager"}, ["backend='aot_eager'", "VLLM_COMPILE", "'eager' or 'inductor'"]),
    ({"max_cudagraph_capture_size": 10**8}, ["max_cudagraph_capture_size", "100000000", "<="]),
    ({"splitting_ops": ["nonsense"]}, ["splitting_ops", "'nonsense'", "namespace::op"]),
    ({"compile_sizes": _deep(5000, "list")}, ["compile_sizes", "nested deeper than"]),
    ({"inductor_compile_config": {"x": object()}}, ["inductor_compile_config['x']", "JSON values"]),
    ({"pass_config": {"fi_allreduce_fusion_max_size_mb": float("inf")}},
     ["fi_allreduce_fusion_max_size_mb", "inf", "finite"]),
])
def test_rejected_inputs_name_the_field_value_and_what_is_accepted(cc, words):
    with pytest.raises(ValueError) as info:
        EngineConfig(model_config=_model(True), platform=PLATFORMS["cuda"], compilation_config=cc)
    for word in words:
        assert word in str(info.value)


def test_rejected_resolution_leaves_the_given_configs_unchanged():
    cc = CompilationConfig(pass_config={"fuse_attn_quant": True}, cudagraph_mode="FULL",
                           splitting_ops=list(CompilationConfig.ATTENTION_OPS))
    before = (cc.to_dict(), list(cc.custom_ops), cc.mode, cc.cudagraph_capture_sizes)
    with pytest.raises(ValueError, match="attention ops should not be in splitting_ops"):
        EngineConfig(model_config=_model(True), platform=PLATFORMS["cuda"], compilation_config=cc)
    assert (cc.to_dict(), list(cc.custom_ops), cc.mode, cc.cudagraph_capture_sizes) == before


def test_capture_sizes_all_above_the_token_budget_are_refused():
    """Found by the idempotence property: the sizes were dropped, graphs stayed on, and the
    resolved config could not be resolved again."""
    with pytest.raises(ValueError, match=r"cudagraph_capture_sizes \[2\] are all above max_num_batched_tokens=1"):
        _resolved("cuda", True, False, {"cudagraph_capture_sizes": [2]},
                  {"scheduler_config": {"max_num_seqs": 1, "max_num_batched_tokens": 1}})
