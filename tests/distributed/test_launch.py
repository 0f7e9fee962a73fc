"""forwardkit.distributed.launch.spawn: results in rank order, failures and timeouts surface."""

from __future__ import annotations

import os
import time

import pytest

from forwardkit.distributed.launch import SpawnError, find_free_port, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _echo(rank: int, nprocs: int, port: int, tag: str) -> tuple:
    return rank, nprocs, port, tag, os.getpid()


def _fail_on_rank_1(rank: int, nprocs: int, port: int) -> str:
    if rank == 1:
        raise ValueError("boom from rank 1")
    time.sleep(60)  # must be terminated by spawn, not waited for
    return "unreachable"


def _die_on_rank_0(rank: int, nprocs: int, port: int) -> str:
    if rank == 0:
        os._exit(7)
    time.sleep(60)
    return "unreachable"


def _sleep_forever(rank: int, nprocs: int, port: int) -> None:
    time.sleep(60)


def test_results_in_rank_order():
    port = find_free_port()
    out = spawn(_echo, 3, args=("x",), timeout_s=60, port=port)
    assert [o[:4] for o in out] == [(r, 3, port, "x") for r in range(3)]
    assert len({o[4] for o in out}) == 3  # three distinct processes
    assert os.getpid() not in {o[4] for o in out}


def test_failing_rank_raises_with_its_traceback():
    with pytest.raises(SpawnError) as info:
        spawn(_fail_on_rank_1, 2, timeout_s=60)
    err = info.value
    assert err.rank == 1
    assert "ValueError: boom from rank 1" in err.remote_traceback
    assert "rank 1 failed" in str(err) and "boom from rank 1" in str(err)


def test_dead_rank_is_reported():
    with pytest.raises(SpawnError, match="rank 0 exited with code 7") as info:
        spawn(_die_on_rank_0, 2, timeout_s=60)
    assert info.value.rank == 0


def test_timeout_kills_ranks():
    with pytest.raises(SpawnError, match=r"ranks \[0, 1\] did not finish within 3 s"):
        spawn(_sleep_forever, 2, timeout_s=3)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="nprocs"):
        spawn(_echo, 0)
    with pytest.raises(ValueError, match="module-level function"):
        spawn(lambda rank, n, port: rank, 1)
    with pytest.raises(ValueError, match="timeout_s"):
        spawn(_echo, 1, timeout_s=0)
