"""Every cudagraph mode through the real runner, compiled model and wrappers, on CPU.

The recording stand-in (``tests/cudagraph/recording.py``) replaces ``torch.cuda.CUDAGraph``:
a replay re-runs the captured call on the captured tensors. For each mode the tests assert
exactly which graphs start-up captures (per wrapper: the FULL one around the model, one
PIECEWISE one per compiled piece), which of them each kind of step replays, and that every
step's logits equal an eager runner's.
"""

from __future__ import annotations

import pytest
import torch

from forwardkit.compilation.counters import compilation_counter
from forwardkit.config.cache import CacheConfig
from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.config.engine import EngineConfig
from forwardkit.config.frozen import unfrozen
from forwardkit.config.model import ModelConfig
from forwardkit.config.scheduler import SchedulerConfig
from forwardkit.cudagraph.wrapper import CUDAGraphWrapper
from forwardkit.forward_context import BatchDescriptor as d
from forwardkit.platforms import CpuPlatform, CudaPlatform
from forwardkit.runner import ModelRunner, StepBatch

M = CUDAGraphMode
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
}
BLOCK = 4
PIECES = ["piece0", "piece1", "piece2"]  # 2 decoder layers split at 2 attention ops -> 3 pieces


def _config(mode: str | None) -> EngineConfig:
    """Resolved for an (emulated) CUDA platform, then run on the CPU platform."""
    cc = {"mode": 0} if mode is None else {
        "mode": 3, "backend": "eager", "cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4],
    }
    cfg = EngineConfig(
        model_config=ModelConfig(hf_config=dict(LLAMA), max_model_len=64),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
        cache_config=CacheConfig(block_size=BLOCK, num_gpu_blocks=32),
        compilation_config=cc,
        platform=CudaPlatform(device_capability=90),
    )
    with unfrozen(cfg):
        cfg.platform = CpuPlatform()  # graph settings stay as resolved for CUDA
    return cfg


def _start(mode: str | None) -> ModelRunner:
    """What ``LLM`` does at start-up: build, compile warm-up, capture."""
    runner = ModelRunner(_config(mode), device="cpu")
    runner.warm_up_compile_ranges()
    runner.capture_model()
    return runner


def _wrappers(runner: ModelRunner) -> dict[str, CUDAGraphWrapper]:
    found = {f"piece{i}": w for i, w in enumerate(runner.piece_wrappers)}
    if isinstance(runner.model, CUDAGraphWrapper):
        found["full"] = runner.model
    return found


def _replays(runner: ModelRunner) -> dict:
    return {
        (label, desc): entry.cudagraph.replays
        for label, w in _wrappers(runner).items()
        for desc, entry in w.concrete_cudagraph_entries.items()
    }


def _tables(seq_lens, firsts):
    return [list(range(b, b + -(-s // BLOCK))) for s, b in zip(seq_lens, firsts)]


# prefill over the largest capture size, a uniform decode of 3 (pads to 4), a mixed step of 3.
STEPS = {
    "over-size": StepBatch(["a", "b", "c"], [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [20, 21]],
                           [0, 0, 0], _tables([5, 7, 2], [0, 10, 20])),
    "decode": StepBatch(["a", "b", "c"], [[30], [31], [32]], [5, 7, 2], _tables([6, 8, 3], [0, 10, 20])),
    "mixed": StepBatch(["a", "c"], [[33], [34, 35]], [6, 3], _tables([7, 5], [0, 20])),
    "decode-2": StepBatch(["a", "c"], [[36], [37]], [7, 5], _tables([8, 6], [0, 20])),
}

MIXED_KEYS = {d(4), d(2), d(1)}
DECODE_KEYS = {d(4, 4, True), d(2, 2, True), d(1, 1, True)}


def _piece_keys(keys):
    return {p: set(keys) for p in PIECES}


# configured mode -> (resolved mode, captured keys per wrapper, replayed (wrapper, key) per step)
CASES = {
    "NONE": (M.NONE, {}, {s: set() for s in STEPS}),
    "PIECEWISE": (M.PIECEWISE, _piece_keys(MIXED_KEYS), {
        "over-size": set(), "decode": {(p, d(4)) for p in PIECES},
        "mixed": {(p, d(4)) for p in PIECES}, "decode-2": {(p, d(2)) for p in PIECES},
    }),
    "FULL_DECODE_ONLY": (M.FULL_DECODE_ONLY, {"full": DECODE_KEYS}, {
        "over-size": set(), "decode": {("full", d(4, 4, True))}, "mixed": set(),
        "decode-2": {("full", d(2, 2, True))},
    }),
    "FULL_AND_PIECEWISE": (M.FULL_AND_PIECEWISE, {**_piece_keys(MIXED_KEYS), "full": DECODE_KEYS}, {
        "over-size": set(), "decode": {("full", d(4, 4, True))},
        "mixed": {(p, d(4)) for p in PIECES}, "decode-2": {("full", d(2, 2, True))},
    }),
}
# The torch-native attention backend supports full graphs for uniform decode batches only, so a
# configured FULL is served as FULL_AND_PIECEWISE (vLLM's resolution); same graphs.
CASES["FULL"] = (M.FULL_AND_PIECEWISE, *CASES["FULL_AND_PIECEWISE"][1:])


@pytest.fixture(scope="module")
def eager_logits():
    runner = _start(None)
    assert runner.cudagraph_mode == M.NONE
    return {name: runner.execute(batch) for name, batch in STEPS.items()}


@pytest.mark.parametrize("configured", list(CASES))
def test_mode_captures_and_replays_exactly(configured, recording_graphs, eager_logits):
    resolved, captured, replayed = CASES[configured]
    before = compilation_counter.num_cudagraph_captured
    runner = _start(configured)
    assert runner.cudagraph_mode == resolved
    wrappers = _wrappers(runner)
    # start-up: exactly these keys, on exactly these wrappers
    assert {label: set(w.concrete_cudagraph_entries) for label, w in wrappers.items()} == captured
    total = sum(len(k) for k in captured.values())
    assert compilation_counter.num_cudagraph_captured - before == total
    assert runner.capture_stats.get("graphs", {}) == {
        m: n for m, n in (("PIECEWISE", sum(len(captured.get(p, ())) for p in PIECES)),
                          ("FULL", len(captured.get("full", ())))) if n
    }
    graphs = runner.graph_backend.graphs if configured != "NONE" else []
    assert len(graphs) == total
    assert {id(g.pool) for g in graphs} <= {id(runner.graph_backend.pool)}  # one shared pool
    for label, w in wrappers.items():
        for entry in w.concrete_cudagraph_entries.values():
            # only the first piece (and the whole-model graph) capture with gc live
            assert entry.cudagraph.gc_kept == (label in ("piece0", "full")), label

    for name, batch in STEPS.items():
        counts = _replays(runner)
        got = runner.execute(batch)
        after = _replays(runner)
        assert set(after) == set(counts), f"{name}: a graph was captured after start-up"
        stepped = {key for key in after if after[key] != counts[key]}
        assert stepped == replayed[name], name
        assert all(after[k] - counts[k] == 1 for k in stepped)
        expected_mode = next((M.FULL if label == "full" else M.PIECEWISE for label, _ in stepped), M.NONE)
        assert runner.last_step.mode == expected_mode, name
        torch.testing.assert_close(got, eager_logits[name], rtol=1e-5, atol=1e-5)


def test_replay_reads_captured_storage(recording_graphs, eager_logits):
    """Control: the stand-in really replays on the captured tensors. Feeding the pieces a
    fresh copy of the input ids (other storage) makes the replayed logits wrong."""
    runner = _start("PIECEWISE")
    runner.execute(STEPS["over-size"])
    original = runner.buffers.input_ids
    runner.buffers.input_ids = original.clone()  # the captured graphs still read `original`
    original.zero_()
    got = runner.execute(STEPS["decode"])
    assert runner.last_step.mode == M.PIECEWISE
    assert not torch.allclose(got, eager_logits["decode"], rtol=1e-3, atol=1e-3)


def test_full_mode_with_full_capable_attention(recording_graphs, eager_logits, monkeypatch):
    """FULL as such, with the backend claiming full-graph support for every batch: one FULL
    graph per capture size around the model, no piece graphs; decodes replay it. (Mixed
    batches would need metadata of one shape per padded size, which the torch-native backend
    does not provide; that is why it does not claim this support.)"""
    from forwardkit.layers.attention_backend import AttentionCGSupport, TorchNativeAttentionBackend

    monkeypatch.setattr(TorchNativeAttentionBackend, "cudagraph_support", AttentionCGSupport.ALWAYS)
    runner = _start("FULL")
    assert runner.cudagraph_mode == M.FULL
    assert {label: set(w.concrete_cudagraph_entries) for label, w in _wrappers(runner).items()} == {
        "full": MIXED_KEYS}
    for name, key in (("over-size", None), ("decode", d(4))):
        counts = _replays(runner)
        got = runner.execute(STEPS[name])
        stepped = {k for k, v in _replays(runner).items() if v != counts[k]}
        assert stepped == (set() if key is None else {("full", key)}), name
        torch.testing.assert_close(got, eager_logits[name], rtol=1e-5, atol=1e-5)


def test_capture_is_logged_per_mode(recording_graphs, fk_log_records):
    runner = _start("FULL_AND_PIECEWISE")
    lines = [r.getMessage() for r in fk_log_records]
    assert any(line.startswith("Graph capturing finished in") for line in lines)
    # 3 decode sizes in the FULL graph; 3 mixed sizes x 3 compiled pieces
    assert any("cudagraph_mode FULL_AND_PIECEWISE: captured 3 FULL graphs, 9 PIECEWISE graphs"
               in line and "3 compiled pieces wrapped" in line for line in lines), lines
    assert runner.capture_stats["keys"] == {"PIECEWISE": 3, "FULL": 3}
    assert runner.capture_stats["graph_memory_bytes"] is None  # measured on a GPU only
