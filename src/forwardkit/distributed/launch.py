"""A local multi-process launcher: :func:`spawn` runs one function on N ranks.

Each rank is a fresh process (multiprocessing "spawn" context) that calls
``fn(rank, nprocs, port, *args)``, where ``port`` is a free loopback port for the rendezvous
(pass it to :func:`forwardkit.distributed.init_dp_group` as ``master_port``). Results come
back in rank order; a failing, crashing or overdue rank makes :func:`spawn` stop every other
rank and raise :class:`SpawnError` carrying the failing rank's traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

if TYPE_CHECKING:
    from multiprocessing.context import SpawnProcess
    from multiprocessing.queues import Queue

__all__ = ["SpawnError", "find_free_port", "spawn"]

_POLL_S = 0.05
_R = TypeVar("_R")
# what a rank queues: (rank, True, fn's return value) or (rank, False, formatted traceback)
_Result = tuple[int, bool, object]


class SpawnError(RuntimeError):
    """A spawned rank failed, died or did not finish in time.

    ``rank`` is the first failing rank (None for a global timeout) and ``remote_traceback``
    its formatted traceback (None when the process died without reporting).
    """

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class _FnRef:
    """A picklable reference to a module-level function, importable in the child.

    Functions defined in test files (imported by pytest without a package path) or in
    scripts are re-loaded from their source file when the module name is not importable.
    """

    def __init__(self, fn: Callable[..., object]):
        qualname = getattr(fn, "__qualname__", "")
        if not inspect.isfunction(fn) or "<" in qualname:
            raise ValueError(
                f"spawn() needs a module-level function (picklable by name), got {fn!r}"
            )
        self.module, self.qualname = fn.__module__, qualname
        try:
            self.path: str | None = inspect.getfile(fn)
        except TypeError:
            self.path = None

    def resolve(self) -> Callable[..., object]:
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            if self.path is None:
                raise
            spec = importlib.util.spec_from_file_location(self.module, self.path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[self.module] = module
            spec.loader.exec_module(module)
        obj: object = module
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return cast("Callable[..., object]", obj)  # the function __init__ was given


def _child(ref: _FnRef, rank: int, nprocs: int, port: int, args: tuple[object, ...],
           results: Queue[_Result]) -> None:
    try:
        value = ref.resolve()(rank, nprocs, port, *args)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _stop(procs: list[SpawnProcess]) -> None:
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:  # alive: started, so it has a pid
            proc.terminate()
            # A stopped (SIGSTOP) rank keeps SIGTERM pending until it continues.
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _is_stopped(pid: int | None) -> bool:
    """True when ``pid`` is in the job-control stopped state (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _root_cause(procs: list[SpawnProcess], failed: int, payload: str = "") -> tuple[int, str] | None:
    """Another rank that died by a signal or is stopped: the likely cause of ``failed``'s error.

    Waits up to 0.5 s in all for ranks that are ending (a peer may have just ended a stopped one).
    """
    deadline = time.monotonic() + 0.5
    for r, proc in enumerate(procs):
        if r != failed and proc.exitcode is None:
            proc.join(max(0.0, deadline - time.monotonic()))
    for r, proc in enumerate(procs):
        if r == failed:
            continue
        if f"rank {r} (pid {proc.pid}) is stopped (SIGSTOP)" in payload:
            return r, "was stopped (SIGSTOP) and then ended by its peer"
        if proc.exitcode is not None and proc.exitcode != 0:
            return r, _exit_text(proc.exitcode)
        if proc.exitcode is None and _is_stopped(proc.pid):
            return r, "is stopped (SIGSTOP)"
    return None


def _last_line(text: str) -> str:
    """The exception line of a formatted traceback (its last non-empty line)."""
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"


def spawn(
    fn: Callable[..., _R],
    nprocs: int,
    args: tuple[object, ...] = (),
    timeout_s: float = 120.0,
    port: int | None = None,
) -> list[_R]:
    """Run ``fn(rank, nprocs, port, *args)`` in ``nprocs`` local processes.

    Args:
        fn: a module-level function; its return value must be picklable.
        nprocs: number of ranks (>= 1).
        args: extra positional arguments (picklable).
        timeout_s: wall-clock limit for all ranks together.
        port: rendezvous port to hand to the ranks (default: a free loopback port).

    Returns:
        The ranks' return values, in rank order.

    Raises:
        SpawnError: a rank raised (message includes its traceback), exited without a
            result, or the timeout passed; all remaining ranks are terminated first.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive seconds, got {timeout_s!r}")
    ref = _FnRef(fn)
    port = find_free_port() if port is None else port
    ctx = mp.get_context("spawn")
    results: Queue[_Result] = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(ref, r, nprocs, port, tuple(args), results),
                    name=f"forwardkit-rank{r}", daemon=True)
        for r in range(nprocs)
    ]
    for proc in procs:
        proc.start()

    values: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < nprocs:
            rank, ok, payload = _next_result(procs, results, values, deadline, timeout_s)
            if not ok:
                raise _rank_failure(procs, rank, str(payload))
            values[rank] = payload
    finally:
        if len(values) == nprocs:
            for proc in procs:
                proc.join(5.0)
        _stop(procs)
        results.close()
    return [cast(_R, values[r]) for r in range(nprocs)]  # what each rank's fn returned


def _next_result(procs: list[SpawnProcess], results: Queue[_Result], values: dict[int, object],
                 deadline: float, timeout_s: float) -> _Result:
    """The next ``(rank, ok, payload)`` a rank queued; raises :class:`SpawnError` when the
    deadline passes or a rank exited without queueing one."""
    nprocs = len(procs)
    while True:
        try:
            return results.get(timeout=_POLL_S)
        except queue_mod.Empty:
            pass
        if time.monotonic() > deadline:
            missing = sorted(set(range(nprocs)) - set(values))
            stopped = [r for r in missing if _is_stopped(procs[r].pid)]
            note = f" (rank(s) {stopped} stopped, e.g. by SIGSTOP)" if stopped else ""
            raise SpawnError(f"spawn: ranks {missing} did not finish within {timeout_s:g} s{note}",
                             rank=stopped[0] if stopped else None)
        for r, proc in enumerate(procs):
            if r not in values and proc.exitcode is not None:
                # Give a result that was queued just before exit a moment to arrive.
                try:
                    return results.get(timeout=1.0)
                except queue_mod.Empty:
                    raise SpawnError(f"spawn: rank {r} {_exit_text(proc.exitcode)} "
                                     "without returning a result", rank=r) from None


def _rank_failure(procs: list[SpawnProcess], rank: int, payload: str) -> SpawnError:
    """The error for a rank that raised, naming the rank that failed first when another
    rank's failure was only a consequence of it."""
    cause = _root_cause(procs, rank, payload)
    reason = _last_line(payload)
    if cause is not None:
        r, what = cause
        return SpawnError(f"spawn: rank {r} {what}; rank {rank} then failed: {reason}\n"
                          f"{payload}", rank=r, remote_traceback=payload)
    return SpawnError(f"spawn: rank {rank} failed: {reason}\n{payload}", rank=rank,
                      remote_traceback=payload)
