"""The decode-step profile (``forwardkit bench --generation --profile``): which rows it has and
that they add up; never how long anything takes."""

from __future__ import annotations

import json

import pytest

from forwardkit.bench.decode_profile import ROW_KINDS, format_profiles, profile_decode
from forwardkit.cli import main
from forwardkit.config.model_shapes import model_shape_config


@pytest.fixture(scope="module")
def llm():
    from forwardkit import LLM

    return LLM(model_shape="default", enforce_eager=True, max_num_seqs=4)


@pytest.mark.parametrize("batch", [1, 3])
def test_rows_cover_every_part_of_a_decode_step(llm, batch):
    cfg = model_shape_config("default")
    layers, hidden, vocab = (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"])
    profile = profile_decode(llm, batch, prompt_len=5, steps=2, warmup=1)
    assert profile.batch_size == batch and profile.steps == 2
    assert {r.kind for r in profile.rows} == set(ROW_KINDS)
    for kind in ROW_KINDS:
        if kind != "linear":
            assert len(profile.by_kind(kind)) == 1, kind
    (head,) = profile.by_kind("lm_head")
    assert head.detail == f"{batch}x{hidden} -> {vocab}" and head.calls == 1
    linear = {r.label: r for r in profile.by_kind("linear")}
    assert set(linear) == {"linear self_attn.qkv_proj", "linear self_attn.o_proj",
                           "linear mlp.gate_up_proj", "linear mlp.down_proj"}
    for row in linear.values():
        assert row.calls == layers and row.detail.startswith(f"{batch}x")
    (attn,) = profile.by_kind("attention")
    assert attn.calls == layers
    # the kernels' own counter: the native decode attention served every layer of each step
    # (float32, on unless -cpu_attention); the few-row linear kernel serves only where routed
    from forwardkit.kernels.cpu import native_attention

    if native_attention.available():
        assert profile.kernel_calls["attention"] == layers
    assert set(profile.kernel_calls) == {"attention", "linear", "quant"}
    parts = sum(r.ms for r in profile.rows if not r.kind.startswith("step"))
    (step,) = profile.by_kind("step_profiled")
    assert all(r.ms >= 0 for r in profile.rows if r.kind != "elementwise")
    assert parts == pytest.approx(step.ms, rel=0.35)  # medians of parts vs median of the whole
    table = format_profiles([profile], "title")
    for label in ("LM head", "linear mlp.down_proj", "attention", "norms / rotary / activation",
                  "sampling", "host: scheduler", "host: model runner", "host: engine step",
                  "step (profiled)", "step (no profiler)"):
        assert label in table
    assert f"B={batch}: native CPU kernel calls per step: attention " in table
    llm.generate(prompt_token_ids=[[1, 2, 3]])  # the engine is left as it was
    assert "step" not in vars(llm) and "execute" not in vars(llm.runner)


@pytest.mark.slow
def test_cli_profile_prints_a_column_per_batch_size(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["bench", "--generation", "--profile", "--model-shape", "default", "--batch-sizes",
                 "1,2", "--prompt-len", "4", "--new-tokens", "8", "--no-progress", "-O0",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--profile" in printed and "B=1 shape" in printed and "B=2 shape" in printed
    data = json.loads(out.read_text())
    assert set(data["profiles"]) == {"1", "2"}
    assert {r["kind"] for r in data["profiles"]["2"]} == set(ROW_KINDS)
