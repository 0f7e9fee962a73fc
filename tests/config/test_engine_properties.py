"""Property tests of EngineConfig resolution (hypothesis).

* compile ranges partition ``[1, max_num_batched_tokens]`` with no gap or overlap;
* default capture sizes and the padding table for random batch limits;
* a compilation config given as an object, a dict or JSON resolves to the same thing, and
  resolving an already-resolved config again changes nothing.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forwardkit.config import CompilationConfig, EngineConfig, ModelConfig, SchedulerConfig
from forwardkit.config.engine import default_capture_sizes
from forwardkit.platforms import CudaPlatform, use_platform

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 2, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
CUDA = CudaPlatform(device_capability=90)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def limits(draw):
    seqs = draw(st.integers(1, 1024))
    tokens = draw(st.integers(seqs, 16384))
    return seqs, tokens


def _engine(seqs: int, tokens: int, **cc) -> EngineConfig:
    return EngineConfig(model_config=ModelConfig(hf_config=LLAMA), platform=CUDA,
                        scheduler_config=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens),
                        compilation_config=cc)


@SETTINGS
@given(limits(), st.lists(st.integers(1, 20000), max_size=6))
def test_compile_ranges_partition_token_budget(lim, points):
    seqs, tokens = lim
    ranges = _engine(seqs, tokens, compile_ranges_split_points=points).compilation_config.get_compile_ranges()
    assert ranges[0].start == 1 and ranges[-1].end == tokens
    for prev, nxt in zip(ranges, ranges[1:]):
        assert nxt.start == prev.end + 1  # no gap, no overlap
    assert all(r.start <= r.end for r in ranges)
    inner = sorted({p for p in points if 1 < p < tokens})
    assert [r.end for r in ranges] == [*inner, tokens]


@SETTINGS
@given(limits())
def test_default_capture_sizes_and_padding(lim):
    seqs, tokens = lim
    cfg = _engine(seqs, tokens)
    cc = cfg.compilation_config
    limit = min(seqs * 2, 512, tokens)
    sizes = cc.cudagraph_capture_sizes
    assert sizes == default_capture_sizes(limit)
    assert sizes == sorted(set(sizes)) and all(1 <= s <= limit for s in sizes)
    assert cc.max_cudagraph_capture_size == sizes[-1]
    assert limit - sizes[-1] < (16 if limit >= 256 else 8 if limit >= 8 else 4)
    assert cfg.pad_for_cudagraph(0) == 0
    for n in range(1, cc.max_cudagraph_capture_size + 1):
        padded = cfg.pad_for_cudagraph(n)
        assert padded == min(s for s in sizes if s >= n)
    with pytest.raises(IndexError):
        cfg.pad_for_cudagraph(cc.max_cudagraph_capture_size + 1)


compilation_dicts = st.fixed_dictionaries(
    {},
    optional={
        "mode": st.sampled_from([0, 1, 2, 3]),
        "cudagraph_mode": st.sampled_from(["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]),
        "cudagraph_capture_sizes": st.lists(st.integers(1, 600), min_size=1, max_size=5),
        "custom_ops": st.sampled_from([[], ["all"], ["none", "+rms_norm"], ["-rms_norm"]]),
        "splitting_ops": st.sampled_from([None, []]),
        "compile_ranges_split_points": st.lists(st.integers(1, 4000), max_size=3),
        "pass_config": st.fixed_dictionaries({}, optional={
            "eliminate_noops": st.booleans(), "enable_sp": st.booleans(), "fuse_norm_quant": st.booleans()}),
        "cudagraph_num_of_warmups": st.integers(0, 3),
    },
)


def _resolve(value):
    try:
        cfg = EngineConfig(model_config=ModelConfig(hf_config=LLAMA), platform=CUDA, compilation_config=value)
    except ValueError as exc:
        return ("error", type(exc).__name__)
    return ("ok", cfg.compilation_config.compute_hash(), cfg.compilation_config.to_dict())


@SETTINGS
@given(compilation_dicts)
def test_dict_json_and_object_agree(cc):
    by_dict = _resolve(json.loads(json.dumps(cc)))
    by_json = _resolve(json.dumps(cc))
    with use_platform(CUDA):
        try:
            obj = CompilationConfig(**json.loads(json.dumps(cc)))
        except ValueError:
            obj = None
    if obj is not None:
        assert _resolve(obj) == by_dict
    assert by_dict == by_json


@SETTINGS
@given(compilation_dicts)
def test_resolving_a_resolved_config_is_stable(cc):
    first = _resolve(cc)
    if first[0] != "ok":
        return
    again = _resolve(first[2])
    assert again[0] == "ok"
    assert again[2] == first[2]
