"""Tensor-parallel ranks of an offline engine: who drives, who follows, and how a step reaches
every rank.

TP rank 0 of a DP replica is the **driver**: it owns the scheduler and the sampler and returns
the outputs. Every other TP rank is a **follower**: it holds its shard of the weights and its
KV cache and runs each step's model work with the driver, so the collectives inside the model
line up. The logits are gathered on every rank; only the driver samples. Two ways in:

* ``LLM(tensor_parallel_size=N)`` in a plain process (as vLLM's ``LLM`` does): the process is
  the driver and starts ``N - 1`` worker processes (:class:`TPWorkerPool`). The driver sends
  each step's batch over a socket to every worker; weight updates (the full tensors follow as
  broadcasts over the TP group), sleep and wake-up go the same way and are acknowledged. A
  draft model split over the TP ranks (``draft_tensor_parallel_size`` equal to the target's)
  is built on every worker beside the driver's shard (``"draft_runner"``), and each draft
  step reaches the workers as the target's steps do (``"draft_step"``). A worker ends when
  the driver shuts it down or dies.
* under ``torchrun`` with ``data_parallel_size x tensor_parallel_size`` processes: every
  process builds its own ``LLM``; inside ``generate`` the TP followers receive the driver's
  steps over the TP group (:class:`TPFollowerLink`) and return the driver's outputs. Every TP
  rank of a replica must call ``generate`` with the same prompts (checked).

Either way a dead or stalled rank makes the others' next collective fail within the
collective timeout with an error naming the rank (``DPCollectiveError``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from forwardkit.distributed.launch import find_free_port
from forwardkit.distributed.parallel_state import (
    RankGroup,
    destroy_distributed,
    get_tp_group,
    init_distributed,
)
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig
    from forwardkit.runner.batch import StepBatch
    from forwardkit.runner.model_runner import ModelRunner

__all__ = ["TPFollowerLink", "TPWorkerError", "TPWorkerPool", "build_runner", "prompts_digest",
           "run_model_step", "share_cpu_threads", "weight_bytes", "worker_main"]

logger = init_logger(__name__)

_POLL_S = 1.0


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker process failed to start, died, or reported an error."""


def share_cpu_threads(local_ranks: int) -> int:
    """On the CPU, give this rank ``cpu cores / local ranks`` intra-op threads (at least 1)
    unless ``OMP_NUM_THREADS`` says otherwise: ranks that each spin up a thread per core
    oversubscribe the cores, and a GEMV then waits on preempted threads (measured: 80 ms
    instead of 0.1 ms per product with 2 ranks x 2 threads on 2 cores). Returns the count."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, local_ranks))
    torch.set_num_threads(threads)
    return threads


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters held by this process (a tied tensor counts once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def build_runner(engine_config: EngineConfig) -> ModelRunner:
    """The runner of one rank, compiled, warmed up and with its graphs captured (the same
    sequence on every TP rank, so the start-up steps' collectives line up)."""
    from forwardkit.runner.model_runner import ModelRunner

    # The runner and the model build read the device facts from engine_config.platform.
    runner = ModelRunner(engine_config)
    runner.warm_up_compile_ranges()
    runner.warm_up_compile_sizes()
    runner.capture_model()
    return runner


@torch.inference_mode()
def run_model_step(runner: ModelRunner, batch: StepBatch, prompt_rows: list[int] | None) -> torch.Tensor:
    """The model work of one step on a follower: the forward and the LM-head calls the driver
    makes (last-token logits, then the prompt-logprob rows), results dropped."""
    runner.keep_hidden = prompt_rows is not None
    logits = runner.execute(batch)
    hidden, runner.last_hidden = runner.last_hidden, None
    if prompt_rows is not None and hidden is not None:
        index = torch.tensor(prompt_rows, dtype=torch.long, device=hidden.device)
        runner.model.compute_logits(hidden.index_select(0, index))
    return logits


def worker_main(fd: int) -> None:
    """Body of a TP worker process (``python -m forwardkit.engine.tp_worker FD``): read the
    start-up message from the driver's socket ``fd``, join the groups, build the runner, then
    serve the driver until it says shut down or goes away."""
    conn = Connection(fd)
    runner = None
    try:
        _, rank, tp, port, engine_config, parent_pid, timeout_s = conn.recv()
        if engine_config.platform is None or engine_config.platform.is_cpu():
            share_cpu_threads(tp)
        init_distributed(engine_config.parallel_config, world_size=tp, rank=rank,
                         master_port=port, tensor_parallel_size=tp, timeout_s=timeout_s)
        runner = build_runner(engine_config)
        conn.send(("ready", rank))
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        return
    try:
        _serve(runner, engine_config, conn, parent_pid)
    finally:
        destroy_distributed()


def _serve(runner: ModelRunner, engine_config: EngineConfig, conn: Connection, parent_pid: int) -> None:
    from forwardkit.engine.weight_update import KVCacheSleeper, update_model_weights

    sleeper: KVCacheSleeper | None = None
    draft: ModelRunner | None = None  # this rank's shard of a draft model split over the TP ranks
    draft_sleeper: KVCacheSleeper | None = None
    while True:
        msg = _recv(conn, parent_pid)
        if msg is None:  # the driver is gone
            return
        kind = msg[0]
        try:
            if kind == "step":
                run_model_step(runner, msg[1], msg[2])
                continue
            if kind == "draft_step":
                assert draft is not None, "draft_step before draft_runner"
                run_model_step(draft, msg[1], None)
                continue
            if kind == "shutdown":
                conn.send(("ok", None))
                return
            if kind == "update_weights":
                pairs = _receive_tensors(msg[1])
                result: Any = update_model_weights(engine_config, runner.module, pairs)
            elif kind == "lora_slot":  # the driver filled (or cleared) a LoRA slot
                from forwardkit.engine.lora import unpack_slot_weights, write_slot

                write_slot(runner.lora_slots, msg[1][0], unpack_slot_weights(msg[1][1]))
                result = None
            elif kind == "weight_bytes":
                result = weight_bytes(runner.module)
            elif kind == "draft_runner":  # the driver builds its shard at the same time
                draft = build_runner(msg[1])
                result = None
            elif kind in ("sleep", "wake_up"):
                sleeper = sleeper or KVCacheSleeper(runner)
                result = sleeper.sleep(msg[1]) if kind == "sleep" else sleeper.wake_up(msg[1])
                if draft is not None:  # the draft's KV cache sleeps and wakes with the target's
                    draft_sleeper = draft_sleeper or KVCacheSleeper(draft)
                    result += (draft_sleeper.sleep(msg[1]) if kind == "sleep"
                               else draft_sleeper.wake_up(msg[1]))
            else:
                raise ValueError(f"unknown TP worker request {kind!r}")
            conn.send(("ok", result))
        except BaseException:
            with contextlib.suppress(OSError):
                conn.send(("error", traceback.format_exc()))
            if kind in ("step", "draft_step", "draft_runner"):  # the ranks are out of step:
                return  # end, so the driver's collective fails now, not at a timeout


def _recv(conn: Connection, parent_pid: int) -> Any:
    """The next message from the driver, or None once the driver process has gone."""
    try:
        while not conn.poll(_POLL_S):
            if os.getppid() != parent_pid:
                return None
        return conn.recv()
    except (EOFError, OSError):
        return None


def _tensor_metas(pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, list[int], torch.dtype]]:
    return [(name, list(t.shape), t.dtype) for name, t in pairs]


def _receive_tensors(metas: list[tuple[str, list[int], torch.dtype]]) -> list[tuple[str, torch.Tensor]]:
    """Follower side of :meth:`TPWorkerPool.update_weights`: one broadcast per tensor."""
    group = get_tp_group()
    pairs = []
    for name, shape, dtype in metas:
        tensor = torch.empty(shape, dtype=dtype, device=group.device)
        group.broadcast(tensor, src=0)
        pairs.append((name, tensor))
    return pairs


class TPWorkerPool:
    """The ``tensor_parallel_size - 1`` worker processes of a driver (module docstring).

    Each worker is a fresh interpreter (``python -m forwardkit.engine.tp_worker``) connected
    to the driver by a private socket pair, so the user's script is not imported again and
    needs no ``if __name__ == "__main__"`` guard. Creating the pool starts the workers and
    joins this process to the TP group as rank 0; the workers build their runners while the
    driver builds its own, and :meth:`wait_ready` is called once the driver's runner exists.
    """

    def __init__(self, engine_config: EngineConfig, timeout_s: float | None = None) -> None:
        tp = engine_config.parallel_config.tensor_parallel_size
        port = find_free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        self.closed = False
        self.threads_before: int | None = None
        try:
            for rank in range(1, tp):
                ours, theirs = socket.socketpair()
                proc = subprocess.Popen(
                    [sys.executable, "-m", "forwardkit.engine.tp_worker", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),))
                theirs.close()
                conn = Connection(ours.detach())
                self.procs.append(proc)
                self.conns.append(conn)
                conn.send(("init", rank, tp, port, engine_config, os.getpid(), timeout_s))
            init_distributed(engine_config.parallel_config, world_size=tp, rank=0,
                             master_port=port, tensor_parallel_size=tp, timeout_s=timeout_s)
            if engine_config.platform is None or engine_config.platform.is_cpu():
                self.threads_before = torch.get_num_threads()  # given back by close()
                share_cpu_threads(tp)
        except BaseException as exc:
            note = self.failure_note()
            self.close()
            if note:
                raise TPWorkerError(f"tensor-parallel start-up failed: {note}") from exc
            raise
        logger.info("Started %d tensor-parallel worker process(es) (TP %d)", tp - 1, tp)

    def wait_ready(self, timeout_s: float = 3600.0) -> None:
        """Wait for every worker's "ready" (its runner is built); raises on a failure."""
        for rank, conn in enumerate(self.conns, start=1):
            kind, payload = self._reply(rank, conn, timeout_s)
            if kind != "ready":
                raise TPWorkerError(f"TP worker rank {rank} failed to start:\n{payload}")

    def _reply(self, rank: int, conn: Connection, timeout_s: float) -> tuple[str, Any]:
        proc = self.procs[rank - 1]
        deadline = time.monotonic() + timeout_s
        try:
            while not conn.poll(0.2):
                if proc.poll() is not None and not conn.poll(0.2):
                    raise TPWorkerError(f"TP worker rank {rank} (pid {proc.pid}) exited with "
                                        f"code {proc.returncode} without replying")
                if time.monotonic() > deadline:
                    raise TPWorkerError(f"TP worker rank {rank} did not reply within "
                                        f"{timeout_s:g} s")
            reply: tuple[str, Any] = conn.recv()
        except (EOFError, OSError) as exc:
            raise TPWorkerError(f"TP worker rank {rank} closed its connection ({exc}); "
                                f"{self.failure_note()}") from exc
        return reply

    def send_step(self, batch: StepBatch, prompt_rows: list[int] | None,
                  kind: str = "step") -> None:
        """Hand every worker this step's batch (no reply: the model's collectives pace them);
        ``kind="draft_step"``: a step of the draft model split over the TP ranks."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((kind, batch, prompt_rows))
            except OSError as exc:
                raise TPWorkerError(f"TP worker rank {rank} is gone ({self.failure_note()}): "
                                    f"{exc}") from exc

    def call(self, kind: str, arg: Any, timeout_s: float = 3600.0) -> list[Any]:
        """Send a request to every worker and return their results in rank order."""
        self.start(kind, arg)
        return self._collect(kind, timeout_s)

    def start(self, kind: str, arg: Any) -> None:
        """Send a request to every worker without waiting: for work the driver joins in (its
        collectives), e.g. ``"draft_runner"``; :meth:`finish` then collects the replies."""
        for conn in self.conns:
            conn.send((kind, arg))

    def finish(self, kind: str, timeout_s: float = 3600.0) -> list[Any]:
        """The workers' replies to the request :meth:`start` sent, in rank order."""
        return self._collect(kind, timeout_s)

    def _collect(self, kind: str, timeout_s: float) -> list[Any]:
        results, errors = [], []
        for rank, conn in enumerate(self.conns, start=1):
            status, payload = self._reply(rank, conn, timeout_s)
            if status == "ok":
                results.append(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
        if errors:
            raise TPWorkerError(f"{kind} failed on TP worker(s): " + "\n".join(errors))
        return results

    def update_weights(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Give every worker the full tensors (one broadcast each over the TP group); each
        copies its shards. ``pairs`` were checked by the driver first."""
        for conn in self.conns:
            conn.send(("update_weights", _tensor_metas(pairs)))
        group = get_tp_group()
        for _, tensor in pairs:
            group.broadcast(tensor.detach().to(group.device).contiguous(), src=0)
        self._collect("update_weights", 3600.0)

    def failure_note(self) -> str:
        """What is known of failed workers: their reported errors and exit codes."""
        notes = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            with contextlib.suppress(EOFError, OSError):
                while conn.poll(0):
                    kind, payload = conn.recv()
                    if kind == "error":
                        lines = [line for line in str(payload).strip().splitlines() if line.strip()]
                        notes.append(f"TP worker rank {rank} raised {lines[-1] if lines else ''}")
            if proc.poll() not in (None, 0):
                notes.append(f"TP worker rank {rank} (pid {proc.pid}) exited with code "
                             f"{proc.returncode}")
        return "; ".join(notes)

    def close(self, timeout_s: float = 10.0) -> None:
        """Shut the workers down (they leave the groups) and leave the groups here."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("shutdown", None))
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(2.0)
                if proc.poll() is None:
                    proc.kill()
        for conn in self.conns:
            conn.close()
        destroy_distributed()
        if self.threads_before is not None:  # this process has the cores to itself again
            torch.set_num_threads(self.threads_before)


class TPFollowerLink:
    """Driver-to-followers messages over the TP group (torchrun mode): the driver's
    :meth:`send` is a broadcast every TP rank of the replica joins with :meth:`recv`."""

    def __init__(self, group: RankGroup | None = None) -> None:
        self.group = group or get_tp_group()

    @property
    def is_driver(self) -> bool:
        """Whether this process is TP rank 0 of its replica."""
        return self.group.rank == 0

    def send(self, msg: Any) -> None:
        """Driver: broadcast ``msg`` to the followers."""
        self.group.broadcast_object(msg, src=0)

    def recv(self) -> Any:
        """Follower: the driver's next message."""
        return self.group.broadcast_object(None, src=0)

    def agree(self, mismatch: bool) -> bool:
        """All ranks learn whether any rank reported a mismatch (one all-reduce)."""
        flag = torch.tensor([1 if mismatch else 0], dtype=torch.int32)
        self.group.all_reduce(flag, use_cpu=True)
        return bool(flag.item())


def prompts_digest(pairs: Sequence[tuple[str | None, list[int], str | None]],
                   params: list[Any]) -> str:
    """A digest of ``generate``'s inputs (token ids, cache salt, sampling params), to check
    that TP ranks were given the same ones."""
    h = hashlib.sha256()
    for (_, ids, salt), p in zip(pairs, params):
        h.update(repr((ids, salt, p)).encode())
    h.update(str(len(pairs)).encode())
    return h.hexdigest()
