"""The data-parallel (DP) process group on ``torch.distributed``.

:func:`init_dp_group` creates (or adopts) the process group every DP rank joins; the
returned :class:`DPGroup` holds a CPU (gloo) group for small coordination tensors and a
device group (NCCL on CUDA, the gloo group on CPU). Every collective issued through
:class:`DPGroup` waits with a timeout (``FORWARDKIT_DP_TIMEOUT_S``): a dead or stalled peer
makes the waiting ranks raise :class:`DPCollectiveError` instead of hanging. vLLM's
collectives have no such bound; this is a deliberate fix (DESIGN.md, "Distributed").

Rendezvous settings: under torchrun (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` set) the launcher's values are used; otherwise, in this order, the explicit
arguments, the parallel config (``data_parallel_size``, ``data_parallel_rank``,
``data_parallel_master_ip``, ``data_parallel_master_port``) and ``FORWARDKIT_DP_*``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    "destroy_dp_group",
    "get_dp_group",
    "init_dp_group",
    "is_dp_group_initialized",
]

logger = init_logger(__name__)

_TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


class DPCollectiveError(RuntimeError):
    """A DP collective failed or did not finish within the configured timeout."""


@dataclass
class DPGroup:
    """This process's view of the DP group.

    Attributes: ``rank`` / ``world_size`` within the group, ``cpu_group`` (gloo),
    ``device_group`` (NCCL on CUDA, else the gloo group), ``device`` (where device-group
    tensors live) and ``timeout_s`` (the bound on every collective).
    """

    rank: int
    world_size: int
    cpu_group: Any
    device_group: Any
    device: torch.device
    timeout_s: float
    owns_default_group: bool = False
    _extra_groups: list[Any] = field(default_factory=list, repr=False)
    peers: list[tuple[int, int, int]] = field(default_factory=list, repr=False)
    """Per rank: (host id, pid, process start time), to name a dead or stopped local peer."""

    def _group(self, use_cpu: bool) -> Any:
        return self.cpu_group if use_cpu else self.device_group

    def _wait(self, work: Any, what: str, timeout_s: float | None) -> None:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            work.wait(timeout=datetime.timedelta(seconds=limit))
        except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses with terse text
            peers = describe_local_peers(self.peers, self.rank, end_stopped=True)
            why = "; ".join(peers) if peers else ("a peer rank has probably died, stalled, or "
                                                  "called a different collective")
            raise DPCollectiveError(
                f"DP {what} on rank {self.rank} of {self.world_size} failed or did not finish "
                f"within {limit:g} s (FORWARDKIT_DP_TIMEOUT_S): {why}. Cause: "
                f"{' '.join(str(exc).split())[:500]}"
            ) from exc

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: Any = None,
        *,
        use_cpu: bool = False,
        timeout_s: float | None = None,
    ) -> torch.Tensor:
        """In-place all-reduce (default SUM) over the group; returns ``tensor``."""
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
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(out, tensor, group=self._group(use_cpu), async_op=True)
        self._wait(work, "all_gather", timeout_s)
        return torch.stack(out)

    def barrier(self, timeout_s: float | None = None) -> None:
        """Wait until every rank arrives (on the CPU group), bounded by the timeout."""
        self.all_reduce(torch.zeros(1, dtype=torch.int32), use_cpu=True, timeout_s=timeout_s)


_DP_GROUP: DPGroup | None = None


def is_dp_group_initialized() -> bool:
    """True after :func:`init_dp_group` and before :func:`destroy_dp_group`."""
    return _DP_GROUP is not None


def get_dp_group() -> DPGroup:
    """The DP group of this process; raises ``RuntimeError`` if none was initialised."""
    if _DP_GROUP is None:
        raise RuntimeError(
            "The DP group is not initialized. Call forwardkit.distributed.init_dp_group("
            "parallel_config) on every DP rank first (or launch with "
            "forwardkit.distributed.launch.spawn / torchrun)."
        )
    return _DP_GROUP


def _pick(*candidates: Any) -> Any:
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


def _resolve_rendezvous(
    parallel_config: ParallelConfig | None,
    world_size: int | None,
    rank: int | None,
    master_addr: str | None,
    master_port: int | None,
) -> tuple[int, int, str, int]:
    pc = parallel_config
    if all(v in os.environ for v in _TORCHRUN_VARS) and world_size is None and rank is None:
        # NOTE: under torchrun the launcher is the authority on ranks; a config that was
        # built before (default rank 0) must not override it.
        world_size, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
        master_addr = _pick(master_addr, os.environ["MASTER_ADDR"])
        master_port = _pick(master_port, _env_int("MASTER_PORT"))
        pc_size = pc.data_parallel_size if pc is not None else 1
        if pc_size not in (1, world_size):
            raise ValueError(
                f"torchrun started {world_size} processes but data_parallel_size is {pc_size}"
            )
    else:
        world_size = _pick(
            world_size, pc.data_parallel_size if pc is not None else None, envs.FORWARDKIT_DP_SIZE
        )
        rank = _pick(rank, pc.data_parallel_rank if pc is not None else None, envs.FORWARDKIT_DP_RANK)
        master_addr = _pick(
            master_addr, pc.data_parallel_master_ip if pc is not None else None,
            envs.FORWARDKIT_DP_MASTER_IP,
        )
        master_port = _pick(
            master_port,
            (pc.data_parallel_master_port if pc is not None else None) or None,  # 0 = unset
            envs.FORWARDKIT_DP_MASTER_PORT,
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"DP world size must be a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"DP rank must be an int in [0, {world_size}), got {rank!r}")
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
) -> DPGroup:
    """Create the DP process group for this process and make it the current one.

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
    global _DP_GROUP
    if _DP_GROUP is not None:
        raise RuntimeError("The DP group is already initialized; call destroy_dp_group() first")
    timeout_s, backend = _checked_settings(timeout_s, backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    owns = not dist.is_initialized()
    world, me = _join_world(owns, parallel_config, world_size, rank, master_addr, master_port,
                            backend, timeout)
    try:
        cpu_group, device_group, device, extra = _sub_groups(backend, timeout, me, local_rank)
    except BaseException:
        if owns:
            dist.destroy_process_group()
        raise
    _DP_GROUP = DPGroup(me, world, cpu_group, device_group, device, timeout_s, owns, extra)
    try:
        _DP_GROUP.peers = exchange_peer_identities(_DP_GROUP)
    except BaseException:
        destroy_dp_group()
        raise
    logger.debug("DP group ready: rank %d of %d, backend %s", me, world, backend)
    return _DP_GROUP


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
                timeout: datetime.timedelta) -> tuple[int, int]:
    """``(world, rank)``: a new default process group when ``owns``, else the existing one,
    which must span the DP world."""
    if owns:
        world, me, addr, port = _resolve_rendezvous(
            parallel_config, world_size, rank, master_addr, master_port
        )
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
    want = _pick(world_size,
                 parallel_config.data_parallel_size if parallel_config is not None else None, world)
    if want != world:
        raise ValueError(
            f"torch.distributed is already initialized with world size {world}, but the "
            f"DP size is {want}; forwardkit needs the DP group to span the whole world"
        )
    return world, me


def _sub_groups(backend: str, timeout: datetime.timedelta, me: int,
                local_rank: int | None) -> tuple[Any, Any, torch.device, list[Any]]:
    """``(cpu_group, device_group, device, groups created here)``: the world itself where its
    backend fits, else new groups (gloo for the CPU group, NCCL for the device group)."""
    extra: list[Any] = []
    default_backend = dist.get_backend()
    if default_backend == "gloo":
        cpu_group = dist.group.WORLD
    else:
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        extra.append(cpu_group)
    if backend != "nccl":
        return cpu_group, cpu_group, torch.device("cpu"), extra
    if default_backend == "nccl":
        device_group = dist.group.WORLD
    else:
        device_group = dist.new_group(backend="nccl", timeout=timeout)
        extra.append(device_group)
    index = _pick(local_rank, _env_int("LOCAL_RANK"), me % torch.cuda.device_count())
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return cpu_group, device_group, device, extra


def destroy_dp_group() -> None:
    """Tear down the DP group (and the default process group if this module created it).

    Safe to call when no group exists.
    """
    global _DP_GROUP
    group, _DP_GROUP = _DP_GROUP, None
    if group is None or not dist.is_initialized():
        return
    for extra in group._extra_groups:
        dist.destroy_process_group(extra)
    if group.owns_default_group:
        dist.destroy_process_group()
