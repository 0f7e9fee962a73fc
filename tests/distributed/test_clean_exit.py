"""A process that used forwardkit's process groups exits cleanly.

A gloo worker thread frees a finished collective's tensors after the waiting rank has moved
on, and that free takes the GIL. When the rank's main thread reaches the interpreter's
finalization first, the worker is ended inside a C++ destructor and the process aborts
("terminate called without an active exception") after printing its output: a
``torchrun ... generate -dp 2`` run failed that way about one time in four. Destroying the
groups cannot always join the workers (``torch.distributed.group.WORLD`` stays referenced by
modules imported after the init), so forwardkit's exit hook lets other threads take the GIL
before the interpreter finalizes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from forwardkit.distributed.launch import find_free_port
from forwardkit.distributed.parallel_state import RankGroup

pytestmark = pytest.mark.distributed

# A thread that wants the GIL only once the main thread is on its way out (the main thread
# never gives the GIL up by itself: a 100 s switch interval), as a gloo worker freeing the last
# collective's tensors does.
PROBE = textwrap.dedent("""
    import sys, threading
    from forwardkit.distributed import destroy_distributed, init_distributed

    init_distributed(world_size=1, rank=0, master_addr="127.0.0.1",
                     master_port=int(sys.argv[2]), backend="gloo")
    if sys.argv[1] == "destroy":
        destroy_distributed()
    go = threading.Event()

    def late():
        go.wait()
        sys.stdout.write("late thread ran\\n")
        sys.stdout.flush()

    threading.Thread(target=late, daemon=True).start()
    sys.setswitchinterval(100.0)
    go.set()
""")


@pytest.mark.parametrize("mode", ["leave", "destroy"])
def test_threads_get_the_gil_before_the_interpreter_finalizes(mode):
    proc = subprocess.run([sys.executable, "-c", PROBE, mode, str(find_free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "late thread ran\n", (proc.stdout, proc.stderr[-2000:])


def test_a_destroyed_group_refuses_collectives_and_holds_no_process_group():
    group = RankGroup(0, 2, None, None, torch.device("cpu"), 5.0, name="tp", ranks=[0, 1])
    group.close()
    assert group.closed and group.cpu_group is None and group.device_group is None
    with pytest.raises(RuntimeError, match="TP group was destroyed"):
        group.all_reduce(torch.zeros(1))
    with pytest.raises(RuntimeError, match="TP group was destroyed"):
        group.all_gather(torch.zeros(1), use_cpu=True)
