"""A killed or stopped DP rank surfaces as one clear error naming the rank and the cause, from
the collective timeout (not a launcher's global timeout), through ``spawn`` and ``torchrun``;
a stopped rank is ended, so the launcher exits too."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from forwardkit.distributed.launch import SpawnError, find_free_port, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

DP_TIMEOUT_S = 3.0
WORKER = os.path.join(os.path.dirname(__file__), "dead_rank_worker.py")
sys.path.insert(0, os.path.dirname(__file__))
from dead_rank_worker import rank_body  # noqa: E402


@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("sig, cause", [("SIGKILL", "was killed by SIGKILL"),
                                        ("SIGSTOP", "is stopped (SIGSTOP)")])
def test_spawn_names_the_dead_or_stopped_rank(victim, sig, cause):
    # spawn's own limit is far above the DP timeout: the error must come from the collective.
    with pytest.raises(SpawnError) as info:
        spawn(rank_body, 2, args=(victim, sig, DP_TIMEOUT_S), timeout_s=DP_TIMEOUT_S + 60)
    first = str(info.value).splitlines()[0]
    assert info.value.rank == victim
    assert first.startswith(f"spawn: rank {victim} ") and "DPCollectiveError" in first
    assert cause in first
    assert not first.startswith("spawn: ranks")  # not spawn's global timeout


@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_torchrun_launcher_exits_when_a_rank_dies_or_stops(victim, sig):
    env = {**os.environ, "FORWARDKIT_DP_TIMEOUT_S": str(DP_TIMEOUT_S)}
    # torchrun waits 30 s for a rank that ignores SIGTERM; ending before that shows the stopped
    # rank was ended by its peer.
    # The launcher module, not the ``torchrun`` script: it exists wherever torch does, whether or
    # not the environment's bin directory is on PATH.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(find_free_port()), WORKER, str(victim), sig]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DP_TIMEOUT_S + 25, env=env)
    assert proc.returncode != 0
    if sig == "SIGSTOP":  # the peer's collective timed out, named the rank and ended it
        assert "DPCollectiveError" in proc.stderr and f"rank {victim} (pid" in proc.stderr
        assert "is stopped (SIGSTOP)" in proc.stderr
    else:  # torchrun sees the death first and reports it (its summary names the rank)
        assert "Signal 9 (SIGKILL)" in proc.stderr and f"local_rank: {victim}" in proc.stderr
