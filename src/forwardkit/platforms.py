"""The platform forwardkit runs on: ``current_platform`` (cpu or cuda).

``current_platform`` is a proxy to the active :class:`Platform`. Tests (and users who
want to resolve a CUDA configuration on a CPU machine) swap it with
:func:`use_platform` / :func:`set_current_platform`; every module that imported
``current_platform`` sees the swap, because the proxy forwards each attribute lookup.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from forwardkit import envs
from forwardkit.logger import init_logger

__all__ = [
    "CpuCapabilities",
    "CpuPlatform",
    "CudaPlatform",
    "Platform",
    "active_platform",
    "cpu_capabilities",
    "current_platform",
    "detect_platform",
    "platform_by_name",
    "set_current_platform",
    "use_platform",
]

logger = init_logger(__name__)


@dataclass(frozen=True)
class CpuCapabilities:
    """What this machine's CPU can do, probed once per process: the one answer the dtype
    choice (``config/builder.py``), the linear router and the native kernels
    (``kernels/cpu/``) read."""

    flags: frozenset[str]
    """The feature flags Linux reports in ``/proc/cpuinfo`` (empty elsewhere)."""
    model_name: str
    """The CPU's model name ("" where ``/proc/cpuinfo`` is absent)."""
    native_bf16: bool
    """oneDNN runs bf16 matmuls natively here (AVX-512-BF16 or AMX): PyTorch's bf16 CPU
    matmul is not emulated."""

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def amx(self) -> bool:
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def avx2_fma(self) -> bool:
        """AVX2 and FMA: forwardkit's AVX2 kernel builds (bf16 widened to float32 in registers)
        run here."""
        return {"avx2", "fma"} <= self.flags

    def has(self, needed: frozenset[str] | set[str]) -> bool:
        """Whether the CPU reports every flag in ``needed``."""
        return needed <= self.flags


def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's ``/proc/cpuinfo`` fields ({} where the file is absent)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block ends here
                key, sep, value = line.partition(":")
                if sep:
                    out.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return out


# flags a CPU capped at AVX-512 does not report (FORWARDKIT_CPU_MAX_ISA=avx512), those a CPU
# capped at AVX2 does not report, and the vector extensions "generic" drops on top of them
_AMX = ("amx_",)
_ABOVE_AVX2 = ("avx512", "amx_", "avx10")
_VECTOR = ("avx", "fma", "f16c", "sse4", "ssse3")


def cap_capabilities(caps: CpuCapabilities, max_isa: str) -> CpuCapabilities:
    """``caps`` as a CPU capped at ``max_isa`` reports them: ``"native"`` unchanged;
    ``"avx512"`` without AMX flags (native bf16 matmuls stay where AVX-512-BF16 gives them;
    oneDNN's own choice follows ``ONEDNN_MAX_CPU_ISA``); ``"avx2"`` without AVX-512 / AMX flags
    and without native bf16 matmuls; ``"generic"`` without any vector extension either."""
    if max_isa == "native":
        return caps
    if max_isa not in ("avx512", "avx2", "generic"):
        raise ValueError(
            f"FORWARDKIT_CPU_MAX_ISA={max_isa!r}; accepted: native, avx512, avx2, generic")
    if max_isa == "avx512":
        flags = frozenset(f for f in caps.flags if not f.startswith(_AMX))
        return CpuCapabilities(flags, caps.model_name,
                               caps.native_bf16 and "avx512_bf16" in flags)
    dropped = _ABOVE_AVX2 + (_VECTOR if max_isa == "generic" else ())
    flags = frozenset(f for f in caps.flags if not f.startswith(dropped))
    return CpuCapabilities(flags, caps.model_name, False)


@functools.lru_cache(maxsize=1)
def cpu_capabilities() -> CpuCapabilities:
    """This machine's :class:`CpuCapabilities` (probed on the first call, then cached), capped
    at ``FORWARDKIT_CPU_MAX_ISA`` (:func:`cap_capabilities`; a stand-in for a smaller CPU:
    the dtype choice, the router and every native kernel's build choice then see it)."""
    info = _cpuinfo_fields()
    native_bf16 = bool(torch.backends.mkldnn.is_available()
                       and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    probed = CpuCapabilities(frozenset(info.get("flags", "").split()), info.get("model name", ""),
                             native_bf16)
    return cap_capabilities(probed, envs.FORWARDKIT_CPU_MAX_ISA)


class Platform:
    """Capabilities of one device type. Subclasses override the class attributes."""

    name: str = "unspecified"
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    _global_graph_pool: Any = None

    def is_cpu(self) -> bool:
        """True on the CPU platform."""
        return self.device_type == "cpu"

    def is_cuda(self) -> bool:
        """True on NVIDIA CUDA."""
        return self.device_type == "cuda"

    def is_cuda_alike(self) -> bool:
        """True on CUDA (and ROCm, which torch also exposes as ``cuda``)."""
        return self.device_type == "cuda"

    def supports_static_graph(self) -> bool:
        """Whether this kind of device has CUDA graphs (static graphs) at all."""
        return False

    def can_capture_graphs(self) -> bool:
        """Whether CUDA graphs can really be captured now: the platform has them and, for a
        CUDA platform, a GPU is visible (a CUDA platform emulated on a CPU machine cannot)."""
        if not self.supports_static_graph():
            return False
        return torch.cuda.is_available() if self.is_cuda_alike() else True

    def default_compile_backend(self) -> str:
        """The Inductor backend name used when ``CompilationConfig.backend`` is empty."""
        return "inductor"

    def get_device_capability(self) -> int | None:
        """Compute capability as an int (90 for sm_90), or None off CUDA."""
        return None

    def device(self, index: int = 0) -> torch.device:
        """The torch device for this platform."""
        return torch.device(self.device_type) if self.is_cpu() else torch.device(self.device_type, index)

    def set_additional_forward_context(self, **kwargs: Any) -> dict[str, Any]:
        """Platform extras for ``ForwardContext.additional_kwargs``; none by default."""
        return {}

    @property
    def synchronize(self) -> Callable[[], None] | None:
        """``torch.<device>.synchronize`` or None when the device has none."""
        module = getattr(torch, self.device_type, None)
        fn = getattr(module, "synchronize", None) if module is not None else None
        if fn is None:
            logger.warning_once("platform %s has no synchronize(); timings skip the sync", self.name)
        return fn

    def graph_pool_handle(self) -> Any:
        """A fresh CUDA-graph memory-pool handle."""
        raise RuntimeError(f"platform {self.name!r} cannot capture CUDA graphs")

    def get_global_graph_pool(self) -> Any:
        """One graph memory pool shared by every capture on this platform (made lazily)."""
        cls = type(self)
        if cls._global_graph_pool is None:
            cls._global_graph_pool = self.graph_pool_handle()
        return cls._global_graph_pool

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CpuPlatform(Platform):
    """Plain CPU: no static graphs, Inductor compiles C++ with the system compiler."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    @property
    def synchronize(self) -> Callable[[], None] | None:
        return None  # CPU work is synchronous; nothing to wait for.


class CudaPlatform(Platform):
    """NVIDIA CUDA. Constructible without a GPU so tests can resolve CUDA configs on CPU."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

    def __init__(self, device_capability: int | None = None) -> None:
        self._capability = device_capability

    def supports_static_graph(self) -> bool:
        return True

    def get_device_capability(self) -> int | None:
        if self._capability is not None:
            return self._capability
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return major * 10 + minor
        return None

    def graph_pool_handle(self) -> Any:
        return torch.cuda.graph_pool_handle()


_PLATFORMS: dict[str, Callable[[], Platform]] = {"cpu": CpuPlatform, "cuda": CudaPlatform}


def platform_by_name(name: str) -> Platform:
    """Build a platform from its name: ``cpu`` or ``cuda``."""
    try:
        return _PLATFORMS[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown platform {name!r}; expected one of {sorted(_PLATFORMS)}") from None


def detect_platform() -> Platform:
    """CUDA when a GPU is visible, else CPU."""
    return CudaPlatform() if torch.cuda.is_available() else CpuPlatform()


class _PlatformProxy:
    """Forwards every attribute to the active platform (see :func:`use_platform`)."""

    def __init__(self) -> None:
        object.__setattr__(self, "_active", None)

    def _get(self) -> Platform:
        active = object.__getattribute__(self, "_active")
        if active is None:
            active = detect_platform()
            object.__setattr__(self, "_active", active)
        return active

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._get(), name, value)

    def __repr__(self) -> str:
        return f"current_platform -> {self._get()!r}"


current_platform: Any = _PlatformProxy()
_proxy_state = current_platform.__dict__


def active_platform() -> Platform:
    """The platform ``current_platform`` forwards to, read without the proxy's method lookups
    (per-step code calls this: ~0.05 us against ~0.3 us for ``current_platform._get()``)."""
    active = _proxy_state["_active"]
    return active if active is not None else current_platform._get()


def set_current_platform(platform: Platform | str | None) -> Platform | None:
    """Make ``platform`` the active one (None: detect again); returns the previous one."""
    if isinstance(platform, str):
        platform = platform_by_name(platform)
    previous = object.__getattribute__(current_platform, "_active")
    object.__setattr__(current_platform, "_active", platform)
    return previous


@contextlib.contextmanager
def use_platform(platform: Platform | str) -> Iterator[Platform]:
    """Temporarily make ``platform`` the active one; restores the previous on exit."""
    previous = set_current_platform(platform)
    try:
        yield current_platform._get()
    finally:
        set_current_platform(previous)
