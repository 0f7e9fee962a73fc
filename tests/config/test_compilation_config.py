"""CompilationConfig / PassConfig / hash helpers: construction, normalisation, methods."""

from __future__ import annotations

import json
import logging
import os.path
from collections import Counter
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from forwardkit.config.compilation import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    PassConfig,
    Range,
)
from forwardkit.config.pass_config import CallablePass
from forwardkit.config.utils import (
    assert_hashable,
    contains_object_print,
    get_field,
    get_hash_factors,
    getattr_iter,
    handle_deprecated,
    hash_factors,
    normalize_value,
    update_config,
)

ATTN = list(CompilationConfig.ATTENTION_OPS)
S256 = [1, 2, 4, *range(8, 257, 8)]
S512 = [*S256, *range(272, 513, 16)]
M = CUDAGraphMode


@pytest.fixture
def fk_logs():
    """Records of the ``forwardkit`` logger (it does not propagate to the root logger)."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    from forwardkit.logger import _log_once

    _log_once.cache_clear()  # so *_once messages logged by earlier tests show up again
    handler = _Keep(level=logging.DEBUG)
    root = logging.getLogger("forwardkit")
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield records
    root.removeHandler(handler)
    root.setLevel(old_level)


def _messages(records: list[logging.LogRecord]) -> str:
    return "\n".join(r.getMessage() for r in records)


# ---------------------------------------------------------------- construction


def test_defaults_on_cuda(cuda_platform):
    c = CompilationConfig()
    assert c.mode is None and c.cudagraph_mode is None
    assert c.backend == "inductor"
    assert c.custom_ops == [] and c.splitting_ops is None and c.compile_sizes is None
    assert c.use_inductor_graph_partition is None
    assert c.inductor_compile_config == {
        "enable_auto_functionalized_v2": False,
        "combo_kernels": True,
        "benchmark_combo_kernel": True,
    }
    pc = c.pass_config
    flags = [pc.fuse_norm_quant, pc.fuse_act_quant, pc.fuse_attn_quant, pc.eliminate_noops,
             pc.enable_sp, pc.fuse_gemm_comms, pc.fuse_allreduce_rms]
    assert flags == [None] * 7
    assert pc.enable_qk_norm_rope_fusion is False
    assert c.compile_cache_save_format == "binary"
    assert c.static_forward_context == {} and c.bs_to_padded_graph_size is None
    assert c.enabled_custom_ops == Counter() and c.traced_files == set()


def test_defaults_on_cpu_have_no_combo_kernels(cpu_platform):
    assert CompilationConfig().inductor_compile_config == {"enable_auto_functionalized_v2": False}


def test_repr_of_default_matches_reference(cuda_platform):
    expected = (
        "{'level': None, 'mode': None, 'debug_dump_path': None, 'cache_dir': '', "
        "'compile_cache_save_format': 'binary', 'backend': 'inductor', 'custom_ops': [], "
        "'splitting_ops': None, 'compile_mm_encoder': False, 'compile_sizes': None, "
        "'compile_ranges_split_points': None, 'inductor_compile_config': "
        "{'enable_auto_functionalized_v2': False, 'combo_kernels': True, 'benchmark_combo_kernel': True}, "
        "'inductor_passes': {}, 'cudagraph_mode': None, 'cudagraph_num_of_warmups': 0, "
        "'cudagraph_capture_sizes': None, 'cudagraph_copy_inputs': False, "
        "'cudagraph_specialize_lora': True, 'use_inductor_graph_partition': None, "
        "'pass_config': {}, 'max_cudagraph_capture_size': None, 'dynamic_shapes_config': "
        "{'type': <DynamicShapesType.BACKED: 'backed'>, 'evaluate_guards': False, "
        "'assume_32_bit_indexing': True}, 'local_cache_dir': None}"
    )
    c = CompilationConfig()
    assert repr(c) == expected == str(c)


def test_repr_shows_changed_pass_flags_and_hides_runtime_state():
    c = CompilationConfig(mode=3, pass_config={"enable_sp": True})
    c.static_forward_context["layer"] = object()
    c.inductor_compile_config["post_grad_custom_post_pass"] = object()
    text = repr(c)
    assert "'pass_config': {'enable_sp': True}" in text
    assert "'mode': <CompilationMode.VLLM_COMPILE: 3>" in text
    for hidden in ("static_forward_context", "enabled_custom_ops", "compilation_time",
                   "bs_to_padded_graph_size", "traced_files", "post_grad_custom_post_pass"):
        assert hidden not in text


@pytest.mark.parametrize(
    "value, expected",
    [("vllm_compile", 3), ("Stock_Torch_Compile", 1), (True, 1), (2, 2), ("none", 0), (None, None)],
)
def test_mode_parsing(value, expected):
    mode = CompilationConfig(mode=value).mode
    assert mode == expected
    assert mode is None or isinstance(mode, CompilationMode)


def test_level_is_deprecated_alias(fk_logs):
    c = CompilationConfig(level=3)
    assert c.mode is CompilationMode.VLLM_COMPILE and c.mode == 3  # fix: converted to the enum
    assert CompilationConfig(level=0, mode=3).mode is CompilationMode.VLLM_COMPILE
    assert "deprecated" in _messages(fk_logs)


@pytest.mark.parametrize(
    "kwargs, field, fragments",
    [
        ({"mode": "3"}, "mode", ["Invalid compilation mode: 3", "VLLM_COMPILE"]),
        ({"mode": 5}, "mode", ["5", "VLLM_COMPILE"]),
        ({"level": 7}, "level", ["7", "VLLM_COMPILE"]),
        ({"cudagraph_mode": "bogus"}, "cudagraph_mode", ["'bogus'", "FULL_AND_PIECEWISE"]),
        ({"cudagraph_mode": [2, 1]}, "cudagraph_mode", ["[2, 1]", "(2, 1)"]),
        ({"compile_cache_save_format": "zip"}, "compile_cache_save_format", ["'zip'", "'binary'", "'unpacked'"]),
        ({"custom_ops": ["all", "none"]}, "custom_ops", ["Can only specify 'none' or 'all'"]),
        ({"custom_ops": ["all", "all"]}, "custom_ops", ["Can only specify 'none' or 'all'"]),
        ({"custom_ops": ["rms_norm"]}, "custom_ops", ["Invalid syntax 'rms_norm' for custom op", "'+op'"]),
        ({"custom_ops": [""]}, "custom_ops", ["Invalid syntax '' for custom op"]),
        ({"custom_ops": ["ALL"]}, "custom_ops", ["Invalid syntax 'ALL'"]),
        ({"backend": "foo", "mode": 3}, "backend", ["Invalid backend for piecewise compilation: foo", "'inductor'"]),
        ({"pass_config": {"nope": True}}, "pass_config", ["nope", "Unexpected keyword argument"]),
        ({"pass_config": {"enable_sp": "maybe"}}, "pass_config", ["enable_sp", "maybe"]),
        ({"inductor_passes": {"p": "len"}}, "inductor_passes", ["'len'", "module.function"]),
        ({"inductor_passes": {"p": "no_such_mod_xyz.f"}}, "inductor_passes", ["no_such_mod_xyz"]),
        ({"inductor_passes": {"p": "os.path.no_such_fn"}}, "inductor_passes", ["no_such_fn"]),
        ({"inductor_passes": {"p": len}}, "inductor_passes", ["valid string"]),
        ({"cudagraph_capture_sizes": [4, -1]}, "cudagraph_capture_sizes", ["-1", "1..65536"]),
        ({"cudagraph_capture_sizes": [0]}, "cudagraph_capture_sizes", ["got 0", "1..65536"]),
        ({"compile_sizes": [0]}, "compile_sizes", ["got 0", ">= 1"]),
        ({"compile_sizes": ["x"]}, "compile_sizes", ["'x'", "'cudagraph_capture_sizes'"]),
        ({"max_cudagraph_capture_size": -5}, "max_cudagraph_capture_size", ["-5", ">= 0"]),
        ({"cudagraph_num_of_warmups": -1}, "cudagraph_num_of_warmups", ["-1", ">= 0"]),
        ({"nope": 1}, "nope", ["Unexpected keyword argument"]),
        ({"bs_to_padded_graph_size": [0]}, "bs_to_padded_graph_size", ["Unexpected keyword argument"]),
    ],
)
def test_invalid_input_names_field_and_value(kwargs, field, fragments):
    with pytest.raises(ValueError) as info:
        CompilationConfig(**kwargs)
    text = str(info.value)
    assert field in text
    for fragment in fragments:
        assert fragment in text
    assert not isinstance(info.value, (KeyError, IndexError))


@pytest.mark.parametrize(
    "value, expected",
    [("full_and_piecewise", M.FULL_AND_PIECEWISE), (2, M.FULL), ((2, 1), M.FULL_AND_PIECEWISE),
     ("NONE", M.NONE), (None, None)],
)
def test_cudagraph_mode_field(value, expected):
    assert CompilationConfig(cudagraph_mode=value).cudagraph_mode is expected


def test_custom_ops_bare_signs_accepted():
    assert CompilationConfig(custom_ops=["+", "-"]).custom_ops == ["+", "-"]


@pytest.mark.parametrize("mode", [None, 1, 2])
def test_backend_free_outside_piecewise(mode):
    assert CompilationConfig(backend="foo", mode=mode).backend == "foo"


def test_empty_backend_becomes_platform_default():
    assert CompilationConfig(backend="").backend == "inductor"
    assert CompilationConfig(backend="eager", mode=3).backend == "eager"


def test_save_format_from_env(monkeypatch):
    monkeypatch.setenv("FORWARDKIT_COMPILE_CACHE_SAVE_FORMAT", "unpacked")
    assert CompilationConfig().compile_cache_save_format == "unpacked"
    monkeypatch.setenv("FORWARDKIT_COMPILE_CACHE_SAVE_FORMAT", "zip")
    with pytest.raises(ValueError, match="Invalid value 'zip' for FORWARDKIT_COMPILE_CACHE_SAVE_FORMAT"):
        CompilationConfig()
    assert CompilationConfig(compile_cache_save_format="binary").compile_cache_save_format == "binary"


def test_pass_config_from_dict():
    c = CompilationConfig(pass_config={"enable_sp": True})
    assert isinstance(c.pass_config, PassConfig)
    assert c.pass_config.enable_sp is True and c.pass_config.fuse_norm_quant is None
    assert CompilationConfig(pass_config='{"eliminate_noops": "yes"}').pass_config.eliminate_noops is True


@pytest.mark.parametrize("raw, expected", [("true", True), ("off", False), (1, True), ("0", False)])
def test_pass_config_lenient_bool(raw, expected):
    assert PassConfig(enable_sp=raw).enable_sp is expected


def test_pass_config_fi_size_parsing():
    assert PassConfig(fi_allreduce_fusion_max_size_mb="1").fi_allreduce_fusion_max_size_mb == 1.0
    with pytest.raises(ValidationError, match="fi_allreduce_fusion_max_size_mb"):
        PassConfig(fi_allreduce_fusion_max_size_mb=-1)


def test_qk_norm_rope_fusion_cleared_off_cuda(cpu_platform, fk_logs):
    c = CompilationConfig(pass_config={"enable_qk_norm_rope_fusion": True})
    assert c.pass_config.enable_qk_norm_rope_fusion is False
    assert c.custom_ops == []


def test_qk_norm_rope_fusion_on_cuda(cuda_platform):
    c = CompilationConfig(pass_config={"enable_qk_norm_rope_fusion": True})
    assert c.pass_config.enable_qk_norm_rope_fusion is True
    assert c.custom_ops == ["+rotary_embedding"]
    # Fix: rebuilding from its own dict does not add a second "+rotary_embedding".
    assert CompilationConfig(**c.to_dict()).custom_ops == ["+rotary_embedding"]


def test_pass_config_warnings_without_noop_elimination(fk_logs):
    PassConfig(fuse_norm_quant=True, fuse_attn_quant=True, fuse_allreduce_rms=True, eliminate_noops=False)
    text = _messages(fk_logs)
    assert "RMSNorm/SiluMul" in text and "Attention + quant" in text and "Allreduce" in text


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"enable_auto_functionalized_v2": True, "combo_kernels": False},
         {"enable_auto_functionalized_v2": True, "combo_kernels": False}),
        ({"benchmark_combo_kernel": False},
         {"benchmark_combo_kernel": False, "enable_auto_functionalized_v2": False}),
        ({"a": 1},
         {"a": 1, "enable_auto_functionalized_v2": False, "combo_kernels": True, "benchmark_combo_kernel": True}),
    ],
)
def test_inductor_compile_config_defaults(cuda_platform, given, expected):
    c = CompilationConfig(inductor_compile_config=given)
    assert c.inductor_compile_config == expected
    assert list(c.inductor_compile_config) == list(expected)  # user keys first


def test_inductor_passes_resolve_with_importlib():
    # Fix: the reference raised KeyError('join') for a nested module path.
    c = CompilationConfig(inductor_passes={"p": "os.path.join"})
    p = c.inductor_compile_config["p"]
    assert isinstance(p, CallablePass) and p.fn is os.path.join
    assert len(p.uuid()) == 64
    assert c == CompilationConfig(inductor_passes={"p": "os.path.join"})


def test_graph_partition_on_new_torch():
    assert torch.__version__ >= "2.9.0.dev"
    assert CompilationConfig(use_inductor_graph_partition=True).use_inductor_graph_partition is True


# ---------------------------------------------------------------- dict / JSON round trips


def test_dict_and_json_round_trip():
    c = CompilationConfig(
        mode="VLLM_COMPILE", cudagraph_mode="FULL_DECODE_ONLY", debug_dump_path="dump",
        custom_ops=["+rms_norm"], splitting_ops=["a::b"], compile_sizes=[1, "cudagraph_capture_sizes"],
        compile_ranges_split_points=[8, 64], cudagraph_capture_sizes=[1, 2, 4],
        max_cudagraph_capture_size=4, pass_config={"enable_sp": True, "fi_allreduce_fusion_max_size_mb": 0.5},
        dynamic_shapes_config={"type": "unbacked"}, inductor_passes={"p": "os.path.join"},
    )
    d = c.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert CompilationConfig(**d) == c
    assert CompilationConfig(**json.loads(c.to_json())) == c
    assert CompilationConfig.from_cli(c.to_json()) == c
    assert TypeAdapter(CompilationConfig).validate_json(c.to_json()) == c
    assert TypeAdapter(CompilationConfig).validate_python(d) == c
    assert isinstance(c.debug_dump_path, Path)


@pytest.mark.parametrize("text, mode", [("3", 3), ("0", 0), ("vllm_compile", 3), ('{"mode": 2}', 2)])
def test_from_cli(text, mode):
    assert CompilationConfig.from_cli(text).mode == mode


@pytest.mark.parametrize("text, fragment", [("{bad", "Invalid JSON"), ("[1]", "JSON object"), ("7", "7")])
def test_from_cli_errors(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        CompilationConfig.from_cli(text)


# ---------------------------------------------------------------- methods


@pytest.mark.parametrize(
    "sizes, max_size, table",
    [
        ([1, 2, 4, 8], 8, [0, 1, 2, 4, 4, 8, 8, 8, 8]),
        ([1, 2, 4, 8, 16], 16, [0, 1, 2, 4, 4, 8, 8, 8, 8, *[16] * 8]),
        ([4], 4, [0, 4, 4, 4, 4]),
        ([], 0, [0]),
        ([3, 6], 6, [0, 3, 3, 3, 6, 6, 6]),
        ([1, 2, 4], 8, [0, 1, 2, 4, 4, 9, 9, 9, 9]),
        ([8, 1, 4, 2], 8, [0, 1, 2, 4, 4, 8, 8, 8, 8]),  # fix: unsorted input is sorted
    ],
)
def test_compute_bs_to_padded_graph_size(sizes, max_size, table):
    c = CompilationConfig(cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=max_size)
    c.compute_bs_to_padded_graph_size()
    assert c.bs_to_padded_graph_size == table


def test_padding_table_errors():
    c = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8], max_cudagraph_capture_size=4)
    with pytest.raises(IndexError, match="8"):
        c.compute_bs_to_padded_graph_size()
    c = CompilationConfig(cudagraph_capture_sizes=[1, 2])
    with pytest.raises(TypeError, match="max_cudagraph_capture_size"):
        c.compute_bs_to_padded_graph_size()


def test_post_init_cudagraph_sizes_sorts_and_builds_table():
    c = CompilationConfig(cudagraph_capture_sizes=[4, 1, 2], max_cudagraph_capture_size=4)
    sizes = c.cudagraph_capture_sizes
    c.post_init_cudagraph_sizes()
    assert c.cudagraph_capture_sizes == [1, 2, 4] and c.cudagraph_capture_sizes is sizes
    assert c.compile_sizes == []
    assert c.bs_to_padded_graph_size == [0, 1, 2, 4, 4]


@pytest.mark.parametrize(
    "compile_sizes, expected",
    [
        ([8, 4, 8], [4, 8]),
        ([4, "cudagraph_capture_sizes"], [1, 2, 4]),  # no duplicate 4 (unlike the reference)
        (["cudagraph_capture_sizes"] * 2, [1, 2, 4]),
        (None, []),
    ],
)
def test_post_init_compile_sizes(compile_sizes, expected):
    c = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4], max_cudagraph_capture_size=4,
                          compile_sizes=compile_sizes)
    c.post_init_cudagraph_sizes()
    assert sorted(c.compile_sizes) == expected


def test_post_init_cudagraph_sizes_errors():
    c = CompilationConfig(cudagraph_capture_sizes=[4, 1, 2], max_cudagraph_capture_size=8)
    with pytest.raises(AssertionError, match="max_cudagraph_capture_size"):
        c.post_init_cudagraph_sizes()
    assert c.cudagraph_capture_sizes == [4, 1, 2] and c.bs_to_padded_graph_size is None  # untouched
    with pytest.raises(AttributeError, match="cudagraph_capture_sizes is None"):
        CompilationConfig().post_init_cudagraph_sizes()
    c = CompilationConfig(cudagraph_capture_sizes=[1], max_cudagraph_capture_size=1)
    c.compile_sizes = ["x"]  # rejected at construction; set afterwards the method still checks
    with pytest.raises(
        AssertionError,
        match="Unrecognized size type in compile_sizes, expect 'cudagraph_capture_sizes', got x",
    ):
        c.post_init_cudagraph_sizes()
    assert c.compile_sizes == ["x"]


@pytest.mark.parametrize(
    "points, ranges",
    [
        (None, []),
        ([], []),
        ([2048], [(1, 2048)]),
        ([8, 2048], [(1, 8), (9, 2048)]),
        ([2048, 8, 8, 512], [(1, 8), (9, 512), (513, 2048)]),
        ([1, 2], [(1, 1), (2, 2)]),
        ([0, 5], [(1, 0), (1, 5)]),
        ([4, 16, 512, 512, 2048], [(1, 4), (5, 16), (17, 512), (513, 2048)]),
    ],
)
def test_get_compile_ranges(points, ranges):
    got = CompilationConfig(compile_ranges_split_points=points).get_compile_ranges()
    assert got == [Range(a, b) for a, b in ranges]


S256_Q3 = [3, 6, 9, 18, 24, 33, 42, 48, 57, 66, 72, 81, 90, 96, 105, 114, 120, 129, 138,
           144, 153, 162, 168, 177, 186, 192, 201, 210, 216, 225, 234, 240, 249]
S512_Q3 = [*S256_Q3, 258, 273, 288, 306, 321, 336, 354, 369, 384, 402, 417, 432, 450,
           465, 480, 498]


@pytest.mark.parametrize(
    "sizes, max_size, q, tp, sp, expected, expected_max",
    [
        (S256, 256, 4, 1, None, [4, *range(8, 257, 8)], 256),
        (S256, 256, 3, 1, None, S256_Q3, 249),
        (S512, 512, 3, 1, None, S512_Q3, 498),
        ([1, 2, 4, 8], 8, 2, 1, None, [2, 4, 8], 8),
        ([1, 2, 4, 8], 8, 3, 1, None, [3, 6], 6),
        ([1, 2, 4, 8], 8, 1, 1, None, [1, 2, 4, 8], 8),
        ([5], 5, 4, 1, None, [4], 4),
        ([], 0, 4, 1, None, [], 0),
        ([1, 2, 4, 8], 8, 2, 4, True, [4, 8], 8),
        ([1, 2, 4, 8], 8, 4, 2, True, [4, 8], 8),
        ([1, 2, 4, 8], 8, 1, 2, True, [2, 4, 8], 8),
        ([2, 4, 8, 16], 16, 1, 8, True, [8, 16], 16),
        ([1, 2, 4, 8], 8, 2, 4, False, [2, 4, 8], 8),
        ([1, 2, 4, 8, 16], 16, 5, 1, None, [5, 10], 10),
    ],
)
def test_adjust_cudagraph_sizes_for_spec_decode(sizes, max_size, q, tp, sp, expected, expected_max):
    c = CompilationConfig(cudagraph_capture_sizes=list(sizes), max_cudagraph_capture_size=max_size,
                          pass_config={"enable_sp": sp})
    c.compute_bs_to_padded_graph_size()
    c.adjust_cudagraph_sizes_for_spec_decode(q, tp)
    assert c.cudagraph_capture_sizes == expected
    assert c.max_cudagraph_capture_size == expected_max
    assert len(c.bs_to_padded_graph_size) == expected_max + 1
    if expected == S256_Q3:
        assert c.bs_to_padded_graph_size[:10] == [0, 3, 3, 3, 6, 6, 6, 9, 9, 9]


def test_adjust_spec_decode_errors():
    c = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8], max_cudagraph_capture_size=8)
    with pytest.raises(ValueError) as info:
        c.adjust_cudagraph_sizes_for_spec_decode(16, 1)
    for fragment in ("multiple of 16", "num_speculative_tokens (15)", "max_cudagraph_capture_size (8)",
                     "cudagraph_capture_sizes ([1, 2, 4, 8])"):
        assert fragment in str(info.value)
    c = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8], max_cudagraph_capture_size=8,
                          pass_config={"enable_sp": True})
    with pytest.raises(ValueError, match="both a multiple of 3 .* and 2"):
        c.adjust_cudagraph_sizes_for_spec_decode(3, 2)
    assert c.cudagraph_capture_sizes == [1, 2, 4, 8]


def _cfg(mode=3, cg=M.FULL_AND_PIECEWISE, splitting=None, **kw):
    return CompilationConfig(mode=mode, cudagraph_mode=cg, splitting_ops=splitting, **kw)


@pytest.mark.parametrize(
    "kwargs, all2all, dp, splitting, cg",
    [
        (dict(mode=None, cg=None), "allgather_reducescatter", 1, [], None),
        (dict(mode=0, cg=None), "allgather_reducescatter", 1, [], None),
        (dict(mode=0, cg=None, splitting=["x"]), "allgather_reducescatter", 1, ["x"], None),
        (dict(mode=1, cg=M.FULL), "deepep_high_throughput", 2, [], M.FULL),
        (dict(), "allgather_reducescatter", 1, ATTN, M.FULL_AND_PIECEWISE),
        (dict(splitting=[], cg=M.PIECEWISE), "allgather_reducescatter", 1, [], M.NONE),
        (dict(splitting=[]), "allgather_reducescatter", 1, [], M.FULL),
        (dict(splitting=[], cg=M.FULL_DECODE_ONLY), "allgather_reducescatter", 1, [], M.FULL_DECODE_ONLY),
        (dict(pass_config={"fuse_attn_quant": True}), "allgather_reducescatter", 1, [], M.FULL),
        (dict(pass_config={"fuse_attn_quant": True}, cg=M.PIECEWISE), "allgather_reducescatter", 1, [], M.FULL),
        (dict(pass_config={"fuse_attn_quant": True}, cg=M.FULL_DECODE_ONLY), "allgather_reducescatter", 1,
         [], M.FULL_DECODE_ONLY),
        (dict(pass_config={"fuse_attn_quant": True}, cg=M.PIECEWISE, splitting=[ATTN[0]]),
         "allgather_reducescatter", 1, [ATTN[0]], M.PIECEWISE),
        (dict(pass_config={"fuse_attn_quant": True}, use_inductor_graph_partition=True),
         "allgather_reducescatter", 1, ATTN, M.FULL_AND_PIECEWISE),
        (dict(), "deepep_high_throughput", 2, ATTN, M.NONE),
        (dict(), "deepep_high_throughput", 1, ATTN, M.FULL_AND_PIECEWISE),
        (dict(), "deepep_low_latency", 2, ATTN, M.FULL_AND_PIECEWISE),
    ],
)
def test_set_splitting_ops_for_v1(kwargs, all2all, dp, splitting, cg):
    c = _cfg(**kwargs)
    c.set_splitting_ops_for_v1(all2all, dp)
    assert c.splitting_ops == splitting
    assert c.cudagraph_mode is cg


def test_set_splitting_ops_gives_a_copy():
    c = _cfg()
    c.set_splitting_ops_for_v1("allgather_reducescatter")
    c.splitting_ops.append("x")
    assert "x" not in CompilationConfig.ATTENTION_OPS and _cfg().splitting_ops is None


def test_attn_fusion_errors():
    c = _cfg(splitting=list(ATTN), pass_config={"fuse_attn_quant": True})
    with pytest.raises(AssertionError, match="attention ops should not be in splitting_ops when fuse_attn_quant"):
        c.set_splitting_ops_for_v1("allgather_reducescatter")
    c = _cfg(cg=None, pass_config={"fuse_attn_quant": True})
    with pytest.raises(AttributeError, match="cudagraph_mode is None"):
        c.set_splitting_ops_for_v1("allgather_reducescatter")
    with pytest.raises(AssertionError, match="fuse_attn_quant"):
        _cfg().set_splitting_ops_for_attn_fusion()


@pytest.mark.parametrize(
    "splitting, mode, kw, contains, piecewise",
    [
        (None, 3, {}, False, False),
        (ATTN, 3, {}, True, True),
        ([*ATTN, "x::y"], 3, {}, True, True),
        (ATTN[:-1], 3, {}, False, False),
        (ATTN, 1, {}, True, False),
        (ATTN, None, {}, True, False),
        (ATTN, 1, {"use_inductor_graph_partition": True}, True, True),
        (ATTN, 0, {"use_inductor_graph_partition": True}, True, False),
        (ATTN, None, {"use_inductor_graph_partition": True}, True, True),
        (ATTN, 3, {"use_inductor_graph_partition": True, "backend": "eager"}, True, False),
    ],
)
def test_attention_splitting_queries(splitting, mode, kw, contains, piecewise):
    c = CompilationConfig(splitting_ops=splitting, mode=mode, **kw)
    assert c.splitting_ops_contain_attention() is contains
    assert c.is_attention_compiled_piecewise() is piecewise


@pytest.mark.parametrize(
    "ops, enabled",
    [(["all"], True), (["all", "-rms_norm"], False), (["none"], False), (["none", "+rms_norm"], True)],
)
def test_is_custom_op_enabled(ops, enabled):
    assert CompilationConfig(custom_ops=ops).is_custom_op_enabled("rms_norm") is enabled


@pytest.mark.parametrize("ops", [["-rms_norm", "all", "+rms_norm"], ["+rms_norm", "none", "-rms_norm"]])
def test_is_custom_op_enabled_refuses_contradictions(ops):
    # vLLM answers these lists one way here and asserts in CustomOp; forwardkit has one rule.
    with pytest.raises(ValueError, match="both enables and disables 'rms_norm'"):
        CompilationConfig(custom_ops=ops).is_custom_op_enabled("rms_norm")


@pytest.mark.parametrize("ops", [["+rms_norm"], []])
def test_is_custom_op_enabled_needs_all_or_none(ops):
    with pytest.raises(AssertionError, match="'all' or 'none'"):
        CompilationConfig(custom_ops=ops).is_custom_op_enabled("rms_norm")


def test_custom_op_log_check(fk_logs):
    c = CompilationConfig(custom_ops=["none", "+rms_norm", "-made_up_op_xyz"])
    assert c.custom_op_log_check() is None  # nothing counted: only a debug line
    assert "No custom ops found" in _messages(fk_logs)
    assert not [r for r in fk_logs if r.levelno >= logging.WARNING]
    c.enabled_custom_ops["rms_norm"] += 1
    c.disabled_custom_ops["silu_and_mul"] += 1
    c.custom_op_log_check()
    warnings = _messages([r for r in fk_logs if r.levelno >= logging.WARNING])
    assert "made_up_op_xyz" in warnings and "no effect" in warnings and "disabling" in warnings
    assert "rms_norm" not in warnings  # present in the model: no warning


@pytest.mark.parametrize(
    "mb, world, expected",
    [(0.5, 1, None), (0.5, 2, 524288), (0.5, 3, None), (0.5, 4, 524288), (0.5, 8, 524288),
     (0.5, 16, None), (64, 2, 67108864), (0.0625, 4, 65536), (1e-7, 4, 0)],
)
def test_flashinfer_max_size(mb, world, expected):
    assert PassConfig(fi_allreduce_fusion_max_size_mb=mb).flashinfer_max_size(world) == expected


def test_flashinfer_default_table(cpu_platform):
    assert PassConfig.default_fi_allreduce_fusion_max_size_mb() == {}
    from forwardkit.platforms import CudaPlatform, use_platform

    with use_platform(CudaPlatform(device_capability=90)):
        assert PassConfig.default_fi_allreduce_fusion_max_size_mb() == {2: 64, 4: 2, 8: 0.5}
        assert PassConfig().flashinfer_max_size(8) == 524288
    with use_platform(CudaPlatform(device_capability=80)):
        assert PassConfig().flashinfer_max_size(2) is None


def test_init_backend():
    with pytest.raises(ValueError, match="mode is None"):
        CompilationConfig().init_backend(None)
    with pytest.raises(ValueError, match="No compilation mode is set."):
        CompilationConfig(mode=0).init_backend(None)
    assert CompilationConfig(mode=1, backend="inductor").init_backend(None) == "inductor"
    assert CompilationConfig(mode=2, backend="eager").init_backend(None) == "eager"
    assert CompilationConfig(mode=1, backend="os.path.join").init_backend(None) is os.path.join
    with pytest.raises(ValueError, match="nope_backend"):
        CompilationConfig(mode=1, backend="nope_backend").init_backend(None)


def test_init_backend_mode_3_builds_the_registered_piecewise_backend():
    from forwardkit.compilation.backend import ForwardkitBackend
    from forwardkit.config import EngineConfig

    cfg = EngineConfig(compilation_config={"mode": 3, "backend": "eager"})
    assert isinstance(cfg.compilation_config.init_backend(cfg), ForwardkitBackend)


# ---------------------------------------------------------------- hashing


def test_compute_hash_ignores_runtime_and_paths():
    base = CompilationConfig().compute_hash()
    assert len(base) == 64
    for kwargs in ({"cache_dir": "/x"}, {"debug_dump_path": "/y"}):
        assert CompilationConfig(**kwargs).compute_hash() == base
    c = CompilationConfig()
    c.compilation_time = 3.0
    c.traced_files.add("a.py")
    c.static_forward_context["l"] = object()
    c.bs_to_padded_graph_size = [0, 1]
    c.local_cache_dir = "/z"
    assert c.compute_hash() == base


@pytest.mark.parametrize(
    "kwargs",
    [{"mode": 3}, {"cudagraph_capture_sizes": [1, 2]}, {"cudagraph_num_of_warmups": 1},
     {"compile_cache_save_format": "unpacked"}, {"pass_config": {"enable_sp": False}},
     {"cudagraph_specialize_lora": False}, {"compile_mm_encoder": True},
     {"dynamic_shapes_config": {"evaluate_guards": True}}, {"cudagraph_mode": "FULL"}],
)
def test_compute_hash_changes(kwargs):
    assert CompilationConfig(**kwargs).compute_hash() != CompilationConfig().compute_hash()


def test_compute_hash_ignores_custom_op_counters():
    # Deliberate difference: the reference hashes the counters filled while the model is
    # built, so the hash printed before building differed from the engine's afterwards.
    c = CompilationConfig()
    before = c.compute_hash()
    c.enabled_custom_ops["rms_norm"] += 1
    c.disabled_custom_ops["silu_and_mul"] += 2
    assert c.compute_hash() == before


def test_hash_factors_of_default(cuda_platform):
    from forwardkit.config.compilation_methods import _HASH_IGNORED

    c = CompilationConfig()
    factors = get_hash_factors(c, _HASH_IGNORED)
    factors["pass_config"] = c.pass_config.compute_hash()
    factors["dynamic_shapes_config"] = c.dynamic_shapes_config.compute_hash()
    decoded = json.loads(json.dumps(factors, sort_keys=True))
    assert decoded["inductor_compile_config"] == [
        ["benchmark_combo_kernel", True], ["combo_kernels", True], ["enable_auto_functionalized_v2", False]
    ]
    assert sorted(decoded) == sorted([
        "backend", "compile_cache_save_format", "compile_mm_encoder", "compile_ranges_split_points",
        "compile_sizes", "cudagraph_capture_sizes", "cudagraph_copy_inputs", "cudagraph_mode",
        "cudagraph_num_of_warmups", "cudagraph_specialize_lora", "custom_ops",
        "dynamic_shapes_config", "inductor_compile_config", "inductor_passes",
        "level", "max_cudagraph_capture_size", "mode", "pass_config", "splitting_ops",
        "use_inductor_graph_partition"])
    assert decoded["backend"] == "inductor" and decoded["custom_ops"] == [] and decoded["mode"] is None
    assert decoded["cudagraph_specialize_lora"] is True
    assert len(decoded["pass_config"]) == 64
    assert hash_factors(factors) == c.compute_hash()


@pytest.mark.parametrize(
    "value, expected",
    [
        (M.FULL_AND_PIECEWISE, ("forwardkit.config.compilation_enums.CUDAGraphMode", (2, 1))),
        (CompilationMode.VLLM_COMPILE, 3),
        ({"b": 1, "a": [1, 2]}, (("a", (1, 2)), ("b", 1))),
        ({3, 1, 2}, ("1", "2", "3")),
        (b"\x01\xff", "01ff"),
        (int, "builtins.int"),
        (Counter(b=2, a=1), (("a", 1), ("b", 2))),
        (torch.float16, "torch.float16"),
        (None, None),
        (True, True),
        (1.5, 1.5),
    ],
)
def test_normalize_value(value, expected):
    got = normalize_value(value)
    assert got == expected
    assert type(got) is type(expected)


def test_normalize_value_special_cases(tmp_path):
    from forwardkit.config.compilation import DynamicShapesType

    assert normalize_value(DynamicShapesType.BACKED) == "backed"
    assert normalize_value(tmp_path / "x") == str((tmp_path / "x").resolve())
    name, items = normalize_value(Range(1, 2))
    assert name.endswith("Range") and items == (("end", 2), ("start", 1))
    with pytest.raises(TypeError, match="callable"):
        normalize_value(lambda: 1)
    with pytest.raises(TypeError, match="unsupported type"):
        normalize_value(object())
    with pytest.raises(ValueError, match=r"inductor_compile_config\['x'\] = <object.*not accepted"):
        CompilationConfig(inductor_compile_config={"x": object()})
    c = CompilationConfig()
    c.inductor_compile_config["x"] = object()  # set after validation: hashing still names it
    with pytest.raises(TypeError, match="get_hash_factors: unsupported type for key 'inductor_compile_config' \\(dict\\)"):
        c.compute_hash()


# ---------------------------------------------------------------- other config/utils helpers


def test_get_field():
    f = get_field(CompilationConfig, "custom_ops")
    assert f.default_factory() == []
    assert get_field(CompilationConfig, "backend").default == ""
    with pytest.raises(TypeError, match="not a dataclass"):
        get_field(int, "x")
    with pytest.raises(ValueError, match="Field 'nope' not found in CompilationConfig"):
        get_field(CompilationConfig, "nope")


def test_update_config_builds_a_new_object():
    c = CompilationConfig(mode=3)
    c.static_forward_context["l"] = 1
    new = update_config(c, {"backend": "eager", "pass_config": {"enable_sp": True}})
    assert new.backend == "eager" and new.pass_config.enable_sp is True and new.mode == 3
    assert c.backend == "inductor" and c.pass_config.enable_sp is None
    assert new.static_forward_context == {}
    with pytest.raises(AssertionError, match="has no field `nope`"):
        update_config(c, {"nope": 1})
    with pytest.raises(AssertionError, match="must be a dict"):
        update_config(c, {"pass_config": 3})


def test_object_print_helpers():
    assert contains_object_print("<Foo object at 0x7f3a2b>")
    assert not contains_object_print("plain text at 0x")
    assert assert_hashable("ok") is True
    with pytest.raises(AssertionError):
        assert_hashable("<x at 0xdeadbeef>")


def test_handle_deprecated_and_getattr_iter(fk_logs):
    class Cfg:
        old = 5
        new = None

    cfg = Cfg()
    handle_deprecated(cfg, "old", "new", "v1.0")
    assert cfg.new == 5 and "deprecated" in _messages(fk_logs)
    assert getattr_iter(cfg, ["missing", "new"]) == 5
    assert getattr_iter(cfg, ["missing"], default=7) == 7
    assert getattr_iter(cfg, ["missing"], default_factory=list) == []


# ---------------------------------------------------------------- what resolution says


def test_enforce_eager_lowers_an_asked_mode_and_says_so(fk_logs):
    from forwardkit.config.builder import build_engine_config

    cfg = build_engine_config(enforce_eager=True, compilation_config={"mode": 3})
    assert cfg.compilation_config.mode == 0 and not cfg.compiles_model  # the config says what runs
    assert "compilation_config.mode=3 (VLLM_COMPILE) is overridden to 0 (NONE)" in _messages(fk_logs)


@pytest.mark.parametrize("cc", [{"mode": 2}, {"mode": 0}, {"backend": "eager"}])
def test_no_ignored_pass_warning_when_no_pass_was_asked_for(fk_logs, cc):
    from forwardkit.config.builder import build_engine_config

    build_engine_config(compilation_config=cc)
    assert "passes run only" not in _messages(fk_logs)
    assert "disabled by user settings" not in _messages(fk_logs)


def test_ignored_pass_warning_names_the_pass_the_user_asked_for(fk_logs):
    from forwardkit.config.builder import build_engine_config

    build_engine_config(compilation_config={"mode": 2, "pass_config": {"fuse_norm_quant": True}})
    text = _messages(fk_logs)
    assert "pass_config fuse_norm_quant: these passes run only" in text and "mode 2" in text


def test_speculation_without_async_scheduling_asked_logs_no_warning(fk_logs):
    import logging

    from forwardkit.config.builder import build_engine_config

    cfg = build_engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                  "prompt_lookup_max": 2})
    assert cfg.scheduler_config.async_scheduling is False
    assert not [r for r in fk_logs if r.levelno >= logging.WARNING], _messages(fk_logs)
