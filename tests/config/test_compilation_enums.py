"""CompilationMode, CUDAGraphMode, DynamicShapesType and Range."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forwardkit.config.compilation import (
    CompilationMode,
    CUDAGraphMode,
    DynamicShapesConfig,
    DynamicShapesType,
    Range,
)

M = CUDAGraphMode
T, F = True, False

# mode: decode, mixed, has NONE, has PW, has FULL, req PW, max, has full, has PW cg, separate, valid runtime
TRUTH_TABLE = [
    (M.NONE, M.NONE, M.NONE, T, F, F, F, M.NONE, F, F, F, T),
    (M.PIECEWISE, M.PIECEWISE, M.PIECEWISE, F, T, F, T, M.PIECEWISE, F, T, F, T),
    (M.FULL, M.FULL, M.FULL, F, F, T, F, M.FULL, T, F, F, T),
    (M.FULL_DECODE_ONLY, M.FULL, M.NONE, T, F, T, F, M.FULL, T, F, T, F),
    (M.FULL_AND_PIECEWISE, M.FULL, M.PIECEWISE, F, T, T, T, M.FULL, T, T, T, F),
]


@pytest.mark.parametrize("row", TRUTH_TABLE, ids=lambda r: r[0].name)
def test_cudagraph_mode_truth_table(row):
    mode, decode, mixed, h_none, h_pw, h_full, req_pw, mx, full, pw_cg, sep, valid = row
    assert mode.decode_mode() is decode
    assert mode.mixed_mode() is mixed
    assert mode.has_mode(M.NONE) is h_none
    assert mode.has_mode(M.PIECEWISE) is h_pw
    assert mode.has_mode(M.FULL) is h_full
    assert mode.requires_piecewise_compilation() is req_pw
    assert mode.max_cudagraph_mode() is mx
    assert mode.has_full_cudagraphs() is full
    assert mode.has_piecewise_cudagraphs() is pw_cg
    assert mode.separate_routine() is sep
    assert mode.valid_runtime_modes() is valid


@pytest.mark.parametrize("composite", [M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE])
def test_has_mode_rejects_composite_argument(composite):
    with pytest.raises(AssertionError, match=composite.name):
        M.FULL.has_mode(composite)


def test_cudagraph_mode_values_str_and_equality():
    assert M((2, 1)) is M.FULL_AND_PIECEWISE
    assert M((2, 0)) is M.FULL_DECODE_ONLY
    assert M(2) is M.FULL
    assert M.FULL != 2
    assert str(M.FULL_AND_PIECEWISE) == "FULL_AND_PIECEWISE"
    assert repr(M.FULL) == "<CUDAGraphMode.FULL: 2>"


@pytest.mark.parametrize(
    "value, expected",
    [
        ("full_and_piecewise", M.FULL_AND_PIECEWISE),
        ("Piecewise", M.PIECEWISE),
        (2, M.FULL),
        ((2, 1), M.FULL_AND_PIECEWISE),
        ((2, 0), M.FULL_DECODE_ONLY),
        (M.NONE, M.NONE),
    ],
)
def test_cudagraph_mode_parse(value, expected):
    assert M.parse(value) is expected


@pytest.mark.parametrize("bad", ["bogus", [2, 1], 7, True, (1, 2)])
def test_cudagraph_mode_parse_rejects_with_value_error(bad):
    # Deliberate fix: the reference raised a bare KeyError for an unknown name.
    with pytest.raises(ValueError, match="Invalid cudagraph_mode") as info:
        M.parse(bad)
    assert not isinstance(info.value, KeyError)
    assert "FULL_AND_PIECEWISE" in str(info.value)


def test_compilation_mode_is_int_enum():
    assert CompilationMode.VLLM_COMPILE == 3
    assert str(CompilationMode.VLLM_COMPILE) == "3"
    assert [m.value for m in CompilationMode] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "value, expected",
    [
        ("vllm_compile", CompilationMode.VLLM_COMPILE),
        ("Stock_Torch_Compile", CompilationMode.STOCK_TORCH_COMPILE),
        ("NONE", CompilationMode.NONE),
        (3, CompilationMode.VLLM_COMPILE),
        (3.0, CompilationMode.VLLM_COMPILE),
        (True, CompilationMode.STOCK_TORCH_COMPILE),
        (0, CompilationMode.NONE),
    ],
)
def test_compilation_mode_parse(value, expected):
    assert CompilationMode.parse(value) is expected


@pytest.mark.parametrize("bad", ["3", "turbo", 5, -1, 2.5, None, [3]])
def test_compilation_mode_parse_rejects(bad):
    with pytest.raises(ValueError, match="Invalid compilation mode") as info:
        CompilationMode.parse(bad)
    assert "VLLM_COMPILE" in str(info.value)


def test_compilation_mode_numeric_string_message_matches_reference():
    with pytest.raises(ValueError) as info:
        CompilationMode.parse("3")
    assert str(info.value) == (
        "Invalid compilation mode: 3. Valid modes are: NONE, STOCK_TORCH_COMPILE, "
        "DYNAMO_TRACE_ONCE, VLLM_COMPILE"
    )


def test_dynamic_shapes_type_values():
    assert DynamicShapesType("backed") is DynamicShapesType.BACKED
    assert [t.value for t in DynamicShapesType] == ["backed", "unbacked", "backed_size_oblivious"]
    assert DynamicShapesConfig(type="unbacked").type is DynamicShapesType.UNBACKED
    with pytest.raises(ValidationError, match="type"):
        DynamicShapesConfig(type="BACKED")
    with pytest.raises(ValidationError, match="Unexpected keyword argument"):
        DynamicShapesConfig(nope=1)


def test_range_semantics():
    r = Range(1, 8)
    assert 1 in r and 8 in r
    assert 0 not in r and 9 not in r
    assert not r.is_single_size()
    assert Range(4, 4).is_single_size()
    assert r == Range(1, 8)
    assert r != Range(1, 9)
    assert r != (1, 8)
    assert hash(r) == hash((1, 8))
    assert {r: "x"}[Range(1, 8)] == "x"
    assert str(r) == repr(r) == "(1, 8)"
    assert str([Range(1, 8), Range(9, 16)]) == "[(1, 8), (9, 16)]"


def test_range_without_validation():
    r = Range(5, 2)
    assert not r.is_single_size()
    assert all(x not in r for x in range(0, 10))
