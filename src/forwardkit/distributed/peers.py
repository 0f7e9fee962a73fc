"""Which DP peer broke a collective: the ranks' process identities, and their state.

At group creation every rank shares ``(host id, pid, start time)`` (one small all-gather on
the CPU group). When a collective fails or times out, :func:`describe_local_peers` looks at the
peers on the same host through ``/proc``: a peer that has exited, or one that is stopped
(``SIGSTOP``, state ``T``), is named in the error. A stopped peer is also sent ``SIGTERM`` then
``SIGCONT`` so it ends now: a stopped process keeps ``SIGTERM`` pending, so ``torchrun`` (or
:func:`~forwardkit.distributed.launch.spawn`) would otherwise wait for it before exiting.
The start time guards against a reused pid. Peers on other hosts are not inspected.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
from typing import Protocol

import torch

__all__ = ["describe_local_peers", "exchange_peer_identities", "process_state"]


def _host_id() -> int:
    return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:7], "big")


def process_state(pid: int) -> tuple[str, int] | None:
    """``(state letter, start time in clock ticks)`` of ``pid`` from ``/proc``, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


class _GatherGroup(Protocol):
    """What the exchange needs of a ``RankGroup`` (which imports this module)."""

    def all_gather(self, tensor: torch.Tensor, *, use_cpu: bool = ...) -> torch.Tensor: ...


def exchange_peer_identities(group: _GatherGroup) -> list[tuple[int, int, int]]:
    """All-gather ``(host id, pid, start time)`` of every rank over ``group``'s CPU group."""
    state = process_state(os.getpid())
    me = torch.tensor([_host_id(), os.getpid(), state[1] if state else -1], dtype=torch.int64)
    rows = group.all_gather(me, use_cpu=True)
    return [(int(h), int(p), int(t)) for h, p, t in rows.tolist()]


def describe_local_peers(peers: list[tuple[int, int, int]], my_rank: int,
                         end_stopped: bool = False) -> list[str]:
    """One phrase per same-host peer that has exited or is stopped (a stopped one is ended
    when ``end_stopped``); other peers are not mentioned."""
    host = _host_id()
    notes = []
    for rank, (peer_host, pid, started) in enumerate(peers):
        if rank == my_rank or peer_host != host or pid <= 0:
            continue
        state = process_state(pid)
        if state is None or (started >= 0 and state[1] != started) or state[0] in ("Z", "X"):
            notes.append(f"rank {rank} (pid {pid}) has exited")
        elif state[0] == "T":
            note = f"rank {rank} (pid {pid}) is stopped (SIGSTOP)"
            if end_stopped:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)
                    os.kill(pid, signal.SIGCONT)
                note += " and was sent SIGTERM so the job can end"
            notes.append(note)
    return notes
