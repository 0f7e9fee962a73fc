"""``--enable-lora`` / ``--lora NAME=DIR`` on ``forwardkit generate`` and ``bench``."""

from __future__ import annotations

import json

import pytest

from forwardkit import LLM, LoRARequest, SamplingParams, cli
from forwardkit.engine.lora import LoRAManager

PROMPTS = [[3, 4, 5], [9, 8, 7, 6], [11, 12]]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse rejects bad flag values itself (exit 2)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_takes_adapters_in_turn(lora_paths, capsys):
    base, a_dir = lora_paths("llama_all")
    _, b_dir = lora_paths("llama_ko_gate")
    argv = ["generate", "--model", base, "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "64", "--max-tokens", "6", "--ignore-eos", "--output", "json",
            "--lora", f"a={a_dir}", "--lora", f"b={b_dir}"]
    for p in PROMPTS:
        argv += ["--prompt-token-ids", ",".join(map(str, p))]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    got = [json.loads(line)["token_ids"] for line in out.strip().splitlines()]
    llm = LLM(base, dtype="float32", enforce_eager=True, max_model_len=64, enable_lora=True,
              max_loras=2)
    a, b = LoRARequest("a", 1, a_dir), LoRARequest("b", 2, b_dir)
    want = llm.generate(prompt_token_ids=PROMPTS, use_tqdm=False, lora_request=[a, b, a],
                        sampling_params=SamplingParams(temperature=0, max_tokens=6,
                                                       ignore_eos=True))
    assert got == [list(o.outputs[0].token_ids) for o in want]
    base_only = llm.generate(prompt_token_ids=PROMPTS[:1], use_tqdm=False,
                             sampling_params=SamplingParams(temperature=0, max_tokens=6,
                                                            ignore_eos=True))
    assert got[0] != list(base_only[0].outputs[0].token_ids)


@pytest.mark.parametrize("argv, match", [
    (("--lora", "nodir"), "expected NAME=DIR"),
    (("--lora", "a=/nonexistent"), "lora_path='/nonexistent' is not a directory"),
    (("--max-loras", "2"), "--max-loras=2 needs enable_lora=True"),
    (("--enable-lora", "--max-lora-rank", "7"), "max_lora_rank=7 is invalid"),
])
def test_generate_flag_errors(lora_paths, capsys, argv, match):
    base, _ = lora_paths("llama_all")
    code, _, err = _run(capsys, "generate", "--model", base, "--enforce-eager",
                        "--max-model-len", "64", "--prompt-token-ids", "1,2", *argv)
    assert code != 0 and match in err


def test_bench_generation_serves_the_adapters(lora_paths, capsys, monkeypatch):
    base, a_dir = lora_paths("llama_all")
    _, b_dir = lora_paths("llama_up_v")
    steps: list[list[int]] = []
    real = LoRAManager.activate

    def activate(self, lora_ids):
        steps.append(list(lora_ids))
        return real(self, lora_ids)

    monkeypatch.setattr(LoRAManager, "activate", activate)
    code, out, err = _run(capsys, "bench", "--generation", "--model", base, "--dtype", "float32",
                          "--contenders", "eager", "--batch-sizes", "4", "--prompt-len", "8",
                          "--new-tokens", "3", "--repeats", "1", "--no-progress",
                          "--lora", f"a={a_dir}", "--lora", f"b={b_dir}")
    assert code == 0, err
    assert any(sorted(set(s)) == [1, 2] and len(s) == 4 for s in steps)
    code, _, err = _run(capsys, "bench", "--generation", "--model", base, "--contenders",
                        "transformers", "--lora", f"a={a_dir}")
    assert code != 0 and "cannot run with --lora" in err
