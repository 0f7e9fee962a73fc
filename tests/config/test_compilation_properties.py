"""Hypothesis properties of the compilation config: padding table, compile ranges,
CUDAGraphMode identities, spec-decode rounding and dict/JSON round trips."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from forwardkit.config.compilation import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
)
from forwardkit.config.compilation_sizes import compile_ranges_from_split_points

SETTINGS = settings(max_examples=150, deadline=None)
ROUTINES = (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)


# ---------------------------------------------------------------- padding table


@SETTINGS
@given(sizes=st.lists(st.integers(1, 600), min_size=1, max_size=40))
def test_padding_table_maps_to_smallest_capture_size(sizes):
    top = max(sizes)
    c = CompilationConfig(cudagraph_capture_sizes=list(sizes), max_cudagraph_capture_size=top)
    c.post_init_cudagraph_sizes()
    table = c.bs_to_padded_graph_size
    assert c.cudagraph_capture_sizes == sorted(sizes)
    assert len(table) == top + 1  # sizes above the max are not in the table
    assert table[0] == 0
    for bs in range(1, top + 1):
        assert table[bs] == min(s for s in sizes if s >= bs)
        assert table[bs] in sizes


@SETTINGS
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=20, unique=True), slack=st.integers(1, 50))
def test_padding_table_above_largest_size_maps_past_max(sizes, slack):
    top = max(sizes) + slack
    c = CompilationConfig(cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=top)
    c.compute_bs_to_padded_graph_size()
    assert len(c.bs_to_padded_graph_size) == top + 1
    assert all(v == top + 1 for v in c.bs_to_padded_graph_size[max(sizes) + 1 :])


# ---------------------------------------------------------------- compile ranges


@SETTINGS
@given(
    max_tokens=st.integers(2, 20000),
    points=st.lists(st.integers(1, 25000), max_size=12),
)
def test_compile_ranges_partition_token_range(max_tokens, points):
    # The engine's _set_compile_ranges: keep 1 < x < T, always add T, sort, keep dups.
    split = sorted([max_tokens, *[x for x in points if 1 < x < max_tokens]])
    ranges = CompilationConfig(compile_ranges_split_points=split).get_compile_ranges()
    assert ranges[0].start == 1
    assert ranges[-1].end == max_tokens
    for r in ranges:
        assert r.start <= r.end
    for a, b in zip(ranges, ranges[1:]):
        assert a.end + 1 == b.start  # no gap, no overlap
    assert sum(r.end - r.start + 1 for r in ranges) == max_tokens
    probe = points[0] if points else max_tokens
    if 1 <= probe <= max_tokens:
        assert sum(probe in r for r in ranges) == 1


@SETTINGS
@given(points=st.lists(st.integers(1, 5000), min_size=1, max_size=12))
def test_compile_ranges_ignore_order_and_duplicates(points):
    assert compile_ranges_from_split_points(points) == compile_ranges_from_split_points(
        sorted(set(points), reverse=True)
    )
    assert len(compile_ranges_from_split_points(points)) == len(set(points))


# ---------------------------------------------------------------- CUDAGraphMode identities


@given(mode=st.sampled_from(list(CUDAGraphMode)))
def test_cudagraph_mode_identities(mode):
    routines = {mode.decode_mode(), mode.mixed_mode()}
    assert all(not r.separate_routine() for r in routines)
    if not mode.separate_routine():
        assert mode.decode_mode() is mode and mode.mixed_mode() is mode
        assert mode.max_cudagraph_mode() is mode
        assert mode.valid_runtime_modes()
    else:
        assert mode.value == (mode.decode_mode().value, mode.mixed_mode().value)
        assert not mode.valid_runtime_modes()
    for r in ROUTINES:
        assert mode.has_mode(r) == (r in routines)
    assert mode.max_cudagraph_mode() is max(routines, key=lambda r: r.value)
    assert mode.has_full_cudagraphs() == (CUDAGraphMode.FULL in routines)
    assert mode.requires_piecewise_compilation() == (CUDAGraphMode.PIECEWISE in routines)
    assert mode.has_piecewise_cudagraphs() == mode.requires_piecewise_compilation()
    assert CUDAGraphMode.parse(mode.name.lower()) is mode
    assert CUDAGraphMode.parse(mode.value) is mode
    assert CUDAGraphMode.parse(str(mode)) is mode


@given(mode=st.sampled_from(list(CompilationMode)))
def test_compilation_mode_parse_round_trip(mode):
    assert CompilationMode.parse(mode.name.lower()) is mode
    assert CompilationMode.parse(int(mode)) is mode


# ---------------------------------------------------------------- spec-decode rounding


@SETTINGS
@given(
    sizes=st.lists(st.integers(1, 512), min_size=1, max_size=30, unique=True),
    q=st.integers(2, 8),
)
def test_spec_decode_sizes_are_multiples_within_max(sizes, q):
    top = max(sizes)
    c = CompilationConfig(cudagraph_capture_sizes=sorted(sizes), max_cudagraph_capture_size=top)
    if q > top:
        return  # the error case is covered by an example test
    c.adjust_cudagraph_sizes_for_spec_decode(q, 1)
    new = c.cudagraph_capture_sizes
    assert new and new == sorted(set(new))
    assert all(s % q == 0 and s <= top for s in new)
    assert c.max_cudagraph_capture_size == new[-1]
    assert len(c.bs_to_padded_graph_size) == new[-1] + 1


# ---------------------------------------------------------------- round trips

_op_names = st.sampled_from(["rms_norm", "silu_and_mul", "quant_fp8", "rotary_embedding"])
_custom_ops = st.tuples(
    st.lists(st.builds(lambda sign, name: sign + name, st.sampled_from("+-"), _op_names), max_size=4),
    st.sampled_from([None, "all", "none"]),
).map(lambda t: t[0] + ([t[1]] if t[1] else []))
_tri = st.sampled_from([None, True, False])

_config_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "mode": st.sampled_from([None, 0, 1, 2, 3, "none", "VLLM_COMPILE", "dynamo_trace_once"]),
        "level": st.sampled_from([None, 0, 3]),
        "debug_dump_path": st.sampled_from([None, "dump", "/tmp/fk-dump"]),
        "cache_dir": st.sampled_from(["", "/tmp/cache"]),
        "compile_cache_save_format": st.sampled_from(["binary", "unpacked"]),
        "backend": st.sampled_from(["", "eager", "inductor"]),
        "custom_ops": _custom_ops,
        "splitting_ops": st.one_of(st.none(), st.lists(st.sampled_from(["a::b", "forwardkit::unified_attention"]))),
        "compile_mm_encoder": st.booleans(),
        "compile_sizes": st.one_of(
            st.none(), st.lists(st.one_of(st.integers(1, 64), st.just("cudagraph_capture_sizes")), max_size=4)
        ),
        "compile_ranges_split_points": st.one_of(st.none(), st.lists(st.integers(1, 4096), max_size=4)),
        "inductor_compile_config": st.dictionaries(st.sampled_from(["a", "combo_kernels"]), st.booleans()),
        "cudagraph_mode": st.sampled_from([None, *[m.name for m in CUDAGraphMode], 2, (2, 1)]),
        "cudagraph_num_of_warmups": st.integers(0, 3),
        "cudagraph_capture_sizes": st.one_of(st.none(), st.lists(st.integers(1, 512), max_size=6)),
        "cudagraph_copy_inputs": st.booleans(),
        "cudagraph_specialize_lora": st.booleans(),
        "use_inductor_graph_partition": _tri,
        "pass_config": st.fixed_dictionaries(
            {}, optional={"enable_sp": _tri, "fuse_norm_quant": _tri, "eliminate_noops": _tri,
                          "fi_allreduce_fusion_max_size_mb": st.sampled_from([None, 0.5, 64.0])}
        ),
        "max_cudagraph_capture_size": st.one_of(st.none(), st.integers(0, 1024)),
        "dynamic_shapes_config": st.fixed_dictionaries(
            {}, optional={"type": st.sampled_from(["backed", "unbacked", "backed_size_oblivious"]),
                          "evaluate_guards": st.booleans()}
        ),
    },
)


@SETTINGS
@given(kwargs=_config_kwargs)
def test_config_dict_and_json_round_trip(kwargs):
    c = CompilationConfig(**kwargs)
    d = c.to_dict()
    again = CompilationConfig(**d)
    assert again == c
    assert again.compute_hash() == c.compute_hash()
    assert again.to_dict() == d
    text = c.to_json()
    assert json.loads(text) == json.loads(json.dumps(d))
    assert CompilationConfig.from_cli(text) == c
    assert repr(CompilationConfig(**json.loads(text))) == repr(c)
