"""CudagraphDispatcher: graph keys, padding and runtime mode per batch (vLLM 0.14.0 semantics)."""

from __future__ import annotations

import pytest
import torch

from forwardkit.config.compilation import CompilationMode, CUDAGraphMode
from forwardkit.config.engine import EngineConfig
from forwardkit.config.frozen import unfrozen
from forwardkit.config.parallel import ParallelConfig
from forwardkit.config.scheduler import SchedulerConfig, SpeculativeConfig
from forwardkit.cudagraph.dispatcher import (
    CudagraphDispatcher,
    cudagraphs_available,
)
from forwardkit.forward_context import BatchDescriptor as d
from forwardkit.platforms import CpuPlatform, CudaPlatform

M = CUDAGraphMode


def padding_table(sizes: list[int]) -> list[int]:
    """Smallest capture size >= b for every b up to the max (entry 0 is 0)."""
    return [0] + [min(s for s in sizes if s >= b) for b in range(1, max(sizes, default=0) + 1)]


def make_cfg(
    mode: CUDAGraphMode = M.FULL_AND_PIECEWISE,
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
    max_num_seqs: int = 8,
    spec_tokens: int | None = None,
    lora: bool = False,
    specialize_lora: bool = True,
    piecewise_ok: bool = True,
    dp_size: int = 1,
    dp_rank: int = 0,
    tp: int = 1,
    enable_sp: bool = False,
    with_table: bool = True,
) -> EngineConfig:
    """A real engine config (current platform), then the compilation fields the dispatcher reads
    set to exactly the state under test (resolution would derive them from the platform)."""
    sizes_l = sorted(sizes)
    cfg = EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs),
        speculative_config=None if spec_tokens is None else SpeculativeConfig(num_speculative_tokens=spec_tokens),
        parallel_config=ParallelConfig(
            data_parallel_size=dp_size, data_parallel_rank=dp_rank, tensor_parallel_size=tp
        ),
    )
    with unfrozen(cfg):  # a state resolution would not produce on this platform
        cc = cfg.compilation_config
        cc.cudagraph_mode = mode
        cc.cudagraph_capture_sizes = sizes_l
        cc.max_cudagraph_capture_size = sizes_l[-1] if sizes_l else 0
        cc.bs_to_padded_graph_size = padding_table(sizes_l) if with_table else None
        cc.cudagraph_specialize_lora = specialize_lora
        cc.mode = CompilationMode.VLLM_COMPILE if piecewise_ok else CompilationMode.NONE
        cc.splitting_ops = list(cc.ATTENTION_OPS) if piecewise_ok else []
        cc.pass_config.enable_sp = enable_sp
        if lora:  # forwardkit has no LoRA config; the dispatcher only asks whether one is set
            cfg.lora_config = object()
    return cfg


def dispatcher_for(mode: CUDAGraphMode = M.FULL_AND_PIECEWISE, init: bool = True, **kw) -> CudagraphDispatcher:
    disp = CudagraphDispatcher(make_cfg(mode=mode, **kw))
    if init:
        disp.initialize_cudagraph_keys(mode)
    return disp


# ---- keys per configured mode ----------------------------------------------------------
KEYS_PER_MODE = {
    M.FULL_AND_PIECEWISE: ({d(n) for n in (1, 2, 4, 8, 16)}, {d(n, n, True) for n in (1, 2, 4, 8)}),
    M.FULL_DECODE_ONLY: (set(), {d(n, n, True) for n in (1, 2, 4, 8)}),
    M.FULL: (set(), {d(n) for n in (1, 2, 4, 8, 16)}),
    M.PIECEWISE: ({d(n) for n in (1, 2, 4, 8, 16)}, set()),
    M.NONE: (set(), set()),
}


@pytest.mark.parametrize("mode", list(KEYS_PER_MODE), ids=str)
def test_keys_per_configured_mode(mode):
    disp = dispatcher_for(mode)
    piecewise, full = KEYS_PER_MODE[mode]
    assert disp.keys_initialized
    assert disp.cudagraph_keys[M.PIECEWISE] == piecewise
    assert disp.cudagraph_keys[M.FULL] == full


# ---- dispatch -------------------------------------------------------------------------
DISPATCH_CASES = [
    (M.FULL_AND_PIECEWISE, (3, True, False), {}, (M.FULL, d(4, 4, True, False))),
    (M.FULL_AND_PIECEWISE, (3, False, False), {}, (M.PIECEWISE, d(4))),
    (M.FULL_AND_PIECEWISE, (8, True, False), {}, (M.FULL, d(8, 8, True))),
    (M.FULL_AND_PIECEWISE, (9, True, False), {}, (M.PIECEWISE, d(16))),
    (M.FULL_AND_PIECEWISE, (12, True, False), {"disable_full": True}, (M.PIECEWISE, d(16))),
    (M.FULL_AND_PIECEWISE, (16, False, False), {}, (M.PIECEWISE, d(16))),
    (M.FULL_AND_PIECEWISE, (17, False, False), {}, (M.NONE, d(17))),
    (M.FULL_AND_PIECEWISE, (5, True, True), {}, (M.NONE, d(5))),
    (M.FULL_DECODE_ONLY, (3, True, False), {}, (M.FULL, d(4, 4, True))),
    (M.FULL_DECODE_ONLY, (3, False, False), {}, (M.NONE, d(3))),
    (M.FULL_DECODE_ONLY, (12, True, False), {}, (M.NONE, d(12))),
    (M.FULL, (3, True, False), {}, (M.FULL, d(4))),
    (M.FULL, (3, False, False), {}, (M.FULL, d(4))),
    (M.FULL, (3, True, False), {"disable_full": True}, (M.NONE, d(3))),
    (M.PIECEWISE, (3, True, False), {}, (M.PIECEWISE, d(4))),
    (M.PIECEWISE, (3, False, False), {}, (M.PIECEWISE, d(4))),
    (M.NONE, (3, True, False), {}, (M.NONE, d(3))),
]


@pytest.mark.parametrize(("mode", "args", "kwargs", "expected"), DISPATCH_CASES)
def test_dispatch_pads_and_picks_mode(mode, args, kwargs, expected):
    disp = dispatcher_for(mode)
    result = disp.dispatch(*args, **kwargs)
    assert result == expected
    assert isinstance(result[1], d)


@pytest.mark.parametrize("mode", [M.FULL_AND_PIECEWISE, M.FULL, M.PIECEWISE, M.FULL_DECODE_ONLY])
def test_dispatch_before_keys_initialised_is_none(mode):
    disp = dispatcher_for(mode, init=False)
    assert not disp.keys_initialized
    assert disp.dispatch(3, True, False) == (M.NONE, d(3))
    assert disp.get_capture_descs() == []


# ---- speculative decoding ---------------------------------------------------------------
def test_spec_decode_query_len_3_keys_and_dispatch():
    disp = dispatcher_for(sizes=(3, 6, 9, 12, 24), max_num_seqs=4, spec_tokens=2)
    assert disp.uniform_decode_query_len == 3
    assert disp.cudagraph_keys[M.PIECEWISE] == {d(n) for n in (3, 6, 9, 12, 24)}
    assert disp.cudagraph_keys[M.FULL] == {d(3, 1, True), d(6, 2, True), d(9, 3, True), d(12, 4, True)}
    assert disp.dispatch(6, True, False) == (M.FULL, d(6, 2, True))
    assert disp.dispatch(5, False, False) == (M.PIECEWISE, d(6))
    assert disp.dispatch(13, True, False) == (M.PIECEWISE, d(24))
    assert disp.dispatch(13, False, False) == (M.PIECEWISE, d(24))


def test_spec_decode_query_len_2_keys_and_dispatch():
    disp = dispatcher_for(sizes=(1, 2, 4, 8), spec_tokens=1)
    assert disp.cudagraph_keys[M.FULL] == {d(2, 1, True), d(4, 2, True), d(8, 4, True)}
    assert disp.dispatch(6, True, False) == (M.FULL, d(8, 4, True))
    # with FULL decode graphs the sizes are rounded to multiples of 2 when the keys are built
    # (vLLM's runner: adjust_cudagraph_sizes_for_spec_decode), so every padded uniform step
    # is one (unrounded, size 1 would fail the dispatcher's multiple-of assertion)
    assert disp._capture_sizes() == [2, 4, 8]
    assert disp.cudagraph_keys[M.PIECEWISE] == {d(2), d(4), d(8)}
    assert disp.dispatch(1, True, False) == (M.FULL, d(2, 1, True))
    assert disp.dispatch(3, False, False) == (M.PIECEWISE, d(4))
    # a mode without FULL decode graphs keeps the config's sizes
    plain = dispatcher_for(M.PIECEWISE, sizes=(1, 2, 4, 8), spec_tokens=1)
    assert plain.cudagraph_keys[M.PIECEWISE] == {d(1), d(2), d(4), d(8)}


def test_mode_is_fixed_once_by_initialize():
    disp = CudagraphDispatcher(make_cfg(mode=M.FULL_AND_PIECEWISE))
    assert disp.cudagraph_mode == M.NONE  # nothing resolved yet
    disp.initialize_cudagraph_keys("FULL_DECODE_ONLY")  # a mode name is accepted
    assert disp.cudagraph_mode == M.FULL_DECODE_ONLY
    with pytest.raises(RuntimeError, match="keys were built for FULL_DECODE_ONLY"):
        disp.initialize_cudagraph_keys(M.FULL_AND_PIECEWISE)
    with pytest.raises(AttributeError):
        disp.cudagraph_mode = M.NONE  # read-only
    assert disp.cudagraph_mode == M.FULL_DECODE_ONLY
    assert disp.cudagraph_keys[M.PIECEWISE] == set()


# ---- LoRA ---------------------------------------------------------------------------------
def test_lora_specialised_keys_both_variants():
    disp = dispatcher_for(sizes=(1, 2, 4), lora=True, specialize_lora=True)
    assert disp.cudagraph_keys[M.PIECEWISE] == {d(n, None, False, lo) for n in (1, 2, 4) for lo in (False, True)}
    assert disp.cudagraph_keys[M.FULL] == {d(n, n, True, lo) for n in (1, 2, 4) for lo in (False, True)}
    assert disp.dispatch(3, True, True) == (M.FULL, d(4, 4, True, True))
    assert disp.dispatch(3, False, False) == (M.PIECEWISE, d(4))


def test_lora_not_specialised_keys_always_have_lora():
    disp = dispatcher_for(sizes=(1, 2, 4), lora=True, specialize_lora=False)
    assert disp.cudagraph_keys[M.PIECEWISE] == {d(n, None, False, True) for n in (1, 2, 4)}
    assert disp.cudagraph_keys[M.FULL] == {d(n, n, True, True) for n in (1, 2, 4)}
    assert disp.dispatch(3, True, False) == (M.NONE, d(3))
    assert disp.dispatch(3, True, True) == (M.FULL, d(4, 4, True, True))


# ---- max_num_seqs bounds the uniform FULL keys -----------------------------------------------
def test_max_num_seqs_bounds_full_keys():
    disp = dispatcher_for(sizes=(1, 2, 4, 8), max_num_seqs=2)
    assert disp.cudagraph_keys[M.FULL] == {d(1, 1, True), d(2, 2, True)}
    assert disp.dispatch(2, True, False) == (M.FULL, d(2, 2, True))
    assert disp.dispatch(3, True, False) == (M.PIECEWISE, d(4))
    assert disp.dispatch(8, False, False) == (M.PIECEWISE, d(8))


# ---- errors -----------------------------------------------------------------------------------
def test_piecewise_mode_needs_piecewise_compilation():
    with pytest.raises(AssertionError, match=r"^Compilation mode should be CompilationMode.VLLM_COMPILE when cudagraph_mode piecewise cuda"):
        CudagraphDispatcher(make_cfg(mode=M.PIECEWISE, piecewise_ok=False))


def test_full_decode_only_without_compilation_constructs():
    disp = CudagraphDispatcher(make_cfg(mode=M.FULL_DECODE_ONLY, piecewise_ok=False))
    assert disp.keys_initialized is False


def test_add_key_rejects_none_mode():
    disp = dispatcher_for()
    with pytest.raises(AssertionError, match="^Invalid cudagraph runtime mode for keys: NONE$"):
        disp.add_cudagraph_key(M.NONE, d(4))


def test_invalid_inputs_raise_clear_errors():
    disp = dispatcher_for()
    with pytest.raises(ValueError, match="num_tokens must be a non-negative int, got -1"):
        disp.dispatch(-1)
    with pytest.raises(ValueError, match="Invalid cudagraph_mode: 'SOMETIMES'"):
        disp.initialize_cudagraph_keys("SOMETIMES")


def test_padding_uses_the_configs_one_table():
    """One padding lookup: the dispatcher pads through ``EngineConfig.pad_for_cudagraph``; a
    config whose table was never computed is named in the error, not padded a second way."""
    disp = dispatcher_for(sizes=(4, 12, 20))
    assert disp.dispatch(5, False) == (M.PIECEWISE, d(12))
    assert disp.dispatch(13, True) == (M.PIECEWISE, d(20))
    assert disp.dispatch(3, True) == (M.FULL, d(4, 4, True))
    for n in range(21):
        assert disp._pad(n) == disp.engine_config.pad_for_cudagraph(n)
    bare = dispatcher_for(sizes=(4, 12, 20), with_table=False)
    with pytest.raises(ValueError, match="bs_to_padded_graph_size is None"):
        bare.dispatch(5, False)


# ---- capture list ------------------------------------------------------------------------
def test_capture_descs_largest_first_with_lora_cases():
    disp = dispatcher_for(sizes=(1, 2, 4), lora=True)
    groups = disp.get_capture_descs()
    assert [m for m, _ in groups] == [M.PIECEWISE, M.FULL]
    assert [(x.num_tokens, x.has_lora) for x in groups[0][1]] == [
        (4, True), (4, False), (2, True), (2, False), (1, True), (1, False)
    ]
    assert all(not x.uniform and x.num_reqs is None for x in groups[0][1])
    assert groups[1][1][:2] == [d(4, 4, True, True), d(4, 4, True, False)]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (M.FULL_AND_PIECEWISE, [(M.PIECEWISE, [16, 8, 4, 2, 1]), (M.FULL, [8, 4, 2, 1])]),
        (M.FULL_DECODE_ONLY, [(M.FULL, [8, 4, 2, 1])]),
        (M.FULL, [(M.FULL, [16, 8, 4, 2, 1])]),
        (M.PIECEWISE, [(M.PIECEWISE, [16, 8, 4, 2, 1])]),
        (M.NONE, []),
    ],
    ids=str,
)
def test_capture_descs_match_keys(mode, expected):
    disp = dispatcher_for(mode)
    groups = disp.get_capture_descs()
    assert [(m, [x.num_tokens for x in descs]) for m, descs in groups] == expected
    for m, descs in groups:
        assert set(descs) == disp.cudagraph_keys[m]


# ---- CPU platforms ---------------------------------------------------------------------------------------
def test_cudagraphs_available():
    assert cudagraphs_available(CpuPlatform()) is False
    assert cudagraphs_available(CudaPlatform(device_capability=90)) is torch.cuda.is_available()


def test_cpu_platform_logs_once_that_graphs_are_off(cpu_platform, fk_log_records):
    """Resolution decides it (one owner), so it logs it; the dispatcher adds nothing."""
    from forwardkit.config.engine import EngineConfig
    from forwardkit.config.model import ModelConfig

    for _ in range(2):
        cfg = EngineConfig(model_config=ModelConfig(), platform=CpuPlatform())
        assert cfg.compilation_config.cudagraph_mode == M.NONE
        CudagraphDispatcher(make_cfg(mode=M.NONE))
    lines = [r.getMessage() for r in fk_log_records if "CUDA graphs are off" in r.getMessage()]
    assert len(lines) == 1
    assert "platform cpu" in lines[0]


# ---- the same examples with the real EngineConfig / CompilationConfig ----------------------------------
def real_cfg(max_num_seqs: int = 8, **kw):
    from forwardkit.config.engine import EngineConfig
    from forwardkit.config.model import ModelConfig
    from forwardkit.config.scheduler import SchedulerConfig

    return EngineConfig(
        model_config=ModelConfig(),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs),
        platform=CudaPlatform(device_capability=90),
        **kw,
    )


def test_real_config_defaults_give_same_keys_and_dispatch():
    cfg = real_cfg()
    cc = cfg.compilation_config
    assert cc.cudagraph_mode == M.FULL_AND_PIECEWISE and cc.cudagraph_capture_sizes == [1, 2, 4, 8, 16]
    disp = CudagraphDispatcher(cfg)
    disp.initialize_cudagraph_keys(cc.cudagraph_mode)
    assert (disp.cudagraph_keys[M.PIECEWISE], disp.cudagraph_keys[M.FULL]) == KEYS_PER_MODE[M.FULL_AND_PIECEWISE]
    for mode, args, kwargs, expected in DISPATCH_CASES:
        if mode == M.FULL_AND_PIECEWISE:
            assert disp.dispatch(*args, **kwargs) == expected, args
    for n in range(1, 17):  # the dispatcher's padding agrees with the config's own
        assert disp.dispatch(n)[1].num_tokens == cfg.pad_for_cudagraph(n)


@pytest.mark.parametrize("mode", [M.FULL_DECODE_ONLY, M.FULL, M.PIECEWISE, M.NONE], ids=str)
def test_real_config_keys_per_mode(mode):
    cfg = real_cfg(compilation_config={"cudagraph_mode": mode.name, "cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
    assert cfg.compilation_config.cudagraph_mode == mode
    disp = CudagraphDispatcher(cfg)
    disp.initialize_cudagraph_keys(mode)
    assert (disp.cudagraph_keys[M.PIECEWISE], disp.cudagraph_keys[M.FULL]) == KEYS_PER_MODE[mode]


def test_real_config_spec_decode_keys():
    cfg = real_cfg(max_num_seqs=4, speculative_config={"num_speculative_tokens": 2, "method": "eagle"})
    cc = cfg.compilation_config
    with unfrozen(cfg):  # sizes that are multiples of the decode query length, as vLLM rounds them
        cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = [3, 6, 9, 12, 24], 24
        cc.compute_bs_to_padded_graph_size()
    disp = CudagraphDispatcher(cfg)
    assert disp.uniform_decode_query_len == 3
    disp.initialize_cudagraph_keys(cc.cudagraph_mode)
    assert disp.cudagraph_keys[M.FULL] == {d(3, 1, True), d(6, 2, True), d(9, 3, True), d(12, 4, True)}
    assert disp.dispatch(6, True, False) == (M.FULL, d(6, 2, True))
    assert disp.dispatch(13, True, False) == (M.PIECEWISE, d(24))


def test_real_config_piecewise_without_attention_split_raises():
    cfg = real_cfg()
    with unfrozen(cfg):  # a state resolution never produces
        cfg.compilation_config.splitting_ops = []
        cfg.compilation_config.cudagraph_mode = M.PIECEWISE
    with pytest.raises(AssertionError, match=r"^Compilation mode should be CompilationMode.VLLM_COMPILE when cudagraph_mode piecewise cuda"):
        CudagraphDispatcher(cfg)


def test_real_cpu_config_dispatches_none():
    from forwardkit.config.engine import EngineConfig
    from forwardkit.config.model import ModelConfig

    cfg = EngineConfig(model_config=ModelConfig(), platform=CpuPlatform())
    assert cfg.compilation_config.cudagraph_mode == M.NONE
    disp = CudagraphDispatcher(cfg)
    disp.initialize_cudagraph_keys(cfg.compilation_config.cudagraph_mode)
    assert disp.dispatch(3, True) == (M.NONE, d(3))
    assert disp.get_capture_descs() == []
