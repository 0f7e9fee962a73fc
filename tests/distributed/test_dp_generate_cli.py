"""``torchrun --nproc-per-node 2 forwardkit generate -dp 2``: the prompts are split over the two
ranks and rank 0 prints every completion once, whole, in prompt order: the same lines as one
process. A dense model runs as two independent replicas; a mixture-of-experts model as one
data-parallel engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from forwardkit.distributed.launch import find_free_port

pytestmark = pytest.mark.distributed

PROMPTS = ["--prompt-token-ids", "1,2,3", "--prompt-token-ids", "7,8", "--prompt-token-ids", "9",
           "--prompt-token-ids", "4,5,6,7", "--prompt-token-ids", "11,12"]
ARGS = ["generate", *PROMPTS, "--max-tokens", "5", "--ignore-eos", "--enforce-eager",
        "--max-model-len", "64", "--output", "json"]


def _run(tmp_path, prefix: list[str], extra: list[str]) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *prefix, "-m", "forwardkit.cli", *ARGS, *extra],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def _torchrun() -> list[str]:
    return ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(find_free_port())]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> str:
    from transformers import MixtralConfig, MixtralForCausalLM

    path = str(tmp_path_factory.mktemp("mixtral"))
    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128)
    torch.manual_seed(0)
    MixtralForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


def test_dense_model_dp2_splits_prompts_and_prints_each_once_in_order(tmp_path):
    one = _run(tmp_path, [], [])
    assert len(one) == 5
    assert _run(tmp_path, _torchrun(), ["-dp", "2"]) == one


def test_moe_model_dp2_splits_prompts_and_prints_each_once_in_order(tmp_path, mixtral):
    one = _run(tmp_path, [], ["--model", mixtral])
    assert len(one) == 5
    assert _run(tmp_path, _torchrun(), ["--model", mixtral, "-dp", "2"]) == one
