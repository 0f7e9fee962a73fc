"""SchedulerConfig / SpeculativeConfig: defaults, validation, hash."""

from __future__ import annotations

import pytest

from forwardkit.config.scheduler import SchedulerConfig, SpeculativeConfig


def test_defaults():
    s = SchedulerConfig()
    assert (s.max_num_seqs, s.max_num_batched_tokens) == (128, 2048)
    assert s.enable_chunked_prefill and s.async_scheduling is None
    assert s.max_num_encoder_input_tokens == s.encoder_cache_size == 2048


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_num_seqs=4096), r"max_num_batched_tokens \(2048\) must be greater than or equal to max_num_seqs \(4096\)\."),
        (dict(max_num_batched_tokens=0), "greater than or equal to 1"),
        (dict(max_num_seqs=0), "greater than or equal to 1"),
        (dict(max_num_batched_tokens=1024, enable_chunked_prefill=False, max_model_len=4096), "max_model_len"),
        (dict(max_num_batched_tokens=1024, is_encoder_decoder=True, max_model_len=4096), "chunked prefill"),
        (dict(max_num_partial_prefills=0), "max_num_partial_prefills"),
        (dict(unknown=1), "unknown"),
    ],
)
def test_invalid(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


def test_chunked_prefill_off_ok_and_encoder_decoder():
    assert not SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=4096,
                               max_model_len=4096).enable_chunked_prefill
    assert not SchedulerConfig(is_encoder_decoder=True, max_num_batched_tokens=8192).enable_chunked_prefill


def test_hash_only_token_budget():
    base = SchedulerConfig().compute_hash()
    assert SchedulerConfig(max_num_seqs=4).compute_hash() == base
    assert SchedulerConfig(max_num_batched_tokens=4096).compute_hash() != base


def test_speculative_config():
    assert SpeculativeConfig(num_speculative_tokens=3).method == "ngram"
    assert SpeculativeConfig(method="eagle").use_eagle()
    assert not SpeculativeConfig().use_eagle()
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        SpeculativeConfig(num_speculative_tokens=0)
    assert SpeculativeConfig(num_speculative_tokens=2).compute_hash() != SpeculativeConfig().compute_hash()
