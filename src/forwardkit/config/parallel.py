"""``ParallelConfig``: tensor / pipeline / data / expert parallel layout.

Only the fields that data parallelism, the forward context and config resolution read are
kept. Resolution follows vLLM 0.14.0: an explicit DP setup (``data_parallel_size > 1`` or
``data_parallel_size_local == 0``) picks a random free master port and checks the rank; the
offline SPMD path (DP not explicit) takes size / rank / master address from the
``FORWARDKIT_DP_*`` environment variables instead, so a user-given rank or port is replaced
there (vLLM's behaviour, kept on purpose).
"""

from __future__ import annotations

import os
import socket
from dataclasses import field
from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

from forwardkit import envs
from forwardkit.config.frozen import FreezableConfig
from forwardkit.config.model import GGUF_BLOCK_TYPES
from forwardkit.config.utils import get_hash_factors, hash_factors
from forwardkit.logger import init_logger
from forwardkit.platforms import current_platform

if TYPE_CHECKING:
    from forwardkit.config.model import ModelConfig

__all__ = ["ALL2ALL_BACKENDS", "EPLBConfig", "ParallelConfig", "check_parallel_fits_model",
           "get_open_ports"]

logger = init_logger(__name__)

All2AllBackend = Literal[
    "naive",
    "pplx",
    "deepep_high_throughput",
    "deepep_low_latency",
    "allgather_reducescatter",
    "flashinfer_all2allv",
]
ALL2ALL_BACKENDS: tuple[str, ...] = (
    "naive",
    "pplx",
    "deepep_high_throughput",
    "deepep_low_latency",
    "allgather_reducescatter",
    "flashinfer_all2allv",
)
_SEQUENCE_PARALLEL_MOE_BACKENDS = {
    "allgather_reducescatter",
    "naive",
    "deepep_high_throughput",
    "deepep_low_latency",
}
_EXECUTORS = ("uni", "mp", "ray", "external_launcher")

# Fields that do not change the compiled graph, left out of compute_hash().
_HASH_IGNORED = frozenset(
    {
        "data_parallel_rank",
        "data_parallel_rank_local",
        "data_parallel_size_local",
        "data_parallel_index",
        "data_parallel_backend",
        "data_parallel_external_lb",
        "data_parallel_hybrid_lb",
        "data_parallel_master_ip",
        "data_parallel_master_port",
        "data_parallel_rpc_port",
        "rank",
        "master_addr",
        "master_port",
        "node_rank",
        "nnodes",
        "disable_custom_all_reduce",
        "distributed_executor_backend",
    }
)


def get_open_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that were free on ``host`` a moment ago."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(config=ConfigDict(extra="forbid"))
class EPLBConfig(FreezableConfig):
    """Expert-parallel load balancer settings (kept for validation; no balancer runs here)."""

    window_size: int = 1000
    """Steps over which expert load is recorded."""
    step_interval: int = 3000
    """Steps between rebalancing."""
    num_redundant_experts: int = Field(default=0, ge=0)
    """Extra expert replicas; must be 0 unless EPLB is on."""
    log_balancedness: bool = False
    """Log the balancedness of expert load."""
    log_balancedness_interval: int = 1
    """Steps between balancedness logs."""
    use_async: bool = False
    """Rebalance asynchronously."""
    policy: Literal["default"] = "default"
    """Rebalancing policy."""


@dataclass(config=ConfigDict(extra="forbid", arbitrary_types_allowed=True))
class ParallelConfig(FreezableConfig):
    """How the model is split over processes; ``world_size`` excludes data parallelism."""

    pipeline_parallel_size: int = 1
    """Pipeline stages."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks."""
    prefill_context_parallel_size: int = 1
    """Prefill context-parallel ranks (counts toward ``world_size``)."""
    decode_context_parallel_size: int = 1
    """Decode context-parallel ranks."""
    data_parallel_size: int = 1
    """Data-parallel replicas."""
    data_parallel_size_local: int = 1
    """Replicas on this node; must be <= ``data_parallel_size``."""
    data_parallel_rank: int = 0
    """This replica's DP rank; in ``[0, data_parallel_size)`` when DP is explicit."""
    data_parallel_rank_local: int | None = None
    """Local DP rank; set from the environment on the offline path."""
    data_parallel_master_ip: str = "127.0.0.1"
    """Address of DP rank 0."""
    data_parallel_rpc_port: int = 29550
    """RPC port of the DP coordinator."""
    data_parallel_master_port: int = 29500
    """Port of the DP process group (replaced in post-init; see module docstring)."""
    data_parallel_backend: Literal["ray", "mp"] = "mp"
    """How DP replicas are launched."""
    data_parallel_external_lb: bool = False
    """An external load balancer routes requests (needs DP > 1)."""
    data_parallel_hybrid_lb: bool = False
    """Hybrid internal/external load balancing."""
    is_moe_model: bool | None = None
    """Set by the engine from the model; None = not known yet."""
    enable_expert_parallel: bool = False
    """Shard MoE experts over TP x DP ranks."""
    enable_eplb: bool = False
    """Expert-parallel load balancing (CUDA only)."""
    eplb_config: EPLBConfig = Field(default_factory=EPLBConfig)
    """EPLB settings (a dict is accepted)."""
    expert_placement_strategy: Literal["linear", "round_robin"] = "linear"
    """How experts are placed on EP ranks."""
    all2all_backend: All2AllBackend = "allgather_reducescatter"
    """MoE all-to-all implementation; env FORWARDKIT_ALL2ALL_BACKEND overrides it."""
    disable_custom_all_reduce: bool = False
    """Use the plain collective instead of a custom all-reduce kernel."""
    enable_dbo: bool = False
    """Dual batch overlap: split a step into two micro-batches."""
    ubatch_size: int = 0
    """Micro-batches per step when > 1 (without DBO)."""
    dbo_decode_token_threshold: int = 32
    """Micro-batch a decode-only step when ``num_tokens >= threshold``."""
    dbo_prefill_token_threshold: int = 512
    """Micro-batch a step with a prefill when ``num_tokens >= threshold``."""
    disable_nccl_for_dp_synchronization: bool | None = None
    """Sync DP with gloo on CPU; None = the engine sets it to ``async_scheduling``."""
    distributed_executor_backend: str | None = None
    """uni, mp, ray or external_launcher; None = chosen in post-init."""
    nnodes: int = 1
    """Nodes taking part."""
    node_rank: int = 0
    """This node's rank."""
    master_addr: str = "127.0.0.1"
    """Address of the torch.distributed master (multi-node)."""
    master_port: int = 29501
    """Port of the torch.distributed master (multi-node)."""
    rank: int = 0
    """Global rank of this process."""
    world_size: int = field(init=False, default=1)
    """PP x TP x PCP (x DP with external_launcher)."""
    data_parallel_index: int = field(init=False, default=0)
    """Equals ``data_parallel_rank`` after post-init."""

    def __post_init__(self) -> None:
        self._port_list: list[int] = []
        self._apply_all2all_env()
        for name in ("pipeline_parallel_size", "tensor_parallel_size", "prefill_context_parallel_size",
                     "decode_context_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.ubatch_size < 0:
            raise ValueError(f"ubatch_size must be >= 0, got {self.ubatch_size}")

        external = self.distributed_executor_backend == "external_launcher"
        self.world_size = (
            self.pipeline_parallel_size * self.tensor_parallel_size * self.prefill_context_parallel_size
        )
        if external:
            self.world_size *= self.data_parallel_size

        self._place_dp_rank(external)
        self.data_parallel_index = self.data_parallel_rank

        if external:
            os.environ["FORWARDKIT_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.distributed_executor_backend is None:
            if self.world_size > 1:
                self.distributed_executor_backend = "ray" if self.data_parallel_backend == "ray" else "mp"
            else:
                self.distributed_executor_backend = "uni"
        if self.distributed_executor_backend not in _EXECUTORS:
            raise ValueError(
                f"distributed_executor_backend {self.distributed_executor_backend!r} is not "
                f"supported; expected one of {list(_EXECUTORS)}"
            )
        if self.nnodes > 1 and self.distributed_executor_backend not in ("mp", "uni", "external_launcher"):
            raise ValueError(
                f"nnodes={self.nnodes} needs distributed_executor_backend mp, uni or "
                f"external_launcher, got {self.distributed_executor_backend!r}"
            )

    def _apply_all2all_env(self) -> None:
        """The deprecated ``FORWARDKIT_ALL2ALL_BACKEND`` overrides ``all2all_backend``."""
        if not envs.is_set("FORWARDKIT_ALL2ALL_BACKEND"):
            return
        value = envs.FORWARDKIT_ALL2ALL_BACKEND
        if value not in ALL2ALL_BACKENDS:
            raise ValueError(
                f"Invalid value {value!r} for FORWARDKIT_ALL2ALL_BACKEND. "
                f"Valid options: {list(ALL2ALL_BACKENDS)}"
            )
        logger.warning_once(
            "FORWARDKIT_ALL2ALL_BACKEND is deprecated; use the all2all_backend field. "
            "Using %s from the environment.",
            value,
        )
        self.all2all_backend = value

    def _place_dp_rank(self, external: bool) -> None:
        """This process's DP rank and master port: from the fields (or ``RANK`` under an
        external launcher) when DP > 1, else from the offline SPMD environment variables."""
        if self.data_parallel_size > 1 or self.data_parallel_size_local == 0:
            if external:
                self.data_parallel_rank = int(os.environ["RANK"]) // (
                    self.world_size // self.data_parallel_size
                )
            if not self._port_list:
                self._port_list = get_open_ports(5)
            self.data_parallel_master_port = self._port_list.pop()
            if not 0 <= self.data_parallel_rank < self.data_parallel_size:
                raise ValueError(
                    f"data_parallel_rank ({self.data_parallel_rank}) must be in the range "
                    f"[0, {self.data_parallel_size})"
                )
        else:
            # Offline SPMD launch: one process per DP rank, told its place by the environment.
            self.data_parallel_size = envs.FORWARDKIT_DP_SIZE
            self.data_parallel_rank = envs.FORWARDKIT_DP_RANK
            self.data_parallel_rank_local = envs.FORWARDKIT_DP_RANK_LOCAL
            self.data_parallel_master_ip = envs.FORWARDKIT_DP_MASTER_IP
            self.data_parallel_master_port = envs.FORWARDKIT_DP_MASTER_PORT
            if self.data_parallel_size > 1 and self.is_moe_model is False:
                raise ValueError(
                    "Offline data parallel mode is not supported/useful for dense models. "
                    "Launch one independent engine per replica instead."
                )

    @model_validator(mode="after")
    def _check_cross_fields(self) -> ParallelConfig:
        if self.data_parallel_size_local > self.data_parallel_size:
            raise ValueError(
                f"data_parallel_size_local ({self.data_parallel_size_local}) must be <= "
                f"data_parallel_size ({self.data_parallel_size})"
            )
        if self.data_parallel_external_lb and self.data_parallel_size <= 1:
            raise ValueError(
                "data_parallel_external_lb can only be set when data_parallel_size > 1, got "
                f"data_parallel_size={self.data_parallel_size}"
            )
        if self.enable_eplb:
            if not current_platform.is_cuda_alike():
                raise ValueError(
                    "Expert parallelism load balancing is only supported on CUDA devices now, "
                    f"not on platform {current_platform.name!r}."
                )
            if not self.enable_expert_parallel:
                raise ValueError("enable_expert_parallel must be True to use EPLB.")
            if self.tensor_parallel_size * self.data_parallel_size <= 1:
                raise ValueError(
                    "EPLB requires tensor_parallel_size or data_parallel_size to be greater than 1, "
                    f"but got TP={self.tensor_parallel_size} and DP={self.data_parallel_size}."
                )
        elif self.eplb_config.num_redundant_experts != 0:
            raise ValueError(
                "num_redundant_experts is set to "
                f"{self.eplb_config.num_redundant_experts} but EPLB is not enabled. Either "
                "enable EPLB or unset num_redundant_experts."
            )
        return self

    @property
    def world_size_across_dp(self) -> int:
        """``world_size * data_parallel_size``."""
        return self.world_size * self.data_parallel_size

    @property
    def use_ubatching(self) -> bool:
        """Micro-batching is on: DBO, or ``ubatch_size > 1``."""
        return self.enable_dbo or self.ubatch_size > 1

    @property
    def num_ubatches(self) -> int:
        """2 with DBO, else ``ubatch_size``."""
        return 2 if self.enable_dbo else self.ubatch_size

    @property
    def use_sequence_parallel_moe(self) -> bool:
        """MoE runs sequence-parallel over TP (EP with TP > 1 and DP > 1 on a supported backend)."""
        return (
            self.all2all_backend in _SEQUENCE_PARALLEL_MOE_BACKENDS
            and self.enable_expert_parallel
            and self.tensor_parallel_size > 1
            and self.data_parallel_size > 1
        )

    @property
    def nnodes_within_dp(self) -> int:
        """Nodes one DP replica spans."""
        if self.nnodes == 1:
            return 1
        return self.nnodes // (self.data_parallel_size // max(self.data_parallel_size_local, 1))

    @property
    def local_world_size(self) -> int:
        """Ranks of one replica on this node."""
        return self.world_size // self.nnodes_within_dp

    @property
    def node_rank_within_dp(self) -> int:
        """This node's index inside its DP replica."""
        return self.node_rank % self.nnodes_within_dp

    def get_next_dp_init_port(self) -> int:
        """A port for the next DP process-group init: a reserved free port, else the master port
        (which is then incremented)."""
        if self._port_list:
            return self._port_list.pop()
        port = self.data_parallel_master_port
        self.data_parallel_master_port += 1
        return port

    def compute_hash(self) -> str:
        """SHA-256 over every field except the launch/address ones in ``_HASH_IGNORED``."""
        return hash_factors(get_hash_factors(self, _HASH_IGNORED))


def check_parallel_fits_model(parallel: ParallelConfig, model: ModelConfig) -> None:
    """Raise a ``ValueError`` naming the fields when the model cannot be split as asked:
    attention heads not divisible by ``tensor_parallel_size``, KV heads that neither divide
    nor are divided by it, an (expert) intermediate size not divisible by it, or fewer experts
    than expert-parallel ranks. The vocabulary need not divide: it is padded per rank."""
    tp = parallel.tensor_parallel_size
    dp = parallel.data_parallel_size
    hf = model.hf_config
    where = f"the model's config.json ({model.model or model.architecture})"
    if tp > 1:
        heads = model.get_num_attention_heads()
        if heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads="
                             f"{heads} of {where}; use a tensor_parallel_size that divides it")
        kv = model.get_num_kv_heads()
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={kv} of {where}: "
                             "one must divide the other (KV heads are split, or replicated when "
                             "there are fewer than TP ranks)")
        experts = model.is_moe
        ep = parallel.enable_expert_parallel and dp * tp > 1
        inter = hf.get("intermediate_size")
        if inter is not None and not (experts and ep) and int(inter) % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size={inter} "
                             f"of {where}")
    if tp > 1:
        _check_block_boundaries(tp, model, where)
    if model.is_moe and parallel.enable_expert_parallel and dp * tp > 1:
        num = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
        if num < dp * tp:
            raise ValueError(f"enable_expert_parallel over data_parallel_size x "
                             f"tensor_parallel_size = {dp * tp} ranks needs at least one expert "
                             f"per rank, but {where} has {num} experts")


_BLOCK = 32  # weights in one block of the packed formats (quantization/formats.py)


def _check_block_boundaries(tp: int, model: ModelConfig, where: str) -> None:
    """ValueError when a row-parallel projection with packed weights (quantized on load, or a
    GGUF file's quantized ``attn_output`` / ``ffn_down``) would be cut inside a 32-weight block:
    each rank's input slice must be a whole number of blocks."""
    hf = model.hf_config
    types: dict[str, int] = hf.get("gguf_tensor_types") or {}
    inputs = {"attn_output": ("num_attention_heads x head_dim",
                              model.get_num_attention_heads() * model.get_head_size())}
    if hf.get("intermediate_size") is not None and not model.is_moe:
        inputs["ffn_down"] = ("intermediate_size", int(hf["intermediate_size"]))
    for tensor, (what, size) in inputs.items():
        packed = model.quantization is not None or any(
            name.endswith(f".{tensor}.weight") and kind in GGUF_BLOCK_TYPES
            for name, kind in types.items())
        if packed and (size // tp) % _BLOCK:
            raise ValueError(
                f"tensor_parallel_size={tp} cuts the {_BLOCK}-weight blocks of the packed "
                f"{tensor} weights of {where}: each rank would hold {size // tp} of its {what}="
                f"{size} inputs, not a multiple of {_BLOCK}; use a tensor_parallel_size that "
                f"leaves a multiple of {_BLOCK} per rank")
