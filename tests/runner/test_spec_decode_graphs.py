"""Speculative decoding's decode steps (``1 + k`` tokens per request) through the real runner.

With ``num_speculative_tokens = 2`` a uniform decode step is 3 tokens per request; the capture
sizes are rounded to multiples of 3 and the torch-native backend (``UNIFORM_BATCH``) keeps FULL
decode graphs. The recording CUDA-graph stand-in (``tests/cudagraph/recording.py``) shows those
steps replaying the FULL graph of their rounded size, with every row's hidden state equal to an
eager runner without speculation (which runs the same 3 tokens as a prefill chunk). On the CPU
path the native decode kernel serves such steps: each of a request's tokens is a decode row
attending to its own prefix (``unfold_decodes``).
"""

from __future__ import annotations

import pytest
import torch

from forwardkit.config.cache import CacheConfig
from forwardkit.config.compilation import CUDAGraphMode as M
from forwardkit.config.engine import EngineConfig
from forwardkit.config.frozen import unfrozen
from forwardkit.config.model import ModelConfig
from forwardkit.config.scheduler import SchedulerConfig
from forwardkit.cudagraph.wrapper import CUDAGraphWrapper
from forwardkit.forward_context import BatchDescriptor as d
from forwardkit.kernels.cpu.native_build import kernel_calls
from forwardkit.platforms import CpuPlatform, CudaPlatform
from forwardkit.runner import ModelRunner, StepBatch
from forwardkit.runner.model_runner import unfold_decodes

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
}
BLOCK = 4
K = 2  # drafts: decode steps of 3 tokens per request


def _config(graphs: bool, spec: bool, custom_ops: list[str] | None = None) -> EngineConfig:
    cc: dict = {"mode": 0}
    if graphs:
        cc = {"mode": 3, "backend": "eager", "cudagraph_mode": "FULL_AND_PIECEWISE"}
    if custom_ops is not None:
        cc["custom_ops"] = custom_ops
    cfg = EngineConfig(
        model_config=ModelConfig(hf_config=dict(LLAMA), max_model_len=64),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
        cache_config=CacheConfig(block_size=BLOCK, num_gpu_blocks=32),
        compilation_config=cc,
        speculative_config={"num_speculative_tokens": K} if spec else None,
        platform=CudaPlatform(device_capability=90) if graphs else CpuPlatform(),
    )
    if graphs:
        with unfrozen(cfg):
            cfg.platform = CpuPlatform()  # graph settings stay as resolved for CUDA
    return cfg


def _start(cfg: EngineConfig) -> ModelRunner:
    runner = ModelRunner(cfg, device="cpu")
    runner.warm_up_compile_ranges()
    runner.capture_model()
    runner.keep_hidden = True
    return runner


def _tables(seq_lens, firsts):
    return [list(range(b, b + -(-s // BLOCK))) for s, b in zip(seq_lens, firsts)]


def _verify(ids, rows, computed, firsts):
    """A verify step: each request's last token and its K drafts."""
    return StepBatch(ids, rows, computed, _tables([c + len(r) for c, r in zip(computed, rows)],
                                                   firsts))


# prefill (14 tokens), then verify steps of 3, 2 and 1 requests (9, 6, 3 tokens), a non-uniform step (one request has fewer drafts), and a
# plain one-token decode.
STEPS = [
    ("prefill", StepBatch(["a", "b", "c"], [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [20, 21]],
                          [0, 0, 0], _tables([5, 7, 2], [0, 10, 20]))),
    ("verify-3", _verify(["a", "b", "c"], [[30, 40, 41], [31, 42, 43], [32, 44, 45]], [5, 7, 2],
                         [0, 10, 20])),
    ("verify-2", _verify(["a", "c"], [[33, 46, 47], [34, 48, 49]], [7, 4], [0, 20])),
    ("verify-1", _verify(["c"], [[35, 50, 51]], [6], [20])),
    ("uneven", _verify(["a", "c"], [[36, 52, 53], [37]], [9, 8], [0, 20])),
    ("decode", _verify(["a"], [[38]], [11], [0])),
]
# the FULL graph (its rounded size) each step replays; None: no FULL graph
FULL_KEYS = {"prefill": None, "verify-3": 9, "verify-2": 6, "verify-1": 3, "uneven": None,
             "decode": None}


@pytest.fixture(scope="module")
def eager_hidden():
    """Every row's hidden state from a runner without speculation or graphs."""
    runner = _start(_config(graphs=False, spec=False))
    out = {}
    for name, batch in STEPS:
        logits = runner.execute(batch)
        assert runner.last_hidden is not None
        out[name] = (logits, runner.last_hidden[: batch.num_tokens].clone())
    return out


def _full_replays(runner: ModelRunner) -> dict[int, int]:
    assert isinstance(runner.model, CUDAGraphWrapper)
    return {desc.num_tokens: entry.cudagraph.replays
            for desc, entry in runner.model.concrete_cudagraph_entries.items()}


def test_verify_steps_replay_full_graphs_of_rounded_sizes(recording_graphs, eager_hidden):
    cfg = _config(graphs=True, spec=True)
    assert cfg.uniform_decode_query_len == 1 + K
    assert cfg.compilation_config.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 24]  # vLLM's
    runner = _start(cfg)
    assert runner.cudagraph_mode == M.FULL_AND_PIECEWISE and runner.unfold_query_len == 1 + K
    # the runner rounds them to multiples of 1 + K (vLLM's adjust_cudagraph_sizes_for_spec_decode)
    assert runner.planner.dispatcher._capture_sizes() == [3, 6, 9, 18, 24]
    keys = set(runner.model.concrete_cudagraph_entries)
    assert keys == {d(3, 1, True), d(6, 2, True), d(9, 3, True)}  # uniform: 1 + K per request
    for name, batch in STEPS:
        before = _full_replays(runner)
        logits = runner.execute(batch)
        after = _full_replays(runner)
        stepped = {n for n in after if after[n] != before[n]}
        key = FULL_KEYS[name]
        assert stepped == (set() if key is None else {key}), name
        assert (runner.last_step.mode == M.FULL) == (key is not None), name
        assert runner.last_hidden is not None
        want_logits, want_hidden = eager_hidden[name]
        torch.testing.assert_close(runner.last_hidden[: batch.num_tokens], want_hidden,
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    assert set(runner.model.concrete_cudagraph_entries) == keys  # nothing captured later


def test_native_decode_kernel_serves_several_tokens_per_request(eager_hidden):
    """No graphs, the CPU path: a verify step's rows go to the native decode kernel (one call
    per layer), and every row equals the runner without speculation."""
    from forwardkit.kernels.cpu import native_attention

    if not native_attention.available():
        pytest.skip("the native CPU decode attention kernel cannot be built here")
    runner = _start(_config(graphs=False, spec=True))
    for name, batch in STEPS:
        served = kernel_calls.snapshot()
        logits = runner.execute(batch)
        calls = kernel_calls.since(served)["attention"]
        # (in "prefill", request c's 2-token prompt is short enough to run as decode rows)
        assert calls == LLAMA["num_hidden_layers"], name
        assert runner.last_hidden is not None
        torch.testing.assert_close(runner.last_hidden[: batch.num_tokens], eager_hidden[name][1],
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, eager_hidden[name][0], rtol=1e-4, atol=1e-4)


def test_unfold_decodes():
    tables = [[0, 1], [2], [3, 4, 5]]
    assert unfold_decodes([3, 1, 9], [7, 2, 10], tables, 3) == (
        [1, 1, 1, 1, 9], [5, 6, 7, 2, 10], [[0, 1]] * 3 + [[2], [3, 4, 5]])
    same = ([2, 1], [5, 3], [[0], [1]])
    assert unfold_decodes(*same, 1) is not None and unfold_decodes(*same, 1) == same
