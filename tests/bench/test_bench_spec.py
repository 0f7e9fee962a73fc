"""``forwardkit bench --generation --speculative-config``: a ``forwardkit+spec`` contender
beside plain forwardkit (which does not speculate), its acceptance in the table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from forwardkit.cli import main

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'


def test_spec_contender_beside_plain_forwardkit(tmp_path, capsys, monkeypatch):
    from forwardkit.bench import generation as gen

    seen: dict[int, object] = {}
    plain_llm_generate = gen.llm_generate

    def recording(llm, loras=()):  # which contender LLM speculates
        seen[id(llm)] = llm.engine_config.speculative_config
        return plain_llm_generate(llm, loras)

    monkeypatch.setattr(gen, "llm_generate", recording)
    out = tmp_path / "gen.json"
    assert main(["bench", "--generation", "--quick", "--no-progress", "--new-tokens", "12",
                 "--contenders", "eager,forwardkit", "--speculative-config", NGRAM, "-O0",
                 "--bandwidth-probe", "off", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    # the explicit list is kept: no forwardkit+spec unless named (or the list is the default)
    assert list(data["contenders"]) == ["eager", "forwardkit"]
    assert all(spec is None for spec in seen.values())
    seen.clear()
    assert main(["bench", "--generation", "--quick", "--no-progress", "--new-tokens", "12",
                 "--contenders", "forwardkit,forwardkit+spec", "--speculative-config", NGRAM,
                 "-O0", "--bandwidth-probe", "off", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data["contenders"]) == ["forwardkit", "forwardkit+spec"]
    assert sorted(spec is not None for spec in seen.values()) == [False, True]
    assert "spec_decode" not in data["contenders"]["forwardkit"]
    sd = data["contenders"]["forwardkit+spec"]["spec_decode"]
    assert sd["method"] == "ngram" and sd["num_speculative_tokens"] == 3
    assert 0 < sd["accepted_tokens"] <= sd["draft_tokens"]
    assert sd["acceptance"] == pytest.approx(sd["accepted_tokens"] / sd["draft_tokens"])
    assert len(sd["accepted_per_pos"]) == 3 and sum(sd["accepted_per_pos"]) == sd["accepted_tokens"]
    printed = capsys.readouterr().out
    assert "forwardkit+spec (ngram, k=3): " in printed and "decode tok/s vs forwardkit B=1: " in printed


def test_default_list_gains_the_spec_contender():
    import argparse

    from forwardkit.bench.generation_cli import _with_spec

    names = ["eager", "torch.compile", "forwardkit", "transformers"]
    spec = argparse.Namespace(speculative_config={"method": "ngram"}, contenders=None)
    assert _with_spec(names, spec) == ["eager", "torch.compile", "forwardkit", "forwardkit+spec",
                                       "transformers"]
    assert _with_spec(names, argparse.Namespace(speculative_config=None, contenders=None)) == names


@pytest.mark.parametrize("argv, message", [
    (["bench", "--generation", "--contenders", "forwardkit+spec"],
     "--contenders forwardkit+spec needs --speculative-config JSON"),
    (["bench", "--contenders", "forwardkit+spec"], "--contenders forwardkit+spec needs --generation"),
])
def test_spec_contender_errors(argv, message):
    proc = subprocess.run([sys.executable, "-m", "forwardkit.cli", *argv], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


def test_spec_profile_splits_a_step():
    """Every decode step is split into draft, verify, sampling and host time (each measured:
    the wrappers saw the engine's calls), parts adding up to the step; the engine is left as
    it was."""
    from forwardkit.bench.spec_profile import SPEC_PARTS, format_spec_profiles, profile_spec_steps
    from forwardkit.engine import LLM

    llm = LLM(enforce_eager=True, max_num_seqs=4, speculative_config=json.loads(NGRAM))
    prof = profile_spec_steps(llm, 2, prompt_len=6, new_tokens=10)
    assert prof.steps >= 2 and prof.tokens_per_request_step >= 1.0
    assert all(prof.ms[p] > 0 for p in ("draft", "verify", "sampling", "step"))
    assert sum(prof.ms[p] for p in ("draft", "verify", "sampling")) <= prof.ms["step"] * 1.05
    table = format_spec_profiles([prof], "title")
    assert all(part in table for part in SPEC_PARTS) and "B=2" in table
    assert not {"step", "_propose_drafts", "_execute"} & set(vars(llm))
    assert not {"sample", "draw", "target_distribution"} & set(vars(llm.sampler))
    with pytest.raises(ValueError, match="needs an LLM with a speculative_config"):
        profile_spec_steps(LLM(enforce_eager=True), 1)


@pytest.mark.slow
def test_cli_profile_with_speculation(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["bench", "--generation", "--profile", "--model-shape", "default", "--batch-sizes",
                 "1,2", "--prompt-len", "4", "--new-tokens", "8", "--no-progress", "-O0",
                 "--speculative-config", NGRAM, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "forwardkit+spec (ngram, k=3): decode steps" in printed and "draft" in printed
    data = json.loads(out.read_text())
    assert set(data["spec_profiles"]) == {"1", "2"}
    assert data["spec_profiles"]["2"]["ms"]["verify"] > 0
