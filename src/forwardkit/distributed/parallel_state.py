"""Process groups on ``torch.distributed``: data (DP), tensor (TP) and expert (EP) parallel.

The world holds ``data_parallel_size x tensor_parallel_size`` ranks laid out as vLLM lays
them out (pipeline and context parallel size 1): global rank = ``dp_rank * tp + tp_rank``.

* the **TP group** of DP replica ``d`` holds the consecutive ranks ``[d * tp, (d + 1) * tp)``;
* the **DP group** of TP rank ``t`` holds the ranks with that TP rank, ``[t, tp + t, ...]``;
* the **EP group** holds every rank, and a rank's EP rank is its global rank
  ``dp_rank * tp + tp_rank``: the order in which ``DPMetadata.sp_local_sizes`` repeats each
  DP rank's token count ``tp`` times, so those size lists index EP ranks directly.

:func:`init_distributed` creates (or adopts) the world and these groups; :func:`init_dp_group`
is the same for a world of DP ranks only (TP size 1). Each :class:`RankGroup` holds a CPU
(gloo) group for small coordination tensors and a device group (NCCL on CUDA, the gloo group on
CPU). Every collective issued through a :class:`RankGroup` waits with a timeout
(``FORWARDKIT_DP_TIMEOUT_S``): a dead or stalled peer makes the waiting ranks raise
:class:`DPCollectiveError` naming the group, the rank and, for a peer on the same host, which
rank died or stopped, instead of hanging. vLLM's collectives have no such bound; this is a
deliberate fix (docs/design.md, "Distributed"). A group of one rank runs no collective at all.

Rendezvous settings: under torchrun (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` set) the launcher's values are used; otherwise, in this order, the explicit
arguments, the parallel config (``data_parallel_size``, ``data_parallel_rank``,
``data_parallel_master_ip``, ``data_parallel_master_port``) and ``FORWARDKIT_DP_*``.
"""

from __future__ import annotations

import atexit
import datetime
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, overload

import torch
import torch.distributed as dist

from forwardkit import envs
from forwardkit.distributed.peers import describe_local_peers, exchange_peer_identities
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from forwardkit.config.parallel import ParallelConfig

__all__ = [
    "DPCollectiveError",
    "DPGroup",
    "PendingCollective",
    "RankGroup",
    "comm_wait_stats",
    "destroy_distributed",
    "destroy_dp_group",
    "get_dp_group",
    "get_ep_group",
    "get_group",
    "get_tp_group",
    "get_world_group",
    "init_distributed",
    "init_dp_group",
    "quiesce_collectives_at_exit",
    "is_dp_group_initialized",
    "is_tp_group_initialized",
    "rank_dir_name",
    "reset_comm_wait_stats",
    "tp_rank_and_size",
]

logger = init_logger(__name__)

_TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


class DPCollectiveError(RuntimeError):
    """A collective of a DP, TP or EP group failed or did not finish within the timeout."""


# Seconds this process spent blocked waiting for collectives of any RankGroup (the bench's
# "exposed communication"); read and reset with ``comm_wait_stats`` / ``reset_comm_wait_stats``.
_COMM_WAIT = {"seconds": 0.0, "waits": 0}


def comm_wait_stats() -> dict[str, float]:
    """``{"seconds", "waits"}``: time this process spent blocked waiting for collectives of
    every :class:`RankGroup` (a synchronous collective waits for all of its transfer; an
    asynchronous one, :meth:`RankGroup.start_all_gather`, only for what is left when it is
    waited on), and how many waits."""
    return dict(_COMM_WAIT)


def reset_comm_wait_stats() -> None:
    """Zero :func:`comm_wait_stats`."""
    _COMM_WAIT["seconds"] = 0.0
    _COMM_WAIT["waits"] = 0


class PendingCollective:
    """A collective started with ``async_op=True``: :meth:`wait` finishes it (bounded by the
    group's timeout) and returns the result. Waiting again returns the same result at once, so
    the wait can be registered as a micro-batch receive hook and also called by its owner."""

    __slots__ = ("_done", "_error", "_finish", "_group", "_result", "_timeout_s", "_what", "_work")

    def __init__(self, group: RankGroup, work: dist.Work | None, what: str,
                 timeout_s: float | None, finish: Callable[[], torch.Tensor]) -> None:
        self._group, self._work, self._what, self._timeout_s = group, work, what, timeout_s
        self._finish = finish
        self._done = False
        self._error: BaseException | None = None
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """Block until the collective finishes; returns its result (raises its error again)."""
        if not self._done:
            self._done = True
            try:
                if self._work is not None:
                    self._group._wait(self._work, self._what, self._timeout_s)
                self._result = self._finish()
            except BaseException as exc:
                self._error = exc
            finally:
                self._work = None
        if self._error is not None:
            raise self._error
        assert self._result is not None  # set by the finish above, which did not raise
        return self._result


@dataclass
class RankGroup:
    """This process's view of one process group (DP, TP, EP or the whole world).

    Attributes: ``name`` (``"dp"``, ``"tp"``, ``"ep"``, ``"world"``), ``rank`` /
    ``world_size`` within the group, ``ranks`` (the members' global ranks, in group-rank
    order), ``cpu_group`` (gloo; None for a one-rank group), ``device_group`` (NCCL on CUDA,
    else the gloo group), ``device`` (where device-group tensors live) and ``timeout_s`` (the
    bound on every collective).
    """

    rank: int
    world_size: int
    cpu_group: dist.ProcessGroup | None
    device_group: dist.ProcessGroup | None
    device: torch.device
    timeout_s: float
    owns_default_group: bool = False
    peers: list[tuple[int, int, int]] = field(default_factory=list, repr=False)
    """Per global rank: (host id, pid, process start time), to name a dead or stopped peer."""
    name: str = "dp"
    ranks: list[int] = field(default_factory=list)
    closed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not self.ranks:
            self.ranks = list(range(self.world_size))

    @property
    def global_rank(self) -> int:
        """This process's rank in the world."""
        return self.ranks[self.rank]

    def _group(self, use_cpu: bool) -> dist.ProcessGroup | None:
        if self.closed:
            raise RuntimeError(f"the {self.name.upper()} group was destroyed "
                               "(destroy_distributed()); initialize the groups again to use it")
        return self.cpu_group if use_cpu else self.device_group

    def close(self) -> None:
        """Drop this view's process groups (:func:`destroy_distributed` calls it); a collective
        on a group of more than one rank raises afterwards."""
        self.closed = True
        self.cpu_group = self.device_group = None

    def _wait(self, work: dist.Work, what: str, timeout_s: float | None) -> None:
        limit = self.timeout_s if timeout_s is None else timeout_s
        start = time.perf_counter()
        try:
            work.wait(timeout=datetime.timedelta(seconds=limit))
        except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses with terse text
            raise self._failure(what, limit, exc) from exc
        finally:
            _COMM_WAIT["seconds"] += time.perf_counter() - start
            _COMM_WAIT["waits"] += 1

    def _failure(self, what: str, limit: float, exc: BaseException) -> DPCollectiveError:
        peers = describe_local_peers(self.peers, self.global_rank, end_stopped=True)
        for _ in range(5):  # a dying peer resets its sockets before it shows as exited
            if peers:
                break
            time.sleep(0.1)
            peers = describe_local_peers(self.peers, self.global_rank, end_stopped=True)
        why = "; ".join(peers) if peers else ("a peer rank has probably died, stalled, or "
                                              "called a different collective")
        where = f"rank {self.rank} of {self.world_size}"
        if self.ranks != list(range(self.world_size)):
            where += f" (global rank {self.global_rank}; group ranks {self.ranks})"
        return DPCollectiveError(
            f"{self.name.upper()} {what} on {where} failed or did not finish "
            f"within {limit:g} s (FORWARDKIT_DP_TIMEOUT_S): {why}. Cause: "
            f"{' '.join(str(exc).split())[:500]}"
        )

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp | None = None,
        *,
        use_cpu: bool = False,
        timeout_s: float | None = None,
    ) -> torch.Tensor:
        """In-place all-reduce (default SUM) over the group; returns ``tensor``."""
        if self.world_size == 1:
            return tensor
        work = dist.all_reduce(
            tensor, op=dist.ReduceOp.SUM if op is None else op,
            group=self._group(use_cpu), async_op=True,
        )
        self._wait(work, "all_reduce", timeout_s)
        return tensor

    def all_gather(
        self, tensor: torch.Tensor, *, use_cpu: bool = False, timeout_s: float | None = None
    ) -> torch.Tensor:
        """Gather ``tensor`` from every rank; returns a tensor stacked on a new dim 0."""
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(out, tensor.contiguous(), group=self._group(use_cpu), async_op=True)
        self._wait(work, "all_gather", timeout_s)
        return torch.stack(out)

    def start_all_gather(self, tensor: torch.Tensor, *, use_cpu: bool = False,
                         timeout_s: float | None = None) -> PendingCollective:
        """Start :meth:`all_gather` without waiting; ``wait()`` returns the stacked result."""
        if self.world_size == 1:
            return PendingCollective(self, None, "all_gather", timeout_s, lambda: tensor.unsqueeze(0))
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(out, tensor.contiguous(), group=self._group(use_cpu), async_op=True)
        return PendingCollective(self, work, "all_gather", timeout_s, lambda: torch.stack(out))

    def start_all_reduce(self, tensor: torch.Tensor, *, use_cpu: bool = False,
                         timeout_s: float | None = None) -> PendingCollective:
        """Start an in-place SUM :meth:`all_reduce` without waiting; ``wait()`` returns ``tensor``."""
        work = None
        if self.world_size > 1:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group(use_cpu),
                                   async_op=True)
        return PendingCollective(self, work, "all_reduce", timeout_s, lambda: tensor)

    def all_gather_v(self, tensor: torch.Tensor, sizes: Sequence[int], *, use_cpu: bool = False,
                     timeout_s: float | None = None) -> torch.Tensor:
        """All-gather of uneven row counts: rank ``r`` sends ``sizes[r]`` rows of ``tensor``
        (dim 0); returns every rank's rows concatenated in rank order (``sum(sizes)`` rows).

        gloo's all-gather needs equal shapes, so each rank sends its rows padded to
        ``max(sizes)`` and the padding is cut from the result.
        """
        return self.start_all_gather_v(tensor, sizes, use_cpu=use_cpu, timeout_s=timeout_s).wait()

    def start_all_gather_v(self, tensor: torch.Tensor, sizes: Sequence[int], *,
                           use_cpu: bool = False, timeout_s: float | None = None) -> PendingCollective:
        """Start :meth:`all_gather_v` without waiting; ``wait()`` returns its result."""
        sizes = [int(s) for s in sizes]
        self._check_sizes(sizes, tensor, "all_gather_v")
        if self.world_size == 1:
            return PendingCollective(self, None, "all_gather", timeout_s, lambda: tensor)
        top = max(sizes)
        if tensor.shape[0] == top:
            send = tensor.contiguous()
        else:
            send = tensor.new_zeros((top, *tensor.shape[1:]))
            send[: tensor.shape[0]] = tensor
        out = [torch.empty_like(send) for _ in range(self.world_size)]
        work = dist.all_gather(out, send, group=self._group(use_cpu), async_op=True)

        def finish() -> torch.Tensor:
            if all(s == top for s in sizes):
                return torch.cat(out)
            return torch.cat([out[r][:s] for r, s in enumerate(sizes)])

        return PendingCollective(self, work, "all_gather", timeout_s, finish)

    def reduce_scatter_v(self, tensor: torch.Tensor, sizes: Sequence[int], *,
                         use_cpu: bool = False, timeout_s: float | None = None) -> torch.Tensor:
        """Sum ``tensor`` (``sum(sizes)`` rows, the same layout on every rank) over the group
        and return this rank's ``sizes[rank]`` rows of the sum (uneven sizes allowed)."""
        return self.start_reduce_scatter_v(tensor, sizes, use_cpu=use_cpu,
                                           timeout_s=timeout_s).wait()

    def start_reduce_scatter_v(self, tensor: torch.Tensor, sizes: Sequence[int], *,
                               use_cpu: bool = False,
                               timeout_s: float | None = None) -> PendingCollective:
        """Start :meth:`reduce_scatter_v` without waiting; ``wait()`` returns its result."""
        sizes = [int(s) for s in sizes]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"reduce_scatter_v: tensor has {tensor.shape[0]} rows, sizes "
                             f"{sizes} add up to {sum(sizes)}")
        if self.world_size == 1:
            return PendingCollective(self, None, "reduce_scatter", timeout_s, lambda: tensor)
        if len(sizes) != self.world_size:
            raise ValueError(f"reduce_scatter_v: {len(sizes)} sizes for a group of "
                             f"{self.world_size} ranks")
        parts = list(torch.split(tensor.contiguous(), sizes))
        out = torch.empty((sizes[self.rank], *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
        work = dist.reduce_scatter(out, parts, group=self._group(use_cpu), async_op=True)
        return PendingCollective(self, work, "reduce_scatter", timeout_s, lambda: out)

    def _check_sizes(self, sizes: list[int], tensor: torch.Tensor, what: str) -> None:
        if len(sizes) != self.world_size:
            raise ValueError(f"{what}: {len(sizes)} sizes for a group of {self.world_size} ranks")
        if tensor.shape[0] != sizes[self.rank]:
            raise ValueError(f"{what}: rank {self.rank} holds {tensor.shape[0]} rows but its "
                             f"size is {sizes[self.rank]} (sizes {sizes})")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, use_cpu: bool = False,
                  timeout_s: float | None = None) -> torch.Tensor:
        """In-place broadcast of group rank ``src``'s ``tensor`` (contiguous) to every rank."""
        if self.world_size == 1:
            return tensor
        work = dist.broadcast(tensor, src=self.ranks[src], group=self._group(use_cpu),
                              async_op=True)
        self._wait(work, "broadcast", timeout_s)
        return tensor

    def broadcast_object(self, obj: object = None, src: int = 0) -> object:
        """Group rank ``src`` sends a picklable object to every rank of the group (CPU group,
        bounded by the group's timeout); returns it on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        try:
            dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        except Exception as exc:
            raise self._failure("broadcast", self.timeout_s, exc) from exc
        return box[0]

    def barrier(self, timeout_s: float | None = None) -> None:
        """Wait until every rank arrives (on the CPU group), bounded by the timeout."""
        self.all_reduce(torch.zeros(1, dtype=torch.int32), use_cpu=True, timeout_s=timeout_s)


DPGroup = RankGroup
"""The DP group's type (kept under its first name)."""


@dataclass
class _State:
    world: RankGroup
    dp: RankGroup
    tp: RankGroup
    ep: RankGroup
    created: list[dist.ProcessGroup]
    owns_default_group: bool


_STATE: _State | None = None


def is_dp_group_initialized() -> bool:
    """True after :func:`init_dp_group` / :func:`init_distributed` and before the destroy."""
    return _STATE is not None


def is_tp_group_initialized() -> bool:
    """Same as :func:`is_dp_group_initialized`: the groups are created together."""
    return _STATE is not None


def _state(name: str = "distributed") -> _State:
    if _STATE is None:
        raise RuntimeError(
            f"The {name} group is not initialized. Call forwardkit.distributed."
            "init_dp_group(parallel_config) (DP only) or init_distributed(parallel_config) "
            "(DP x TP) on every rank first (or launch with forwardkit.distributed.launch.spawn "
            "/ torchrun; LLM(tensor_parallel_size=N) starts its own TP ranks)."
        )
    return _STATE


def get_dp_group() -> RankGroup:
    """The DP group of this process; raises ``RuntimeError`` if none was initialised."""
    return _state("DP").dp


def get_tp_group() -> RankGroup:
    """The TP group of this process (its DP replica's ranks)."""
    return _state("TP").tp


def get_ep_group() -> RankGroup:
    """The expert-parallel group: every rank, EP rank = ``dp_rank * tp + tp_rank``."""
    return _state("EP").ep


def get_world_group() -> RankGroup:
    """Every rank of the job."""
    return _state("world").world


def get_group(name: str) -> RankGroup:
    """The group called ``name``: ``"dp"``, ``"tp"``, ``"ep"`` or ``"world"``."""
    state = _state()
    groups = {"dp": state.dp, "tp": state.tp, "ep": state.ep, "world": state.world}
    if name not in groups:
        raise ValueError(f"unknown process group {name!r}; expected one of {sorted(groups)}")
    return groups[name]


def tp_rank_and_size(tensor_parallel_size: int) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` for a model built with ``tensor_parallel_size``: ``(0, 1)`` for
    1, else this process's place in the initialised TP group (which must have that size)."""
    if tensor_parallel_size == 1:
        return 0, 1
    if _STATE is None:
        raise RuntimeError(
            f"tensor_parallel_size={tensor_parallel_size} but this process joined no TP group; "
            "build the model through LLM(..., tensor_parallel_size=N) (which starts its TP "
            "ranks), under torchrun with init_distributed(parallel_config), or set "
            "tensor_parallel_size=1"
        )
    tp = _STATE.tp
    if tp.world_size != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but this process's TP "
                         f"group has {tp.world_size} ranks")
    return tp.rank, tp.world_size


def rank_dir_name(parallel_config: ParallelConfig) -> str:
    """``rank_<tp rank>_<dp rank>``: the per-rank directory name of compile-cache entries (TP
    ranks of one replica compile the same graphs but keep their own entries, as in vLLM)."""
    tp_rank = _STATE.tp.rank if _STATE is not None else parallel_config.rank
    return f"rank_{tp_rank}_{parallel_config.data_parallel_rank}"


_T = TypeVar("_T")


@overload
def _pick(first: _T | None, second: _T | None, last: _T, /) -> _T: ...


@overload
def _pick(*candidates: _T | None) -> _T | None: ...


def _pick(*candidates: _T | None) -> _T | None:
    """The first candidate that is not None."""
    for value in candidates:
        if value is not None:
            return value
    return None


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _config_world(pc: ParallelConfig | None, tp: int) -> int | None:
    return pc.data_parallel_size * tp if pc is not None else None


def _resolve_rendezvous(
    parallel_config: ParallelConfig | None,
    world_size: int | None,
    rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    tp: int = 1,
) -> tuple[int, int, str, int]:
    pc = parallel_config
    if all(v in os.environ for v in _TORCHRUN_VARS) and world_size is None and rank is None:
        # NOTE: under torchrun the launcher is the authority on ranks; a config that was
        # built before (default rank 0) must not override it.
        world_size, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
        master_addr = _pick(master_addr, os.environ["MASTER_ADDR"])
        master_port = _pick(master_port, _env_int("MASTER_PORT"))
        dp_size = pc.data_parallel_size if pc is not None else None
        if dp_size is not None and dp_size != 1 and dp_size * tp != world_size:
            what = (f"data_parallel_size is {dp_size}" if tp == 1 else
                    f"data_parallel_size x tensor_parallel_size is {dp_size} x {tp} = {dp_size * tp}")
            raise ValueError(f"torchrun started {world_size} processes but {what}; start that "
                             "many processes")
    else:
        world_size = _pick(world_size, _config_world(pc, tp), envs.FORWARDKIT_DP_SIZE * tp)
        dp_rank = pc.data_parallel_rank if pc is not None else None
        if rank is None and tp > 1:
            raise ValueError(
                f"tensor_parallel_size={tp}: pass this process's global rank (rank=, "
                "dp_rank * tensor_parallel_size + tp_rank) or launch with torchrun")
        rank = _pick(rank, dp_rank, envs.FORWARDKIT_DP_RANK)
        master_addr = _pick(
            master_addr, pc.data_parallel_master_ip if pc is not None else None,
            envs.FORWARDKIT_DP_MASTER_IP,
        )
        master_port = _pick(
            master_port,
            (pc.data_parallel_master_port if pc is not None else None) or None,  # 0 = unset
            envs.FORWARDKIT_DP_MASTER_PORT,
        )
    what = "DP" if tp == 1 else "world"
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{what} world size must be a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{what} rank must be an int in [0, {world_size}), got {rank!r}")
    if not isinstance(master_port, int) or not 0 < master_port < 65536:
        raise ValueError(
            f"DP master port must be an int in [1, 65535], got {master_port!r}; pass "
            "master_port=, set parallel_config.data_parallel_master_port, or set "
            "FORWARDKIT_DP_MASTER_PORT (or MASTER_PORT under torchrun)"
        )
    return world_size, rank, str(master_addr), master_port


def _default_backend() -> str:
    from forwardkit.platforms import current_platform

    if current_platform.is_cuda() and torch.cuda.is_available():
        return "nccl"
    return "gloo"


def init_dp_group(
    parallel_config: ParallelConfig | None = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    timeout_s: float | None = None,
    local_rank: int | None = None,
) -> RankGroup:
    """Create the DP process group for this process and make it the current one.

    The world is the DP ranks alone (TP size 1); :func:`init_distributed` creates DP x TP.

    Args:
        parallel_config: read by attribute (``data_parallel_size``, ``data_parallel_rank``,
            ``data_parallel_master_ip``, ``data_parallel_master_port``); may be None.
        world_size, rank, master_addr, master_port: explicit overrides.
        backend: device-group backend, ``"gloo"`` or ``"nccl"``; default NCCL when the
            current platform is CUDA with a GPU, else gloo. The CPU group is always gloo.
        timeout_s: bound on rendezvous and on every collective (default
            ``FORWARDKIT_DP_TIMEOUT_S``).
        local_rank: GPU index for NCCL (default ``LOCAL_RANK`` or ``rank % device_count``).

    If ``torch.distributed`` is already initialised (e.g. by the user under torchrun), its
    world is adopted as the DP group and must have the DP world size.
    """
    init_distributed(parallel_config, world_size=world_size, rank=rank, master_addr=master_addr,
                     master_port=master_port, backend=backend, timeout_s=timeout_s,
                     local_rank=local_rank, tensor_parallel_size=1)
    return get_dp_group()


def init_distributed(
    parallel_config: ParallelConfig | None = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    timeout_s: float | None = None,
    local_rank: int | None = None,
    tensor_parallel_size: int | None = None,
) -> RankGroup:
    """Join (or create) the world of ``data_parallel_size x tensor_parallel_size`` ranks and
    build the DP, TP and EP groups (module docstring); returns the world group.

    ``tensor_parallel_size`` defaults to the parallel config's (else 1). The arguments are those
    of :func:`init_dp_group`; ``rank`` is the global rank. With TP > 1 outside torchrun the
    rank must be given. Every rank must call this once, before building a model.
    """
    global _STATE, _EVER_INITIALIZED
    if _STATE is not None:
        raise RuntimeError("The distributed groups are already initialized; call "
                           "destroy_dp_group() first")
    tp = _pick(tensor_parallel_size,
               parallel_config.tensor_parallel_size if parallel_config is not None else None, 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tp!r}")
    timeout_s, backend = _checked_settings(timeout_s, backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    owns = not dist.is_initialized()
    world, me = _join_world(owns, parallel_config, world_size, rank, master_addr, master_port,
                            backend, timeout, tp)
    _EVER_INITIALIZED = True  # a gloo world exists from here on: quiesce it at exit
    created: list[dist.ProcessGroup] = []
    try:
        state = _build_groups(world, me, tp, backend, timeout, timeout_s, local_rank, owns,
                              created)
        _STATE = state
        peers = exchange_peer_identities(state.world)
        for group in (state.world, state.dp, state.tp, state.ep):
            group.peers = peers
    except BaseException:
        _STATE = None
        for pg in created:
            dist.destroy_process_group(pg)
        if owns:
            dist.destroy_process_group()
        raise
    logger.debug("Distributed groups ready: global rank %d of %d (DP %d x TP %d), backend %s",
                 me, world, world // tp, tp, backend)
    return state.world


def _checked_settings(timeout_s: float | None, backend: str | None) -> tuple[float, str]:
    """The timeout (default ``FORWARDKIT_DP_TIMEOUT_S``) and device backend, validated."""
    timeout_s = envs.FORWARDKIT_DP_TIMEOUT_S if timeout_s is None else float(timeout_s)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    backend = backend or _default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"Unsupported DP backend {backend!r}; expected 'gloo' or 'nccl'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, but no GPU is visible; use 'gloo'")
    return timeout_s, backend


def _join_world(owns: bool, parallel_config: ParallelConfig | None, world_size: int | None,
                rank: int | None, master_addr: str | None, master_port: int | None, backend: str,
                timeout: datetime.timedelta, tp: int) -> tuple[int, int]:
    """``(world, rank)``: a new default process group when ``owns``, else the existing one,
    which must span DP x TP."""
    if owns:
        world, me, addr, port = _resolve_rendezvous(
            parallel_config, world_size, rank, master_addr, master_port, tp
        )
        _check_world(world, tp, parallel_config)
        try:
            dist.init_process_group(
                backend=backend, init_method=f"tcp://{addr}:{port}",
                world_size=world, rank=me, timeout=timeout,
            )
        except Exception as exc:
            raise DPCollectiveError(
                f"DP rendezvous at tcp://{addr}:{port} failed for rank {me} of {world} "
                f"(timeout {timeout.total_seconds():g} s, FORWARDKIT_DP_TIMEOUT_S): not every "
                f"rank arrived, or the address is unreachable. Cause: {exc}"
            ) from exc
        return world, me
    world, me = dist.get_world_size(), dist.get_rank()
    want_dp = _pick(None if world_size is None else world_size // tp,
                    parallel_config.data_parallel_size if parallel_config is not None else None,
                    world // tp)
    if want_dp * tp != world:
        if tp == 1:
            raise ValueError(
                f"torch.distributed is already initialized with world size {world}, but the "
                f"DP size is {want_dp}; forwardkit needs the DP group to span the whole world"
            )
        raise ValueError(
            f"torch.distributed is already initialized with world size {world}, but "
            f"data_parallel_size x tensor_parallel_size is {want_dp} x {tp} = {want_dp * tp}")
    return world, me


def _check_world(world: int, tp: int, parallel_config: ParallelConfig | None) -> None:
    if world % tp:
        raise ValueError(f"world size {world} is not a multiple of tensor_parallel_size={tp}")
    if parallel_config is not None and parallel_config.data_parallel_size > 1:
        dp = parallel_config.data_parallel_size
        if dp * tp != world:
            raise ValueError(
                f"data_parallel_size x tensor_parallel_size = {dp} x {tp} = {dp * tp}, but the "
                f"world has {world} ranks")


def _device_of(backend: str, me: int, local_rank: int | None) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    index = _pick(local_rank, _env_int("LOCAL_RANK"), me % torch.cuda.device_count())
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def _build_groups(world: int, me: int, tp: int, backend: str, timeout: datetime.timedelta,
                  timeout_s: float, local_rank: int | None, owns: bool,
                  created: list[dist.ProcessGroup]) -> _State:
    """The world, DP, TP and EP groups. Every rank creates every sub-group in the same order
    (``torch.distributed.new_group`` is a collective over the whole world); a group of one
    rank gets no process group, and a group equal to the world reuses the world's."""
    device = _device_of(backend, me, local_rank)
    default_backend = dist.get_backend()

    def new(ranks: list[int] | None, kind: str) -> dist.ProcessGroup | None:
        if ranks is None and default_backend == kind:
            return dist.group.WORLD
        group = dist.new_group(ranks=ranks, backend=kind, timeout=timeout)
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            created.append(group)
        return group

    Handles = tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]  # (cpu, device)

    def make(name: str, ranks: list[int], handles: Handles | None = None) -> RankGroup:
        if me not in ranks:
            raise AssertionError(f"rank {me} is not in its own {name} group {ranks}")
        if len(ranks) == 1:
            cpu = dev = None
        elif handles is not None:
            cpu, dev = handles
        else:
            cpu, dev = None, None
        return RankGroup(ranks.index(me), len(ranks), cpu, dev, device, timeout_s,
                         name=name, ranks=ranks)

    world_cpu = new(None, "gloo")
    world_dev = world_cpu if backend != "nccl" else new(None, "nccl")
    world_group = RankGroup(me, world, world_cpu, world_dev, device, timeout_s, owns,
                            name="world", ranks=list(range(world)))
    dp = world // tp
    tp_ranks = [list(range(d * tp, (d + 1) * tp)) for d in range(dp)]
    dp_ranks = [list(range(t, world, tp)) for t in range(tp)]

    def sub(name: str, all_ranks: list[list[int]]) -> RankGroup:
        mine = next(r for r in all_ranks if me in r)
        if len(mine) == world:
            return make(name, mine, (world_cpu, world_dev))
        handles: Handles | None = None
        for ranks in all_ranks:  # every rank creates every group, in the same order
            if len(ranks) == 1:
                continue
            cpu = new(ranks, "gloo")
            dev = cpu if backend != "nccl" else new(ranks, "nccl")
            if me in ranks:
                handles = (cpu, dev)
        return make(name, mine, handles)

    tp_group = sub("tp", tp_ranks)
    dp_group = sub("dp", dp_ranks)
    ep_group = make("ep", list(range(world)), (world_cpu, world_dev))
    if world == 1:
        world_group.cpu_group = world_group.device_group = None
    return _State(world_group, dp_group, tp_group, ep_group, created, owns)


def destroy_distributed() -> None:
    """Tear down the groups (and the default process group if this module created it).

    Safe to call when no group exists. Every :class:`RankGroup` of the state drops its process
    groups too, so the last reference to each goes here and its gloo worker threads are joined
    now: a gloo worker that outlived the interpreter's shutdown would abort the process
    ("terminate called without an active exception") when it frees the last collective's
    tensors. The groups are also torn down at interpreter exit (``atexit``) when the caller
    did not do it.
    """
    global _STATE
    state, _STATE = _STATE, None
    if state is None:
        return
    for group in (state.world, state.dp, state.tp, state.ep):
        group.close()
    created, state.created = state.created, []
    if not dist.is_initialized():
        return
    for pg in created:
        dist.destroy_process_group(pg)
    if state.owns_default_group:
        dist.destroy_process_group()


def _quiesce_at_exit() -> None:
    """At interpreter exit: tear down the groups the caller left, then give gloo's worker
    threads a moment with the GIL released.

    A gloo worker frees a finished collective's tensors after the waiting rank has already
    moved on, and freeing a tensor Python also holds takes the GIL. A worker that asks for the
    GIL once the interpreter is finalizing is ended mid-destructor and the process aborts
    ("terminate called without an active exception", SIGABRT) after its output is printed.
    Destroying a process group joins its workers only when its last reference goes, and
    ``torch.distributed.group.WORLD`` can stay referenced (default arguments captured by
    modules imported after the init), so the workers also get a short wait here, while the
    interpreter still serves them.
    """
    if not (_EVER_INITIALIZED or dist.is_initialized()):
        return
    if _STATE is not None:
        try:
            destroy_distributed()
        except Exception as exc:  # a peer already gone: nothing left to tear down cleanly
            logger.debug("Tearing down the process groups at exit failed: %s", exc)
    time.sleep(_EXIT_QUIESCE_S)


_EVER_INITIALIZED = False
_EXIT_QUIESCE_S = 0.05
atexit.register(_quiesce_at_exit)


def quiesce_collectives_at_exit() -> None:
    """Ask for the exit-time wait for gloo's workers (see ``_quiesce_at_exit``) in a process
    that initialized ``torch.distributed`` itself and destroys it before exit;
    :func:`init_distributed` asks for it on its own."""
    global _EVER_INITIALIZED
    _EVER_INITIALIZED = True


destroy_dp_group = destroy_distributed
