"""A DP rank that, after one good barrier, kills or stops itself (when it is the victim) while
the others keep meeting in barriers. Used by test_dead_ranks.py, directly through ``spawn`` and
as a ``torchrun`` script: ``dead_rank_worker.py VICTIM SIGNAL``."""

from __future__ import annotations

import os
import signal
import sys


def rank_body(rank: int, nprocs: int, port: int, victim: int, sig: str, timeout_s: float) -> str:
    from forwardkit.distributed import destroy_dp_group, init_dp_group

    kwargs = {} if port < 0 else {"world_size": nprocs, "rank": rank, "master_port": port}
    group = init_dp_group(backend="gloo", timeout_s=timeout_s, **kwargs)
    try:
        group.barrier()
        if group.rank == victim:
            os.kill(os.getpid(), getattr(signal, sig))
        for _ in range(1000):
            group.barrier()
        return "unreachable"
    finally:
        destroy_dp_group()


if __name__ == "__main__":  # under torchrun
    rank_body(-1, -1, -1, int(sys.argv[1]), sys.argv[2], float(os.environ.get("FORWARDKIT_DP_TIMEOUT_S", "3")))
