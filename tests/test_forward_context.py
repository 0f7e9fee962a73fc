"""forwardkit.forward_context: descriptors, SP helpers, DPMetadata, lifecycle, vLLM's names."""

from __future__ import annotations

import pytest
import torch

import forwardkit.forward_context as fc
from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.config.engine import EngineConfig
from forwardkit.config.parallel import ParallelConfig
from forwardkit.forward_context import (
    BatchDescriptor,
    DPMetadata,
    ForwardContext,
    _compute_chunked_local_num_tokens,
    _compute_sp_num_tokens,
    create_forward_context,
    get_forward_context,
    is_forward_context_available,
    override_forward_context,
    set_forward_context,
)

NOT_SET = "Forward context is not set. Please use `set_forward_context` to set the forward context."


def make_cfg(dp: int = 1, **pc) -> EngineConfig:
    cfg = EngineConfig(parallel_config=ParallelConfig(data_parallel_size=dp, **pc))
    cfg.compilation_config.static_forward_context["layer.0.attn"] = "L0"  # a registered layer
    return cfg


SEED_NAMES = [
    "_compute_chunked_local_num_tokens", "_compute_sp_num_tokens", "_forward_context",
    "batchsize_forward_time", "batchsize_logging_interval", "coordinate_batch_across_dp",
    "create_forward_context", "current_platform", "forward_start_time", "get_forward_context",
    "init_logger", "is_forward_context_available", "last_logging_time", "logger",
    "override_forward_context", "set_forward_context", "track_batchsize", "UBatchSlices",
    "DPMetadata", "ForwardContext", "BatchDescriptor",
]


@pytest.mark.parametrize("name", SEED_NAMES)
def test_seed_names_exist(name):
    assert hasattr(fc, name)


def test_seed_dpmetadata_methods():
    for name in ("make", "chunked_sizes", "sp_local_sizes", "get_chunk_sizes_across_dp_rank",
                 "cu_tokens_across_sp", "local_sizes"):
        assert hasattr(DPMetadata, name)
    from forwardkit.distributed.dp_utils import coordinate_batch_across_dp

    assert fc.coordinate_batch_across_dp is coordinate_batch_across_dp


# --- BatchDescriptor -------------------------------------------------------------------


def test_batch_descriptor_defaults():
    d = BatchDescriptor(8)
    assert repr(d) == "BatchDescriptor(num_tokens=8, num_reqs=None, uniform=False, has_lora=False)"
    assert d == (8, None, False, False)
    assert hash(d) == hash((8, None, False, False))
    assert BatchDescriptor._fields == ("num_tokens", "num_reqs", "uniform", "has_lora")
    assert BatchDescriptor._field_defaults == {"num_reqs": None, "uniform": False, "has_lora": False}


def test_relax_for_mixed_batch():
    relaxed = BatchDescriptor(num_tokens=16, num_reqs=16, uniform=True, has_lora=True)
    assert relaxed.relax_for_mixed_batch_cudagraphs() == BatchDescriptor(16, None, False, True)
    assert BatchDescriptor(16, 16, True, False).relax_for_mixed_batch_cudagraphs() == BatchDescriptor(16)


# --- SP helpers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("t", "sp", "expected"),
    [
        ([5, 3, 0], 1, [5, 3, 0]),
        ([5, 3, 0], 2, [3, 3, 2, 2, 0, 0]),
        ([7, 8], 4, [2] * 8),
        ([10], 3, [4, 4, 4]),
        ([0, 1], 2, [0, 0, 1, 1]),
    ],
)
def test_compute_sp_num_tokens(t, sp, expected):
    out = _compute_sp_num_tokens(torch.tensor(t), sp)
    assert out == expected
    assert all(type(x) is int for x in out)


@pytest.mark.parametrize(
    ("t", "sp", "max_tokens", "chunk", "expected"),
    [
        ([10, 3, 0], 1, 4, 0, [4, 3, 1]),
        ([10, 3, 0], 1, 4, 1, [4, 1, 1]),
        ([10, 3, 0], 1, 4, 2, [2, 1, 1]),
        ([10, 3, 0], 1, 4, 3, [1, 1, 1]),
        ([10, 7], 2, 2, 0, [2, 2, 2, 2]),
        ([10, 7], 2, 2, 1, [2, 2, 2, 2]),
        ([10, 7], 2, 2, 2, [1, 1, 1, 1]),
        ([100, 50], 1, 64, 0, [64, 50]),
        ([100, 50], 1, 64, 1, [36, 1]),
    ],
)
def test_chunked_local_num_tokens(t, sp, max_tokens, chunk, expected):
    assert _compute_chunked_local_num_tokens(torch.tensor(t), sp, max_tokens, chunk) == expected


def test_sp_size_must_be_positive():
    with pytest.raises(ValueError, match="sequence_parallel_size"):
        _compute_sp_num_tokens(torch.tensor([1]), 0)


# --- DPMetadata -------------------------------------------------------------------------

PC3 = ParallelConfig(data_parallel_size=3, data_parallel_rank=1, is_moe_model=True)


def make_dp_metadata() -> DPMetadata:
    return DPMetadata.make(PC3, 7, torch.tensor([5, 7, 2], dtype=torch.int32))


def test_dp_metadata_make():
    m = make_dp_metadata()
    assert repr(m) == (
        "DPMetadata(max_tokens_across_dp_cpu=tensor(7, dtype=torch.int32), "
        "num_tokens_across_dp_cpu=tensor([5, 7, 2], dtype=torch.int32), local_sizes=None)"
    )
    assert m.max_tokens_across_dp_cpu.shape == torch.Size([])


def test_chunked_and_sp_sizes():
    m = make_dp_metadata()
    with m.chunked_sizes(1, 4, 1) as s:
        assert s == [1, 3, 1]
        assert m.get_chunk_sizes_across_dp_rank() == [1, 3, 1]
    assert m.local_sizes is None
    with m.sp_local_sizes(2) as s:
        assert s == [3, 3, 4, 4, 1, 1]
    assert m.local_sizes is None
    with pytest.raises(AssertionError) as info:
        m.get_chunk_sizes_across_dp_rank()
    assert str(info.value) == ""


def test_local_sizes_reset_on_exception():
    m = make_dp_metadata()
    with pytest.raises(KeyError), m.chunked_sizes(1, 4, 0):
        raise KeyError("boom")
    assert m.local_sizes is None


@pytest.mark.parametrize(
    ("sp", "expected"),
    [(1, [5, 12, 14]), (2, [3, 6, 10, 14, 15, 16]), (3, [2, 4, 6, 9, 12, 15, 16, 17, 18])],
)
def test_cu_tokens_across_sp(sp, expected):
    cu = make_dp_metadata().cu_tokens_across_sp(sp)
    assert cu.dtype == torch.int64
    assert cu.tolist() == expected


def test_dp_metadata_make_errors():
    with pytest.raises(AssertionError) as info:
        DPMetadata.make(PC3, 6, torch.tensor([5, 7, 2]))
    assert str(info.value) == "7 6"
    with pytest.raises(AssertionError):
        DPMetadata.make(ParallelConfig(data_parallel_size=1, data_parallel_rank=0, is_moe_model=True), 5,
                        torch.tensor([5]))
    with pytest.raises(AssertionError):
        DPMetadata.make(ParallelConfig(data_parallel_size=3, data_parallel_rank=1, is_moe_model=False), 7,
                        torch.tensor([5, 7, 2]))
    m = DPMetadata.make(ParallelConfig(data_parallel_size=2, data_parallel_rank=0, is_moe_model=None), 5,
                        torch.tensor([5, 7]))
    assert repr(m) == (
        "DPMetadata(max_tokens_across_dp_cpu=tensor(7), num_tokens_across_dp_cpu=tensor([5, 7]), "
        "local_sizes=None)"
    )
    assert m.max_tokens_across_dp_cpu.dtype == torch.int64


# --- lifecycle --------------------------------------------------------------------------


def test_forward_context_repr_and_mode_check():
    ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, virtual_engine=0)
    assert repr(ctx) == (
        "ForwardContext(no_compile_layers={}, attn_metadata={}, virtual_engine=0, "
        "dp_metadata=None, cudagraph_runtime_mode=<CUDAGraphMode.NONE: 0>, "
        "batch_descriptor=None, ubatch_slices=None, additional_kwargs={})"
    )
    other = ForwardContext(no_compile_layers={}, attn_metadata={}, virtual_engine=0)
    assert other.additional_kwargs is not ctx.additional_kwargs
    with pytest.raises(AssertionError) as info:
        ForwardContext({}, {}, 0, cudagraph_runtime_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    assert str(info.value) == "Invalid cudagraph runtime mode: FULL_AND_PIECEWISE"


def test_get_forward_context_outside_a_context_raises():
    assert is_forward_context_available() is False
    with pytest.raises(AssertionError) as info:
        get_forward_context()
    assert str(info.value) == NOT_SET
    assert isinstance(info.value, fc.ForwardContextNotSetError)
    assert fc._forward_context is None


def test_set_and_nest():
    cfg = make_cfg()
    with set_forward_context({"layer.0.attn": "META"}, cfg, num_tokens=8,
                             cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE) as target:
        assert target is None
        ctx = get_forward_context()
        assert ctx.batch_descriptor == BatchDescriptor(8, None, False, False)
        assert ctx.cudagraph_runtime_mode is CUDAGraphMode.PIECEWISE
        assert ctx.no_compile_layers is cfg.compilation_config.static_forward_context
        assert ctx.additional_kwargs == {}
        assert ctx.dp_metadata is None
        assert ctx.virtual_engine == 0
        assert fc._forward_context is ctx
        with set_forward_context(None, cfg):
            inner = get_forward_context()
            assert inner.attn_metadata is None
            assert inner.batch_descriptor is None
        assert get_forward_context().attn_metadata == {"layer.0.attn": "META"}
    assert not is_forward_context_available()


@pytest.mark.parametrize(
    ("num_tokens", "mode", "given", "expected"),
    [
        (8, CUDAGraphMode.FULL, BatchDescriptor(8, 8, True), BatchDescriptor(8, 8, True, False)),
        (None, CUDAGraphMode.FULL, None, None),
        (8, CUDAGraphMode.NONE, None, None),
        (8, CUDAGraphMode.PIECEWISE, None, BatchDescriptor(8)),
    ],
)
def test_default_batch_descriptor(num_tokens, mode, given, expected):
    with set_forward_context({}, make_cfg(), num_tokens=num_tokens, cudagraph_runtime_mode=mode,
                             batch_descriptor=given):
        assert get_forward_context().batch_descriptor == expected


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE])
def test_composite_mode_rejected_before_install(mode):
    with pytest.raises(AssertionError) as info, \
            set_forward_context({}, make_cfg(), num_tokens=8, cudagraph_runtime_mode=mode):
        pass
    assert str(info.value) == f"Invalid cudagraph runtime mode: {mode.name}"
    assert not is_forward_context_available()


def test_body_exception_propagates_and_restores():
    with pytest.raises(ValueError, match="body"), set_forward_context({}, make_cfg(), num_tokens=4):
        assert is_forward_context_available()
        raise ValueError("body")
    assert not is_forward_context_available()


def test_create_and_override_forward_context():
    cfg = make_cfg()
    ctx = create_forward_context({"a": 1}, cfg, virtual_engine=2, additional_kwargs=None)
    assert repr(ctx) == (
        "ForwardContext(no_compile_layers={'layer.0.attn': 'L0'}, attn_metadata={'a': 1}, "
        "virtual_engine=2, dp_metadata=None, cudagraph_runtime_mode=<CUDAGraphMode.NONE: 0>, "
        "batch_descriptor=None, ubatch_slices=None, additional_kwargs={})"
    )
    assert not is_forward_context_available()  # create does not install
    with override_forward_context(ctx):
        assert get_forward_context() is ctx
        with override_forward_context(None):
            assert not is_forward_context_available()
        assert get_forward_context() is ctx
    assert not is_forward_context_available()


def test_platform_additional_kwargs(cpu_platform, monkeypatch):
    seen = {}

    def extras(**kwargs):
        seen.update(kwargs)
        return {"extra": 1}

    monkeypatch.setattr(cpu_platform, "set_additional_forward_context", extras)
    cfg = make_cfg()
    with set_forward_context({"m": 1}, cfg, num_tokens=3):
        assert get_forward_context().additional_kwargs == {"extra": 1}
    assert set(seen) == {
        "attn_metadata", "vllm_config", "virtual_engine", "dp_metadata", "num_tokens",
        "num_tokens_across_dp", "cudagraph_runtime_mode", "batch_descriptor", "ubatch_slices",
    }
    assert seen["vllm_config"] is cfg and seen["num_tokens"] == 3


def test_dp_metadata_from_given_counts_without_communication():
    cfg = make_cfg(dp=2, data_parallel_rank=1, is_moe_model=True)
    with set_forward_context({}, cfg, num_tokens=16, num_tokens_across_dp=torch.tensor([16, 16])):
        dp = get_forward_context().dp_metadata
        assert dp.num_tokens_across_dp_cpu.tolist() == [16, 16]
        assert int(dp.max_tokens_across_dp_cpu) == 16
    with set_forward_context(None, cfg):  # neither metadata nor num_tokens: no DP metadata
        assert get_forward_context().dp_metadata is None


def test_dp_needs_num_tokens():
    cfg = make_cfg(dp=2, data_parallel_rank=0, is_moe_model=True)
    with pytest.raises(AssertionError, match="num_tokens"), set_forward_context({}, cfg):
        pass
    assert not is_forward_context_available()


def test_with_real_engine_config():
    from forwardkit.config.engine import EngineConfig

    cfg = EngineConfig()
    with set_forward_context({}, cfg, num_tokens=4, cudagraph_runtime_mode=CUDAGraphMode.FULL):
        ctx = get_forward_context()
        assert ctx.no_compile_layers is cfg.compilation_config.static_forward_context
        assert ctx.batch_descriptor == BatchDescriptor(4)
        assert ctx.dp_metadata is None


def test_platform_subclass_hook_is_called():
    from forwardkit.platforms import CpuPlatform, use_platform

    class ExtrasPlatform(CpuPlatform):
        def set_additional_forward_context(self, **kwargs):
            return {"batch": kwargs["batch_descriptor"]}

    with use_platform(ExtrasPlatform()), set_forward_context(
        {}, make_cfg(), num_tokens=5, cudagraph_runtime_mode=CUDAGraphMode.FULL
    ):
        assert get_forward_context().additional_kwargs == {"batch": BatchDescriptor(5)}


def test_dp_metadata_int_maximum_and_counts_follow_the_tensor():
    m = make_dp_metadata()
    assert m.max_tokens_across_dp == 7 and m.num_tokens_across_dp == [5, 7, 2]
    m.num_tokens_across_dp_cpu = torch.tensor([9, 7, 1], dtype=torch.int32)
    assert m.num_tokens_across_dp == [9, 7, 1] and m.max_tokens_across_dp == 9
    assert int(m.max_tokens_across_dp_cpu) == 9
    m.max_tokens_across_dp_cpu = torch.tensor(11)  # an explicit maximum wins, as in a dataclass
    assert m.max_tokens_across_dp == 11
    direct = DPMetadata(torch.tensor(4), torch.tensor([4, 3]))
    assert direct.max_tokens_across_dp == 4 and direct.local_sizes is None


# --- foreign (vLLM-like) config objects ---------------------------------------------------


class _VllmLikeCompilationConfig:
    """A compilation config of another make: only the attribute vLLM's own has."""

    __slots__ = ("static_forward_context",)

    def __init__(self) -> None:
        self.static_forward_context: dict[str, object] = {"model.layers.0.attn": "L0"}


class _VllmLikeParallelConfig:
    def __init__(self, dp: int) -> None:
        self.data_parallel_size = dp
        self.data_parallel_rank = 0
        self.is_moe_model = True


class _VllmLikeConfig:
    """Duck-typed ``VllmConfig``: what the seed's set_forward_context read and nothing more."""

    def __init__(self, dp: int = 1, compilation_config: object | None = None) -> None:
        self.compilation_config = compilation_config or _VllmLikeCompilationConfig()
        self.parallel_config = _VllmLikeParallelConfig(dp)


@pytest.mark.parametrize("cc_kind", ["slots", "dict"])
def test_set_forward_context_accepts_a_vllm_like_config(cc_kind):
    cc: object
    if cc_kind == "slots":
        cc = _VllmLikeCompilationConfig()
    else:  # an instance with a __dict__ but without forwardkit's private compile state
        cc = type("CC", (), {})()
        cc.static_forward_context = {"model.layers.0.attn": "L0"}  # type: ignore[attr-defined]
    cfg = _VllmLikeConfig(compilation_config=cc)
    with set_forward_context({"model.layers.0.attn": None}, cfg, num_tokens=3):  # type: ignore[arg-type]
        ctx = get_forward_context()
        assert ctx.no_compile_layers is cc.static_forward_context  # type: ignore[attr-defined]
        assert ctx.dp_metadata is None
    assert not is_forward_context_available()
    assert create_forward_context(None, cfg).no_compile_layers is cc.static_forward_context  # type: ignore[arg-type, attr-defined]


def test_set_forward_context_vllm_like_config_under_dp():
    cfg = _VllmLikeConfig(dp=2)
    across = torch.tensor([5, 7], dtype=torch.int32)
    with set_forward_context({}, cfg, num_tokens=5, num_tokens_across_dp=across):  # type: ignore[arg-type]
        ctx = get_forward_context()
        assert ctx.no_compile_layers == {"model.layers.0.attn": "L0"}
        assert ctx.dp_metadata is not None and ctx.dp_metadata.max_tokens_across_dp == 7


def test_set_forward_context_names_a_config_without_layers():
    cfg = _VllmLikeConfig(compilation_config=object())
    with pytest.raises(TypeError, match=r"static_forward_context is a dict.*got object"), \
            set_forward_context(None, cfg):  # type: ignore[arg-type]
        pass
    assert not is_forward_context_available()
