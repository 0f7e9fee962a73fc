"""ModelRunner: padding invariance, logits rows, FULL-graph metadata, KV sizing, errors."""

from __future__ import annotations

import pytest
import torch

from forwardkit.config.cache import CacheConfig
from forwardkit.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
from forwardkit.config.engine import EngineConfig
from forwardkit.config.frozen import unfrozen
from forwardkit.config.model import ModelConfig
from forwardkit.config.scheduler import SchedulerConfig
from forwardkit.runner import ModelRunner, StepBatch
from forwardkit.runner.setup import num_kv_blocks
from forwardkit.runner.static_metadata import StaticMetadataPool

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
MIXTRAL = {**LLAMA, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
           "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96}
BLOCK = 4


def _runner(hf_config: dict, num_blocks: int = 40) -> ModelRunner:
    torch.manual_seed(0)
    cfg = EngineConfig(
        model_config=ModelConfig(hf_config=dict(hf_config), max_model_len=128, enforce_eager=True),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
        cache_config=CacheConfig(block_size=BLOCK, num_gpu_blocks=num_blocks),
    )
    return ModelRunner(cfg)


def _tables(seq_lens: list[int], first_block: list[int]) -> list[list[int]]:
    return [list(range(b, b + -(-s // BLOCK))) for s, b in zip(seq_lens, first_block)]


def _prefill_batch() -> StepBatch:
    """Request a: whole prompt of 5; b: first chunk of 7 (no logits wanted); c: prompt of 2."""
    tokens = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [20, 21]]
    return StepBatch(["a", "b", "c"], tokens, [0, 0, 0], _tables([5, 7, 2], [0, 10, 20]),
                     sample=[True, False, True])


def _mixed_batch() -> StepBatch:
    """a decodes one token, b continues with 3 more prompt tokens, c decodes."""
    tokens = [[30], [18, 19, 23], [31]]
    return StepBatch(["a", "b", "c"], tokens, [5, 7, 2], _tables([6, 10, 3], [0, 10, 20]))


@pytest.mark.parametrize("hf_config", [LLAMA, MIXTRAL], ids=["llama", "mixtral"])
def test_padding_never_changes_logits(hf_config):
    # NOTE: not bit-exact: a GEMM over more rows may block its reductions differently.
    runner = _runner(hf_config)
    prefill = _prefill_batch()
    plain = runner.execute(prefill)
    assert runner.last_step.num_padded_tokens == 14 and runner.last_step.mode == CUDAGraphMode.NONE
    padded = runner.execute(prefill, pad_to=32)
    assert runner.last_step.num_padded_tokens == 32
    assert plain.shape == (2, 128)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    # The next step reads the KV written by the padded step: mixed decode + chunk.
    mixed = _mixed_batch()
    plain = runner.execute(mixed)
    padded = runner.execute(mixed, pad_to=9)
    assert plain.shape == (3, 128)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)


def test_batch_composition_does_not_change_logits():
    runner = _runner(LLAMA)
    together = runner.execute(_prefill_batch())
    alone = runner.execute(StepBatch(["c"], [[20, 21]], [0], [[20]]))
    torch.testing.assert_close(alone[0], together[1], rtol=1e-5, atol=1e-5)


def test_full_graph_metadata_pads_with_dummy_requests():
    """FULL-mode metadata (dummy decode requests on the scratch block, fixed width, persistent
    tensors) gives the same logits for the real rows as plain metadata."""
    from forwardkit.forward_context import set_forward_context

    runner = _runner(LLAMA)
    runner.execute(_prefill_batch())
    decode = StepBatch(["a", "c"], [[30], [31]], [5, 2], _tables([6, 3], [0, 20]))
    expected = runner.execute(decode)
    padded = 4
    md = runner._metadata(decode.query_lens, decode.seq_lens, decode.block_tables, padded,
                          CUDAGraphMode.FULL)
    first = next(iter(md.values()))
    assert first.num_reqs == padded and first.block_table.shape[1] == runner.max_blocks_per_req
    # A second step of the same size reuses the same tensors (what a FULL graph replays).
    again = runner._metadata(decode.query_lens, decode.seq_lens, decode.block_tables, padded,
                             CUDAGraphMode.FULL)
    assert next(iter(again.values())).slot_mapping.data_ptr() == first.slot_mapping.data_ptr()
    ids, pos = runner.buffers.fill(decode, padded)
    with torch.inference_mode(), set_forward_context(again, runner.engine_config, num_tokens=padded):
        hidden = runner.model(ids, pos)
    got = runner.model.compute_logits(hidden[:2]).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_empty_batch_returns_no_rows():
    runner = _runner(LLAMA)
    assert runner.execute(StepBatch()).shape == (0, 128)


def test_too_many_tokens_is_a_clear_error():
    runner = _runner(LLAMA)
    big = StepBatch(["x"], [list(range(65))], [0], [list(range(17))])
    with pytest.raises(ValueError, match="65 .*tokens does not fit"):
        runner.execute(big)
    with pytest.raises(ValueError, match="pad_to=100 exceeds"):
        runner.execute(_prefill_batch(), pad_to=100)


def test_kv_cache_bound_to_every_attention_layer():
    runner = _runner(LLAMA, num_blocks=7)
    assert runner.num_blocks == 7 and runner.scratch_block == 7
    assert len(runner.kv_caches) == 2
    for cache in runner.kv_caches.values():
        assert cache.shape[1] == 8  # 7 usable blocks + the scratch block


def test_num_kv_blocks_derivation():
    cpu = torch.device("cpu")
    kw = dict(block_size=16, max_model_len=100, max_num_seqs=3, device=cpu)
    assert num_kv_blocks(num_gpu_blocks=5, bytes_per_block=1, **kw) == 5
    assert num_kv_blocks(num_gpu_blocks=None, bytes_per_block=1024, **kw) == 21  # 3 * ceil(100/16)
    assert num_kv_blocks(num_gpu_blocks=None, bytes_per_block=2**28, **kw) == 2  # memory cap
    with pytest.raises(ValueError, match="num_gpu_blocks=0"):
        num_kv_blocks(num_gpu_blocks=0, bytes_per_block=1, **kw)


def test_static_metadata_pool_rejects_shape_change():
    from dataclasses import dataclass

    @dataclass
    class MD:
        t: torch.Tensor
        n: int

    pool = StaticMetadataPool()
    kept = pool.update(4, MD(torch.zeros(3), 1))
    same = pool.update(4, MD(torch.ones(3), 2))
    assert same is kept and kept.t.tolist() == [1.0, 1.0, 1.0] and kept.n == 2
    with pytest.raises(RuntimeError, match="changed shape"):
        pool.update(4, MD(torch.ones(5), 2))

    @dataclass
    class Other:
        t: torch.Tensor
        n: int

    with pytest.raises(TypeError, match="changed type MD -> Other"):
        pool.update(4, Other(torch.ones(3), 2))

    class Plain:  # not a dataclass: its fields could not be refilled in place
        t = torch.zeros(1)

    with pytest.raises(TypeError, match="must be a dataclass"):
        pool.update(8, Plain())  # rejected at its first size too, not only on refill


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(req_ids=["a"], token_ids=[], num_computed_tokens=[0], block_tables=[[0]]), "token_ids has 0"),
        (dict(req_ids=["a"], token_ids=[[]], num_computed_tokens=[0], block_tables=[[0]]), "no scheduled tokens"),
    ],
)
def test_step_batch_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepBatch(**kwargs)


def test_step_batch_views():
    b = _mixed_batch()
    assert b.num_tokens == 5 and b.query_lens == [1, 3, 1] and b.seq_lens == [6, 10, 3]
    assert b.flat_positions() == [5, 7, 8, 9, 2]
    assert b.logits_indices() == [0, 3, 4]


def test_warm_up_compile_sizes_runs_dummy_steps(monkeypatch):
    runner = _runner(LLAMA)
    assert runner.warm_up_compile_sizes() == []  # enforce_eager: nothing to compile
    seen = []
    monkeypatch.setattr(runner, "dummy_run", lambda n, mode=None: seen.append((n, mode)))
    with unfrozen(runner.engine_config):  # not eager, but compilation mode NONE: still nothing
        runner.model_config.enforce_eager = False
        runner.compilation_config.compile_sizes = [8, 2, 100, 8]
    assert runner.warm_up_compile_sizes() == [] and seen == []
    with unfrozen(runner.engine_config):  # emulate a compiling config on the same runner
        runner.compilation_config.mode = CompilationMode.VLLM_COMPILE
    assert runner.warm_up_compile_sizes() == [8, 2]  # 100 exceeds the 64-token buffers
    assert seen == [(8, CUDAGraphMode.NONE), (2, CUDAGraphMode.NONE)]


def test_dummy_run_goes_through_the_model():
    runner = _runner(MIXTRAL)
    runner.dummy_run(5)
    assert runner.last_step.num_padded_tokens == 5 and runner.last_step.num_tokens == 0
    runner.dummy_run(3, CUDAGraphMode.NONE, uniform_decode=True, force_attention=True)
    with pytest.raises(AssertionError, match="Cudagraph runtime mode mismatch"):
        runner.dummy_run(4, CUDAGraphMode.FULL)
    with pytest.raises(ValueError, match="exceeds max_num_tokens"):
        runner.dummy_run(65)


def _graph_config(cudagraph_mode: str, split: bool) -> CompilationConfig:
    """A mode-3 compilation config whose graph is (or is not) split at attention."""
    return CompilationConfig(mode=3, cudagraph_mode=cudagraph_mode,
                             splitting_ops=list(CompilationConfig.ATTENTION_OPS) if split else [])


@pytest.mark.parametrize("configured, support, split, expected", [
    ("FULL", 1, True, CUDAGraphMode.FULL_AND_PIECEWISE),
    ("FULL", 1, False, CUDAGraphMode.FULL_DECODE_ONLY),
    ("FULL", 3, True, CUDAGraphMode.FULL),
    ("FULL_AND_PIECEWISE", 1, True, CUDAGraphMode.FULL_AND_PIECEWISE),
    ("FULL_AND_PIECEWISE", 0, True, CUDAGraphMode.PIECEWISE),
    ("FULL_DECODE_ONLY", 0, False, CUDAGraphMode.NONE),
    ("PIECEWISE", 0, True, CUDAGraphMode.PIECEWISE),
])
def test_resolve_cudagraph_mode(configured, support, split, expected):
    """Lower the configured mode to what the attention backend supports (the engine config's
    decision, config/engine_graphs.py)."""
    from forwardkit.config.engine_graphs import resolve_graph_mode

    assert resolve_graph_mode(_graph_config(configured, split), support) == expected


def test_resolve_full_without_any_support_is_an_error():
    from forwardkit.config.engine_graphs import resolve_graph_mode

    cc = _graph_config("FULL", True)
    with pytest.raises(ValueError, match="supports none"):
        resolve_graph_mode(cc, 0)
    # off whatever the config says: enforce_eager, or a device that cannot capture
    assert resolve_graph_mode(cc, 3, enforce_eager=True) == CUDAGraphMode.NONE
    assert resolve_graph_mode(cc, 3, can_capture=False) == CUDAGraphMode.NONE


def test_the_runner_exposes_the_compile_state_its_model_registered_into():
    runner = _runner(LLAMA)
    state = runner.engine_config.compilation_config.compile_state
    assert runner.compile_state is state
    assert runner.attn_layer_names  # found in the state object the model registered into
    assert set(runner.attn_layer_names) <= set(state.static_forward_context)
