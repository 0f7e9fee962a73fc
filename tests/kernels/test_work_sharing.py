"""How the native CPU kernels share a loop among OpenMP threads (``csrc/fk_share.h``): each
thread takes its own contiguous part in order, then what is left of the others' parts. Checked
through a small harness (``csrc/share_check.c``) built with the system compiler: every item is
taken exactly once, and a thread held back until the first one has finished leaves all of its
part to that thread (what a slow core gets: the fast one does its work instead of waiting)."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from forwardkit.kernels.cpu import native_build

_CSRC = Path(native_build.__file__).with_name("csrc")
_HARNESS = Path(__file__).with_name("csrc") / "share_check.c"

pytestmark = pytest.mark.skipif(shutil.which(native_build.compiler()) is None,
                                reason="no C compiler to build the harness")


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    out = tmp_path_factory.mktemp("share")
    native_build.compile_library(out, _HARNESS, ("-O2", "-fopenmp", "-shared", "-fPIC",
                                                 f"-I{_CSRC}"), "share_check.so")
    lib = ctypes.CDLL(str(out / "share_check.so"))
    for name in ("fk_share_check", "fk_share_streams_check"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _run(lib, name, n, *args):
    owner = (ctypes.c_int * n)(*([-1] * n))
    count = (ctypes.c_int * n)()
    team = getattr(lib, name)(*(ctypes.c_long(a) for a in (n, *args[:-2])),
                              *(ctypes.c_int(a) for a in args[-2:]), owner, count)
    return team, list(owner), list(count)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "chunk"), [(0, 1), (1, 1), (7, 1), (100, 4), (1001, 3)])
def test_every_item_taken_once(lib, threads, n, chunk):
    team, owner, count = _run(lib, "fk_share_check", n, chunk, threads, 0)
    assert team == threads
    assert count == [1] * n
    assert all(0 <= o < threads for o in owner)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_held_back_thread_leaves_its_part_to_the_others(lib, threads):
    """Threads 1.. wait until thread 0 finds nothing left: thread 0 has then taken every item,
    its own part first and the others' after (a static split would leave theirs waiting)."""
    team, owner, count = _run(lib, "fk_share_check", 999, 4, threads, 1)
    assert team == threads
    assert count == [1] * 999
    assert owner == [0] * 999


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("n", "streams"), [(3, 4), (64, 4), (1001, 4), (2048, 3)])
@pytest.mark.parametrize("wait_first", [0, 1])
def test_decode_streams_every_row_once(lib, threads, n, streams, wait_first):
    """One sequence's decode layout (``fk_streams.h``): each part's S streams are shared step
    by step, its last rows stay with its owner; held back, thread 0 takes every step."""
    team, owner, count = _run(lib, "fk_share_streams_check", n, streams, 8, threads, wait_first)
    assert team == threads
    assert count == [1] * n
    if wait_first:
        for t in range(1, threads):  # a part's last n % ... rows are its owner's own
            lo, hi = n * t // threads, n * (t + 1) // threads
            per = (hi - lo) // streams
            tail = range(lo + streams * per, hi)
            assert all(owner[j] == t for j in tail)
            assert all(owner[j] == 0 for j in range(lo, lo + streams * per))
