"""``forwardkit bench --workload``: the shared-prefix workloads, caching on vs off."""

from __future__ import annotations

import json

import pytest

from forwardkit.bench.prefix_workloads import Shape, run_workload
from forwardkit.cli import main
from forwardkit.engine import LLM


@pytest.fixture(scope="module")
def engines():
    kw = dict(enforce_eager=True, max_model_len=160, max_num_seqs=16, max_num_batched_tokens=256)
    return LLM(enable_prefix_caching=True, **kw), LLM(enable_prefix_caching=False, **kw)


def test_rl_computes_each_prompt_once_plus_a_block_per_sample(engines):
    on, off = engines
    shape = Shape(3, 64, 2, n=4)  # 64 tokens = 4 blocks of 16
    got, ref = run_workload(on, "rl", shape, seed=1), run_workload(off, "rl", shape, seed=1)
    assert got.prompt_tokens == ref.prompt_tokens == 3 * 4 * 64
    assert ref.computed_tokens == 3 * 4 * 64 and ref.hit_tokens == 0
    assert got.computed_tokens == 3 * (64 + 3 * 16)  # the last block is recomputed per sample
    assert got.hit_rate == pytest.approx(3 * 3 * 48 / (3 * 4 * 64))
    assert got.output_tokens == ref.output_tokens == 3 * 4 * 2
    assert len(got.ttft_s) == 3 and all(t > 0 for t in got.ttft_s)


def test_chat_turns_hit_the_conversation_so_far(engines):
    on, off = engines
    shape = Shape(2, 40, 3, turns=3, turn_len=10)
    got, ref = run_workload(on, "chat", shape, seed=2), run_workload(off, "chat", shape, seed=2)
    # turn lengths 40, 53, 66: turn 2 hits the 2 full blocks of turn 1's prompt + answer (32),
    # turn 3 its 3 full blocks (48)
    assert ref.computed_tokens == got.prompt_tokens == 2 * (40 + 53 + 66)
    assert got.computed_tokens == ref.computed_tokens - 2 * (32 + 48)
    assert len(got.last_turn_ttft_s) == 2


def test_system_prompt_shared_by_every_question(engines):
    on, _ = engines
    got = run_workload(on, "system-prompt", Shape(5, 64, 2, turn_len=8), seed=3)
    assert got.computed_tokens == 72 + 4 * 8  # the first computes all, then 64 are cached


def test_cli_quick_run_writes_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "w.json"
    assert main(["bench", "--workload", "system-prompt", "--quick", "--no-progress",
                 "--enforce-eager", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| system-prompt | forwardkit-no-prefix-cache |" in text
    data = json.loads(out.read_text())["workloads"]["system-prompt"]
    assert data["forwardkit"]["computed_tokens"] < data["forwardkit-no-prefix-cache"]["computed_tokens"]
    assert data["forwardkit-no-prefix-cache"]["hit_rate"] == 0


def test_cli_refuses_workload_with_generation(capsys):
    assert main(["bench", "--workload", "rl", "--generation"]) != 0
    assert "--workload runs forwardkit with prefix caching on and off" in capsys.readouterr().err


def test_cli_refuses_workload_with_a_caching_flag(capsys):
    assert main(["bench", "--workload", "rl", "--no-enable-prefix-caching"]) != 0
    assert "--[no-]enable-prefix-caching" in capsys.readouterr().err
