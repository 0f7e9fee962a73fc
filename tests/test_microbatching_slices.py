"""forwardkit.microbatching.slices: slices, thresholds, boundaries, the unguarded edge case."""

from __future__ import annotations

import numpy as np
import pytest

from forwardkit.config.parallel import ParallelConfig
from forwardkit.microbatching.slices import (
    UBatchSlice,
    UBatchSlices,
    check_ubatch_thresholds,
    is_last_ubatch_empty,
    maybe_create_ubatch_slices,
)


def test_slice_properties():
    s = UBatchSlice(slice(0, 3), slice(0, 10))
    assert s.num_tokens == 10
    assert s.is_empty() is False
    assert UBatchSlice(slice(2, 2), slice(0, 4)).is_empty() is True
    assert UBatchSlice(slice(0, 2), slice(5, 5)).is_empty() is True
    assert UBatchSlices == list[UBatchSlice]


@pytest.mark.parametrize(
    ("orig", "padded", "n", "expected"),
    [
        (10, 16, 2, False), (8, 16, 2, True), (9, 16, 2, False), (1, 2, 2, True),
        (2, 2, 2, False), (5, 9, 2, False), (4, 9, 2, True), (6, 12, 3, True),
        (9, 12, 3, False), (7, 12, 3, True),
    ],
)
def test_is_last_ubatch_empty(orig, padded, n, expected):
    assert is_last_ubatch_empty(orig, padded, n) is expected


def test_is_last_ubatch_empty_rejects_zero_ubatches():
    with pytest.raises(ValueError, match="num_ubatches"):
        is_last_ubatch_empty(4, 8, 0)


ON = ParallelConfig(enable_dbo=True, dbo_decode_token_threshold=32, dbo_prefill_token_threshold=512)
OFF = ParallelConfig(enable_dbo=False, dbo_decode_token_threshold=32, dbo_prefill_token_threshold=512)


@pytest.mark.parametrize(
    ("config", "num_tokens", "uniform", "expected"),
    [(ON, 31, True, False), (ON, 32, True, True), (ON, 511, False, False),
     (ON, 512, False, True), (OFF, 4096, False, False)],
)
def test_ubatch_thresholds(config, num_tokens, uniform, expected):
    assert check_ubatch_thresholds(config, num_tokens, uniform) is expected


def sl(req: tuple[int, int], tok: tuple[int, int]) -> UBatchSlice:
    return UBatchSlice(slice(*req), slice(*tok))


# id, sched, padded tokens, padded reqs, n, split_point, unpadded, padded last slice (None: same)
SLICE_CASES = [
    ("S1", [1] * 8, 8, 8, 2, None, [sl((0, 4), (0, 4)), sl((4, 8), (4, 8))], None),
    ("S2", [3, 5, 2, 6], 16, 4, 2, None, [sl((0, 2), (0, 8)), sl((2, 4), (8, 16))], None),
    ("S3", [1] * 10, 16, 16, 2, None, [sl((0, 8), (0, 8)), sl((8, 10), (8, 10))],
     sl((8, 16), (8, 16))),
    ("S4", [7, 1, 1, 1], 10, 4, 2, None, [sl((0, 1), (0, 5)), sl((0, 4), (5, 10))], None),
    ("S5", [4, 4, 4], 12, 3, 3, None,
     [sl((0, 1), (0, 4)), sl((1, 2), (4, 8)), sl((2, 3), (8, 12))], None),
    ("S6", [2] * 5, 12, 6, 2, 4, [sl((0, 2), (0, 4)), sl((2, 5), (4, 10))], sl((2, 6), (4, 12))),
    ("S8", [5, 5], 10, 2, 2, None, [sl((0, 1), (0, 5)), sl((1, 2), (5, 10))], None),
    ("S9", [1] * 6, 8, 8, 3, None,
     [sl((0, 2), (0, 2)), sl((2, 4), (2, 4)), sl((4, 6), (4, 6))], sl((4, 8), (4, 8))),
    # unguarded edge case (empty last micro-batch): raw output kept as in vLLM
    ("empty_last", [1] * 6, 16, 16, 2, None, [sl((0, 7), (0, 8)), sl((6, 6), (8, 6))],
     sl((6, 16), (8, 16))),
]


@pytest.mark.parametrize(
    ("sched", "tokens", "reqs", "n", "split", "unpadded", "padded_last"),
    [case[1:] for case in SLICE_CASES], ids=[case[0] for case in SLICE_CASES],
)
def test_slices(sched, tokens, reqs, n, split, unpadded, padded_last):
    kwargs = {} if split is None else {"split_point": split}
    got_unpadded, got_padded = maybe_create_ubatch_slices(
        True, np.array(sched, dtype=np.int32), tokens, reqs, n, **kwargs
    )
    assert got_unpadded == unpadded
    expected_padded = unpadded[:-1] + [padded_last or unpadded[-1]]
    assert got_padded == expected_padded
    assert sum(s.num_tokens for s in got_padded) == tokens


def test_no_slices_when_not_ubatching():
    assert maybe_create_ubatch_slices(False, np.array([1] * 4), 4, 4, 2) == (None, None)


def test_split_point_list_form_and_errors():
    unpadded, _ = maybe_create_ubatch_slices(True, np.array([2] * 5), 12, 6, 2, split_point=[4])
    assert unpadded[0] == sl((0, 2), (0, 4))
    with pytest.raises(ValueError, match="split_point"):
        maybe_create_ubatch_slices(True, np.array([2] * 5), 12, 6, 2, split_point=[4, 8])
    with pytest.raises(ValueError, match="num_ubatches"):
        maybe_create_ubatch_slices(True, np.array([2] * 5), 12, 6, 1)
