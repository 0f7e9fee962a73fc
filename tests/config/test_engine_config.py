"""EngineConfig resolution: vLLM 0.14.0's resolution cases that run without a GPU.

Unless a case says otherwise: emulated CUDA platform (static graphs), the tiny Llama model
(dense, max_model_len 4096, hidden 64, bf16), SchedulerConfig defaults (128 seqs / 2048
tokens), O2.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from forwardkit.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    EngineConfig,
    ModelConfig,
    OptimizationLevel,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from forwardkit.config.compilation import Range
from forwardkit.platforms import CpuPlatform, CudaPlatform

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "max_position_embeddings": 4096,
    "vocab_size": 128,
    "torch_dtype": "bfloat16",
}
MOE = {**LLAMA, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
ENC_DEC = {**LLAMA, "architectures": ["WhisperForConditionalGeneration"], "is_encoder_decoder": True}
ATTN = list(CompilationConfig.ATTENTION_OPS)
S256 = [1, 2, 4, *range(8, 257, 8)]
S512 = S256 + list(range(272, 513, 16))
UP_TO_96 = [1, 2, 4, *range(8, 97, 8)]
FLAGS = ("eliminate_noops", "fuse_norm_quant", "fuse_act_quant", "fuse_allreduce_rms",
         "fuse_attn_quant", "enable_sp", "fuse_gemm_comms")
NONE, PW, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
FAP, FDO = CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY

def build(hf=LLAMA, *, seqs=128, tokens=2048, level=None, static=True, tp=1, dp=1,
          all2all=None, spec=None, enforce_eager=False, runner="generate", enable_dbo=False,
          **cc) -> EngineConfig:
    """An EngineConfig for one resolution case; ``cc`` are CompilationConfig keys."""
    model = None if hf is None else ModelConfig(hf_config=hf, enforce_eager=enforce_eager, runner=runner)
    parallel = dict(tensor_parallel_size=tp, data_parallel_size=dp, enable_dbo=enable_dbo)
    if all2all:
        parallel["all2all_backend"] = all2all
    kwargs = dict(
        model_config=model,
        parallel_config=ParallelConfig(**parallel),
        scheduler_config=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens),
        compilation_config=cc,
        platform=CudaPlatform(device_capability=90) if static else CpuPlatform(),
        speculative_config=spec,
    )
    if level is not None:
        kwargs["optimization_level"] = level
    return EngineConfig(**kwargs)


def flags(cfg: EngineConfig) -> dict[str, bool]:
    return {name: getattr(cfg.compilation_config.pass_config, name) for name in FLAGS}


def test_o2_defaults_with_model():
    cfg = build()
    cc = cfg.compilation_config
    assert cfg.optimization_level == OptimizationLevel.O2
    assert cc.mode == CompilationMode.VLLM_COMPILE and cc.cudagraph_mode == FAP
    assert cc.custom_ops == ["none"] and cc.splitting_ops == ATTN
    assert cc.cudagraph_capture_sizes == S256 and cc.max_cudagraph_capture_size == 256
    assert cc.compile_ranges_split_points == [2048] and cc.compile_sizes == []
    assert cc.cudagraph_num_of_warmups == 1 and cc.use_inductor_graph_partition is False
    assert flags(cfg) == {name: name == "eliminate_noops" for name in FLAGS}
    assert cc.backend == "inductor"
    assert cc.get_compile_ranges() == [Range(1, 2048)]
    assert cfg.parallel_config.is_moe_model is False


@pytest.mark.parametrize("n, padded", [(0, 0), (1, 1), (3, 4), (5, 8), (9, 16), (17, 24),
                                       (255, 256), (256, 256)])
def test_pad_for_cudagraph(n, padded):
    assert build().pad_for_cudagraph(n) == padded


def test_pad_for_cudagraph_errors():
    with pytest.raises(IndexError, match="257"):
        build().pad_for_cudagraph(257)
    with pytest.raises(IndexError):
        build().pad_for_cudagraph(-1)
    with pytest.raises(ValueError, match="no cudagraph padding table"):
        build(static=False).pad_for_cudagraph(1)


# (case id, build kwargs, expected) -- expected keys: level mode cg ops split sizes max warm pts flags
CASES = [
    ("no model, static", dict(hf=None), dict(mode=3, cg=FAP, ops=["none"], split=ATTN, sizes=[], max=0, warm=1, pts=[2048])),
    ("no model, user sizes", dict(hf=None, cudagraph_capture_sizes=[1, 2, 4]), dict(cg=FAP, sizes=[], max=0)),
    ("no model, no static graphs", dict(hf=None, static=False),
     dict(mode=3, cg=NONE, sizes=None, max=None, compile_sizes=None, warm=0, pts=[2048], ops=["none"])),
    ("256/8192", dict(seqs=256, tokens=8192), dict(sizes=S512, max=512, pts=[8192])),
    ("1024/16384", dict(seqs=1024, tokens=16384), dict(sizes=S512, max=512, pts=[16384])),
    ("seqs 4", dict(seqs=4), dict(sizes=[1, 2, 4, 8], max=8)),
    ("seqs 3", dict(seqs=3), dict(sizes=[1, 2, 4], max=4)),
    ("seqs 1", dict(seqs=1), dict(sizes=[1, 2], max=2)),
    ("130/8192", dict(seqs=130, tokens=8192), dict(sizes=S256, max=256)),
    ("128/128", dict(seqs=128, tokens=128), dict(sizes=[1, 2, 4, *range(8, 129, 8)], max=128, pts=[128])),
    ("100/100", dict(seqs=100, tokens=100), dict(sizes=UP_TO_96, max=96, pts=[100])),
    ("user sizes above tokens", dict(cudagraph_capture_sizes=[1, 2, 3, 5000]), dict(sizes=[1, 2, 3], max=3)),
    ("user sizes unsorted", dict(cudagraph_capture_sizes=[8, 4, 4, 2]), dict(sizes=[2, 4, 8], max=8)),
    ("user size beyond 2x seqs", dict(cudagraph_capture_sizes=[300]), dict(sizes=[300], max=300)),
    ("user sizes + consistent max", dict(cudagraph_capture_sizes=[1, 2, 4], max_cudagraph_capture_size=4), dict(sizes=[1, 2, 4], max=4)),
    ("user max 100", dict(max_cudagraph_capture_size=100), dict(sizes=UP_TO_96, max=96)),
    ("user max 96", dict(max_cudagraph_capture_size=96), dict(sizes=UP_TO_96, max=96)),
    ("user max 1000", dict(max_cudagraph_capture_size=1000),
     dict(sizes=S256 + list(range(272, 993, 16)), max=992)),
    ("user max 4096 > tokens", dict(max_cudagraph_capture_size=4096),
     dict(sizes=S256 + list(range(272, 2049, 16)), max=2048)),
    ("user max 3", dict(max_cudagraph_capture_size=3), dict(sizes=[1, 2], max=2)),
    ("max 0 with NONE", dict(max_cudagraph_capture_size=0, cudagraph_mode="NONE"), dict(sizes=[], max=0)),
    ("max 50 with NONE", dict(max_cudagraph_capture_size=50, cudagraph_mode="NONE"), dict(sizes=[], max=0)),
    ("enforce_eager", dict(enforce_eager=True),
     dict(level=0, mode=0, cg=NONE, ops=["all"], split=[], sizes=[], max=0, warm=0, flags={})),
    ("enforce_eager + FULL", dict(enforce_eager=True, cudagraph_mode="FULL"), dict(level=0, cg=NONE, sizes=[], max=0)),
    ("enforce_eager + sizes", dict(enforce_eager=True, cudagraph_capture_sizes=[1, 2]), dict(cg=NONE, sizes=[], max=0)),
    # forwardkit: enforce_eager runs eagerly, so the resolved mode says NONE (the reference keeps 3)
    ("enforce_eager + mode 3 at O3", dict(enforce_eager=True, mode=3, level=3),
     dict(level=0, mode=0, ops=["all"], split=[], cg=NONE, sizes=[], max=0)),
    ("O0", dict(level=0), dict(mode=0, cg=NONE, ops=["all"], split=[], sizes=[], max=0, warm=1, flags={})),
    ("O1", dict(level=1), dict(mode=3, cg=PW, ops=["none"], split=ATTN, sizes=S256, max=256,
                                  flags={"eliminate_noops"})),
    ("O2", dict(level=2), dict(mode=3, cg=FAP, sizes=S256, flags={"eliminate_noops"})),
    ("O3", dict(level=3), dict(mode=3, cg=FAP, sizes=S256, ops=["none"], split=ATTN, flags={"eliminate_noops"})),
    ("O0 + mode 3", dict(level=0, mode=3), dict(cg=NONE, ops=["none"], split=ATTN, sizes=[], max=0, flags={})),
    ("O0 + mode 3 + PIECEWISE", dict(level=0, mode=3, cudagraph_mode="PIECEWISE"), dict(cg=PW, sizes=S256, max=256)),
    ("O0 + PIECEWISE", dict(level=0, cudagraph_mode="PIECEWISE"), dict(mode=0, cg=NONE, sizes=[], max=0)),
    ("O0 + FULL", dict(level=0, cudagraph_mode="FULL"), dict(mode=0, cg=FULL, sizes=S256, max=256, ops=["all"])),
    ("mode 0", dict(mode=0), dict(cg=NONE, ops=["all"], split=[], max=0,
                                     flags={"eliminate_noops", "fuse_norm_quant", "fuse_act_quant"})),
    ("mode 0 + FULL", dict(mode=0, cudagraph_mode="FULL"), dict(cg=FULL, max=256)),
    ("mode 0 + FULL_DECODE_ONLY", dict(mode=0, cudagraph_mode="FULL_DECODE_ONLY"), dict(cg=FDO, max=256)),
    ("mode 1", dict(mode=1), dict(cg=NONE, ops=["none"], split=[])),
    ("mode 2 + eager", dict(mode=2, backend="eager"),
     dict(cg=NONE, ops=["all"], flags={"eliminate_noops", "fuse_norm_quant", "fuse_act_quant"})),
    ("mode 3 + eager", dict(mode=3, backend="eager"),
     dict(cg=FAP, ops=["all"], split=ATTN, flags={"eliminate_noops", "fuse_norm_quant", "fuse_act_quant"})),
    ("O1 + eager", dict(level=1, backend="eager"), dict(cg=PW, ops=["all"])),
    ("+rms_norm", dict(custom_ops=["+rms_norm"]), dict(ops=["+rms_norm", "none"], flags={"eliminate_noops", "fuse_norm_quant"})),
    ("+quant_fp8 at O1", dict(level=1, custom_ops=["+quant_fp8"]),
     dict(flags={"eliminate_noops", "fuse_norm_quant", "fuse_act_quant"})),
    ("all", dict(custom_ops=["all"]), dict(flags={"eliminate_noops", "fuse_norm_quant", "fuse_act_quant"})),
    ("all -silu_and_mul", dict(custom_ops=["all", "-silu_and_mul"]),
     dict(flags={"eliminate_noops", "fuse_norm_quant", "fuse_act_quant"})),
    ("splitting [] at O2", dict(splitting_ops=[]), dict(cg=FULL, split=[], sizes=S256, max=256)),
    # vLLM keeps stale capture sizes after the splitting-ops step turns graphs off;
    # forwardkit deliberately drops them so resolution is idempotent.
    ("splitting [] at O1", dict(splitting_ops=[], level=1), dict(cg=NONE, sizes=[], max=0)),
    ("graph partition", dict(use_inductor_graph_partition=True), dict(cg=FAP, split=ATTN, partition=True)),
    ("fuse_attn_quant", dict(pass_config={"fuse_attn_quant": True}), dict(cg=FULL, split=[], sizes=S256, max=256)),
    ("fuse_attn_quant + partition", dict(pass_config={"fuse_attn_quant": True}, use_inductor_graph_partition=True),
     dict(cg=FAP, split=ATTN)),
    ("fuse_attn_quant + PIECEWISE", dict(pass_config={"fuse_attn_quant": True}, cudagraph_mode="PIECEWISE"),
     dict(cg=FULL, split=[])),
    ("enable_sp tp1", dict(pass_config={"enable_sp": True}), dict(ops=["none", "+rms_norm"])),
    ("fuse_gemm_comms", dict(pass_config={"fuse_gemm_comms": True}),
     dict(ops=["none", "+rms_norm"], enable_sp=True)),
    ("enable_sp -rms_norm", dict(pass_config={"enable_sp": True}, custom_ops=["-rms_norm"]), dict(ops=["-rms_norm", "none"])),
    ("enable_sp full graph", dict(pass_config={"enable_sp": True}, splitting_ops=[]), dict(ops=["none", "+rms_norm"], cg=FULL)),
    ("tp2 sp", dict(tp=2, pass_config={"enable_sp": True}), dict(sizes=S256[1:], max=256)),
    ("tp4 sp seqs 8", dict(tp=4, seqs=8, pass_config={"enable_sp": True}), dict(sizes=[4, 8, 16], max=16)),
    ("tp4 sp seqs 1", dict(tp=4, seqs=1, pass_config={"enable_sp": True}), dict(sizes=[], max=0, cg=FAP)),
    ("tp4 sp user sizes", dict(tp=4, pass_config={"enable_sp": True}, cudagraph_capture_sizes=[1, 2, 4, 6, 8]),
     dict(sizes=[4, 8], max=8)),
    ("tp4 sp user sizes + max", dict(tp=4, pass_config={"enable_sp": True}, cudagraph_capture_sizes=[1, 2, 4, 6, 8],
                                        max_cudagraph_capture_size=8), dict(sizes=[4, 8], max=8)),
    ("tp2 no sp", dict(tp=2), dict(sizes=S256, max=256)),
    ("user split points", dict(compile_ranges_split_points=[1, 8, 512, 2048, 4096]), dict(pts=[8, 512, 2048])),
    ("duplicate split points", dict(compile_ranges_split_points=[8, 8, 16]),
     dict(pts=[8, 16, 2048], ranges=[Range(1, 8), Range(9, 16), Range(17, 2048)])),  # reference keeps 8 twice
    ("allreduce-rms 0.0625MB", dict(tp=2, pass_config={"fuse_allreduce_rms": True, "fi_allreduce_fusion_max_size_mb": 0.0625}),
     dict(pts=[512, 2048])),
    ("allreduce-rms 1MB", dict(tp=2, pass_config={"fuse_allreduce_rms": True, "fi_allreduce_fusion_max_size_mb": 1}),
     dict(pts=[2048])),
    ("allreduce-rms + user points", dict(tp=2, compile_ranges_split_points=[4, 16, 512],
                                            pass_config={"fuse_allreduce_rms": True, "fi_allreduce_fusion_max_size_mb": 0.0625}),
     dict(pts=[4, 16, 512, 2048])),  # the reference keeps 512 twice
    ("spec n=3 seqs 128", dict(spec=SpeculativeConfig(num_speculative_tokens=3)), dict(sizes=S512, max=512, async_=False)),
    ("spec n=3 seqs 32", dict(seqs=32, spec=SpeculativeConfig(num_speculative_tokens=3)), dict(sizes=S256, max=256)),
    ("spec n=1 seqs 64", dict(seqs=64, spec=SpeculativeConfig(num_speculative_tokens=1)), dict(sizes=S256, max=256)),
    ("spec n=3 user max 100", dict(spec=SpeculativeConfig(num_speculative_tokens=3), max_cudagraph_capture_size=100),
     dict(sizes=UP_TO_96, max=96)),
    ("MoE DP2 deepep-ht", dict(hf=MOE, dp=2, all2all="deepep_high_throughput"),
     dict(cg=NONE, sizes=[], max=0, moe=True)),
    ("dense DP2 deepep-ht", dict(dp=2, all2all="deepep_high_throughput"), dict(cg=FAP, moe=False)),
    ("MoE DP1 deepep-ht", dict(hf=MOE, all2all="deepep_high_throughput"), dict(cg=FAP, moe=True)),
    ("MoE DP2 deepep-ll", dict(hf=MOE, dp=2, all2all="deepep_low_latency"), dict(cg=FAP)),
    ("no model DP2 deepep-ht", dict(hf=None, dp=2, all2all="deepep_high_throughput"), dict(cg=NONE)),
    ("MoE DP2 deepep-ht mode 0 FULL", dict(hf=MOE, dp=2, all2all="deepep_high_throughput", mode=0, cudagraph_mode="FULL"),
     dict(cg=FULL)),
    ("pooling O2", dict(runner="pooling"), dict(cg=PW)),
    ("pooling FULL_DECODE_ONLY", dict(runner="pooling", cudagraph_mode="FULL_DECODE_ONLY"), dict(cg=PW)),
    ("pooling NONE", dict(runner="pooling", cudagraph_mode="NONE"), dict(cg=NONE)),
    ("pooling O1", dict(runner="pooling", level=1), dict(cg=PW)),
    ("enc-dec O2", dict(hf=ENC_DEC), dict(cg=FDO, sizes=S256, max=256)),
    ("enc-dec PIECEWISE", dict(hf=ENC_DEC, cudagraph_mode="PIECEWISE"), dict(cg=FDO)),
    ("enc-dec FULL", dict(hf=ENC_DEC, cudagraph_mode="FULL"), dict(cg=FDO)),
    ("FULL on cuda", dict(cudagraph_mode="FULL"), dict(cg=FULL)),
    ("mode 0 + PIECEWISE", dict(mode=0, cudagraph_mode="PIECEWISE"), dict(cg=NONE)),
]


@pytest.mark.parametrize("kwargs, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_resolution(kwargs, expected):
    cfg = build(**kwargs)
    cc = cfg.compilation_config
    actual_of = {
        "level": lambda: cfg.optimization_level,
        "mode": lambda: cc.mode,
        "cg": lambda: cc.cudagraph_mode,
        "ops": lambda: cc.custom_ops,
        "split": lambda: cc.splitting_ops,
        "sizes": lambda: cc.cudagraph_capture_sizes,
        "max": lambda: cc.max_cudagraph_capture_size,
        "warm": lambda: cc.cudagraph_num_of_warmups,
        "pts": lambda: cc.compile_ranges_split_points,
        "compile_sizes": lambda: cc.compile_sizes,
        "ranges": lambda: cc.get_compile_ranges(),
        "partition": lambda: cc.use_inductor_graph_partition,
        "enable_sp": lambda: cc.pass_config.enable_sp,
        "moe": lambda: cfg.parallel_config.is_moe_model,
        "async_": lambda: cfg.scheduler_config.async_scheduling,
        "flags": lambda: {name for name, on in flags(cfg).items() if on},
    }
    for key, want in expected.items():
        got = actual_of[key]()
        if key == "flags":
            want = set(want)
        assert got == want, f"{key}: got {got!r}, expected {want!r}"


ERRORS = [
    ("max inconsistent with sizes", dict(cudagraph_capture_sizes=[1, 2, 4], max_cudagraph_capture_size=8),
     r"customized max_cudagraph_capture_size\(=8\) should be consistent with the max value of cudagraph_capture_sizes\(=4\)"),
    ("max 4000 with a too-big size", dict(cudagraph_capture_sizes=[1, 2, 4000], max_cudagraph_capture_size=4000),
     r"\(=2\)"),
    ("empty user sizes", dict(cudagraph_capture_sizes=[]), "cudagraph_capture_sizes should contain at least one element"),
    # vLLM resolves this to [] / 0 with graphs still on (a config it cannot resolve again)
    ("all user sizes too big", dict(cudagraph_capture_sizes=[5000]),
     r"cudagraph_capture_sizes \[5000\] are all above max_num_batched_tokens=2048"),
    ("max 0", dict(max_cudagraph_capture_size=0), "Maximum cudagraph size should be greater than or equal to 1"),
    ("tp4 sp sizes + max 10", dict(tp=4, pass_config={"enable_sp": True}, cudagraph_capture_sizes=[1, 2, 4, 6, 10],
                                      max_cudagraph_capture_size=10), r"\(=4\)"),
    ("split point 0", dict(compile_ranges_split_points=[0]), "Invalid compile range split point: 0"),
    ("split point -3", dict(compile_ranges_split_points=[-3]), "Invalid compile range split point: -3"),
    ("dbo with naive all2all", dict(enable_dbo=True, all2all="naive"),
     "Microbatching currently only supports the allgather_reducescatter, deepep_low_latency and "
     "deepep_high_throughput all2all backends. naive is not supported"),
    ("level 4", dict(level=4), "optimization_level"),
    ("bad compilation key", dict(bogus_key=1), "bogus_key"),
]


@pytest.mark.parametrize("kwargs, message", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_resolution_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(**kwargs)


def test_compile_sizes_expand_capture_sizes():
    cfg = build(seqs=4, compile_sizes=[1, "cudagraph_capture_sizes"])
    cc = cfg.compilation_config
    assert (cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size) == ([1, 2, 4, 8], 8)
    assert cc.compile_sizes == [1, 2, 4, 8]  # the reference repeats 1
    cc = build(seqs=8, tokens=64, compile_sizes=[16, 2]).compilation_config
    assert (cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size) == ([1, 2, 4, 8, 16], 16)
    assert sorted(cc.compile_sizes) == [2, 16] and cc.compile_ranges_split_points == [64]


def test_dbo_with_deepep_ll_disables_cascade():
    cfg = build(hf=MOE, enable_dbo=True, all2all="deepep_low_latency")
    assert cfg.model_config.disable_cascade_attn is True
    assert build(hf=None, enable_dbo=True, all2all="deepep_low_latency").model_config is None


def test_debug_dump_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = build(debug_dump_path="rel/dump")
    assert Path(cfg.compilation_config.debug_dump_path) == Path(os.getcwd()) / "rel" / "dump"
    assert cfg.compile_debug_dump_path() == Path(os.getcwd()) / "rel" / "dump" / "rank_0_dp_0"
    assert build().compile_debug_dump_path() is None
    monkeypatch.setenv("FORWARDKIT_DEBUG_DUMP_PATH", "envdump")
    assert Path(build(debug_dump_path="rel/dump").compilation_config.debug_dump_path) == Path(os.getcwd()) / "envdump"


@pytest.mark.parametrize("value, level", [("1", OptimizationLevel.O1), (3, OptimizationLevel.O3),
                                          (OptimizationLevel.O0, OptimizationLevel.O0), ("0", OptimizationLevel.O0)])
def test_optimization_level_parsing(value, level):
    assert build(level=value).optimization_level == level


def test_async_scheduling_and_nccl_flag():
    cfg = build()
    assert cfg.scheduler_config.async_scheduling is True
    assert cfg.parallel_config.disable_nccl_for_dp_synchronization is True
    with pytest.raises(ValueError, match="async scheduling is not supported with speculative method 'ngram'"):
        EngineConfig(scheduler_config=SchedulerConfig(async_scheduling=True),
                     speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    assert build(spec=SpeculativeConfig(method="eagle")).scheduler_config.async_scheduling is True


def test_compilation_config_inputs(cuda_platform):
    # NOTE: a CompilationConfig object reads the platform when built, so build it under CUDA too.
    by_dict = build(cudagraph_mode="FULL", cudagraph_capture_sizes=[1, 2, 4])
    by_json = EngineConfig(model_config=ModelConfig(hf_config=LLAMA), platform="cuda",
                           compilation_config='{"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 2, 4]}')
    by_obj = EngineConfig(model_config=ModelConfig(hf_config=LLAMA), platform=CudaPlatform(),
                          compilation_config=CompilationConfig(cudagraph_mode="FULL", cudagraph_capture_sizes=[1, 2, 4]))
    hashes = {c.compilation_config.compute_hash() for c in (by_dict, by_json, by_obj)}
    assert len(hashes) == 1
    assert by_obj.compilation_config.cudagraph_capture_sizes == [1, 2, 4]
    with pytest.raises(ValueError, match="compilation_config must be a CompilationConfig"):
        EngineConfig(compilation_config=3.5)
    with pytest.raises(ValueError, match="platform"):
        EngineConfig(platform="tpu")
    with pytest.raises(ValueError, match="lora_config"):
        EngineConfig(lora_config={"r": 8})
    with pytest.raises(ValueError, match="bogus"):
        EngineConfig(bogus=1)


def test_default_platform_and_cpu(cpu_platform):
    cfg = EngineConfig(model_config=ModelConfig(hf_config=LLAMA))
    assert cfg.platform is cpu_platform
    cc = cfg.compilation_config
    assert cc.cudagraph_mode == NONE and cc.cudagraph_capture_sizes is None
    assert cc.bs_to_padded_graph_size is None and cc.cudagraph_num_of_warmups == 0


@pytest.mark.parametrize("cc, splitting", [
    ({}, []),  # no static graphs: one graph, no exit and entry around each attention
    ({"splitting_ops": ATTN}, ATTN),  # what the user lists is kept
    ({"splitting_ops": ["forwardkit::unified_attention"]}, ["forwardkit::unified_attention"]),
    ({"pass_config": {"enable_sp": True}}, ATTN),  # sequence parallelism's pass needs pieces
    ({"mode": 2}, []),
])
def test_a_platform_without_static_graphs_compiles_one_graph(cc, splitting):
    cfg = build(static=False, **cc)
    assert cfg.compilation_config.splitting_ops == splitting
    again = EngineConfig(model_config=cfg.model_config, compilation_config=cfg.compilation_config,
                         platform=CpuPlatform())
    assert again.compilation_config.splitting_ops == splitting  # resolving again: the same
    # with static graphs (an emulated CUDA platform) the reference's attention split stays
    assert build(static=True, **cc).compilation_config.splitting_ops == cc.get(
        "splitting_ops", ATTN if cc.get("mode") != 2 else [])


def test_platform_is_restored_after_resolution(cpu_platform):
    from forwardkit.platforms import current_platform

    build(static=True)
    assert current_platform.name == "cpu"


def test_chunked_prefill_check_against_model():
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(model_config=ModelConfig(hf_config=LLAMA),
                     scheduler_config=SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=2048,
                                                      max_model_len=2048))


def test_current_engine_config_context():
    import threading

    from forwardkit.config import (
        get_current_engine_config,
        get_current_engine_config_or_none,
        get_layers_from_engine_config,
        set_current_engine_config,
    )

    outer, inner = build(hf=None), build(hf=None)
    assert get_current_engine_config_or_none() is None
    fallback = get_current_engine_config()
    assert isinstance(fallback, EngineConfig) and fallback is not get_current_engine_config()
    seen_in_thread = []
    with set_current_engine_config(outer):
        assert get_current_engine_config() is outer
        with set_current_engine_config(inner):
            assert get_current_engine_config() is inner
            thread = threading.Thread(target=lambda: seen_in_thread.append(get_current_engine_config_or_none()))
            thread.start()
            thread.join()
        assert get_current_engine_config() is outer
        with pytest.raises(RuntimeError), set_current_engine_config(inner):
            raise RuntimeError("boom")
        assert get_current_engine_config() is outer
    assert get_current_engine_config_or_none() is None
    assert seen_in_thread == [None]  # a new thread starts with an empty context
    outer.compilation_config.static_forward_context.update({"a": 1, "b": "x"})
    assert get_layers_from_engine_config(outer, int) == {"a": 1}
    assert get_layers_from_engine_config(outer, str, ["b"]) == {"b": "x"}
    with set_current_engine_config(outer, check_compile=True):
        pass  # runs custom_op_log_check() without raising


def test_engine_hash():
    base = build().compute_hash()
    assert len(base) == 10 and build().compute_hash() == base
    assert build(seqs=4).compute_hash() != base
    assert build(tokens=4096).compute_hash() != base
    assert build(static=False).compute_hash() != base
    assert build(hf=None).compute_hash() != base
    assert build(tp=2).compute_hash() != base


@pytest.mark.parametrize("level, on", [(0, False), (1, True), (2, True), (3, True)])
def test_forwardkit_fusion_flags_follow_the_level(level, on):
    pc = build(level=level).compilation_config.pass_config
    assert (pc.fuse_rms_norm, pc.fuse_silu_and_mul) == (on, on)
    pc = build(level=level, pass_config={"fuse_rms_norm": not on}).compilation_config.pass_config
    assert (pc.fuse_rms_norm, pc.fuse_silu_and_mul) == (not on, on)  # a set value wins
