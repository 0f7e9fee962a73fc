"""The CLI as a script meets it: completions in prompt order with their prompt index, one line
per completion (text as a JSON string), every SamplingParams option, strict number parsing
naming the flag, ``config`` showing every setting and the mode that really runs, quiet
``--enforce-eager`` and a ``--help`` that does not import torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from forwardkit import cli

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
ENGINE = ("--enforce-eager", "--max-model-len", "64")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = str(tmp_path_factory.mktemp("ckpt_tok"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_mixed_prompts_print_in_the_order_given_with_their_index(capsys, ckpt):
    code, out, err = _run(capsys, "generate", "--model", ckpt, *ENGINE, "--prompt-token-ids", "5,6",
                          "--prompt", "hello world", "--prompt-token-ids", "7", "--output", "json",
                          "--max-tokens", "3", "--ignore-eos")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert [r["prompt_token_ids"] for r in records] == [[5, 6], [3, 4], [7]]
    assert records[1]["prompt"] == "hello world" and records[0]["prompt"] is None


def test_n_completions_per_prompt_each_on_its_line(capsys, ckpt):
    code, out, err = _run(capsys, "generate", "--model", ckpt, *ENGINE, "--prompt", "the cat",
                          "--prompt", "a dog", "-n", "2", "--temperature", "1", "--seed", "4",
                          "--output", "json", "--max-tokens", "4", "--ignore-eos")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["index"], r["completion"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    code, text, _ = _run(capsys, "generate", "--model", ckpt, *ENGINE, "--prompt", "the cat",
                         "--prompt", "a dog", "--n", "2", "--temperature", "1", "--seed", "4",
                         "--max-tokens", "4", "--ignore-eos")
    assert code == 0
    # text output: one JSON string per completion (a newline inside a text stays on its line)
    assert [json.loads(line) for line in text.splitlines()] == [r["text"] for r in records]


def test_sampling_options_reach_the_engine(capsys, ckpt):
    code, out, err = _run(capsys, "generate", "--model", ckpt, *ENGINE, "--prompt-token-ids", "5,6",
                          "--max-tokens", "6", "--min-tokens", "2", "--logprobs", "2",
                          "--prompt-logprobs", "1", "--presence-penalty", "0.5",
                          "--frequency-penalty", "0.2", "--repetition-penalty", "1.3",
                          "--min-p", "0.05", "--top-k", "5", "--top-p", "0.9", "--output", "json")
    assert code == 0, err
    record = json.loads(out)
    assert len(record["logprobs"]) == len(record["token_ids"]) >= 2
    assert all(2 <= len(d) <= 3 for d in record["logprobs"])
    assert record["prompt_logprobs"][0] is None and len(record["prompt_logprobs"]) == 2
    free = json.loads(_run(capsys, "generate", "--model", ckpt, *ENGINE, "--prompt-token-ids",
                           "5,6", "--max-tokens", "6", "--ignore-eos", "--output", "json")[1])
    stop_at = free["token_ids"][2]
    code, out, _ = _run(capsys, "generate", "--model", ckpt, *ENGINE, "--prompt-token-ids", "5,6",
                        "--max-tokens", "6", "--ignore-eos", "--output", "json",
                        "--stop-token-ids", f"{stop_at},0")
    record = json.loads(out)
    cut = free["token_ids"].index(stop_at) + 1
    assert record["token_ids"] == free["token_ids"][:cut] and record["finish_reason"] == "stop"
    sampled = ("--model", ckpt, *ENGINE, "--prompt-token-ids", "5,6", "--max-tokens", "8",
               "--ignore-eos", "--output", "json", "--temperature", "1", "--seed", "3",
               "--no-skip-special-tokens")
    free = json.loads(_run(capsys, "generate", *sampled)[1])
    word = free["text"].split()[-1]
    code, out, _ = _run(capsys, "generate", *sampled, "--stop", word)
    record = json.loads(out)
    assert record["stop_reason"] == word
    assert record["text"] == free["text"][: free["text"].find(word)]


def test_help_lists_sampling_options_and_current_tp_help(capsys):
    code, out, _ = _run(capsys, "generate", "--help")
    for flag in ("--n", "--temperature", "--top-p", "--top-k", "--min-p", "--seed", "--logprobs",
                 "--prompt-logprobs", "--stop", "--stop-token-ids", "--presence-penalty",
                 "--frequency-penalty", "--repetition-penalty", "--ignore-eos", "--min-tokens",
                 "--include-stop-str-in-output", "--skip-special-tokens"):
        assert flag in out
    flat = " ".join(out.split())
    assert "sequence-parallel sizes" not in flat and "weights split over N processes" in flat


def test_output_text_without_tokenizer_refuses(capsys):
    code, out, err = _run(capsys, "generate", *ENGINE, "--prompt-token-ids", "1,2", "--output", "text")
    assert code == 2 and out == ""
    assert "--output text needs a tokenizer" in err


def test_quantizing_the_built_in_model_says_what_to_pass(capsys, tmp_path):
    """The built-in model's MLP is not whole 32-weight blocks: the refusal names the tensor and,
    with no model given, what to pass instead; a checkpoint that has the same refusal gets no
    such hint (it was the model asked for)."""
    code, out, err = _run(capsys, "generate", *ENGINE, "--prompt-token-ids", "1,2",
                          "--quantization", "q8_0")
    assert code == 2 and out == ""
    assert "down_proj.weight" in err and "this is the built-in model" in err
    assert "--model DIR" in err and "--model-shape" not in err  # generate has no --model-shape
    odd = str(tmp_path)
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1)).save_pretrained(odd)
    code, _, err = _run(capsys, "generate", "--model", odd, *ENGINE, "--prompt-token-ids", "1,2",
                        "--quantization", "q8_0")
    assert code == 2 and "down_proj.weight" in err and "built-in" not in err


@pytest.mark.parametrize("shape", [(), ("--model-shape", "default-moe")])
def test_bench_quantizing_the_built_in_model_names_a_shape_to_pass(capsys, shape):
    """bench builds the default shape, or the one given: the hint names it (the MoE shape's
    experts are refused, 344 wide) and a shape that quantizes."""
    code, _, err = _run(capsys, "bench", *shape, "--quantization", "q4_0", "--quick")
    what = f"model shape {shape[1]!r}" if shape else "the built-in model"
    assert code == 2 and f"this is {what}" in err
    assert "--model-shape llama-3.2-1b" in err


@pytest.mark.parametrize(("argv", "flag"), [
    (("generate", "--prompt-token-ids", "1,,3"), "--prompt-token-ids"),
    (("generate", "--prompt-token-ids", "1,3,"), "--prompt-token-ids"),
    (("generate", "--prompt-token-ids", "1_000"), "--prompt-token-ids"),
    (("generate", "--prompt-token-ids", "1", "--max-tokens", "1_0"), "--max-tokens"),
    (("generate", "--prompt-token-ids", "1", "--max-num-seqs", "1_000"), "--max-num-seqs"),
    (("generate", "--prompt-token-ids", "1", "--top-p", "nan"), "--top-p"),
    (("bench", "--generation", "--batch-sizes", "1,,2"), "--batch-sizes"),
    (("bench", "--generation", "--batch-sizes", "1,2,"), "--batch-sizes"),
    (("bench", "--steps", "1_0"), "--steps"),
])
def test_loose_numbers_are_refused_naming_the_flag(capsys, argv, flag):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and f"argument {flag}" in err


def test_config_shows_every_setting_and_the_mode_that_runs(capsys):
    code, out, err = _run(capsys, "config", "-cc", '{"mode": 3}', "--enforce-eager", "--dtype",
                          "float16", "--max-model-len", "100", "--block-size", "32", "-tp", "2",
                          "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["mode"] == "NONE"  # what runs: --enforce-eager overrides the asked-for mode 3
    assert (info["dtype"], info["max_model_len"], info["block_size"],
            info["tensor_parallel_size"]) == ("float16", 100, 32, 2)
    code, out, _ = _run(capsys, "config", "-cc", '{"mode": 3}', "--enforce-eager")
    assert "mode                NONE (0)" in out


def test_config_shows_prefix_caching_quantization_and_speculation(capsys):
    code, out, err = _run(capsys, "config", "--no-enable-prefix-caching", "--prefix-caching-hash-algo",
                          "sha256_cbor", "--quantization", "q4_0", "--speculative-config",
                          '{"num_speculative_tokens": 3, "prompt_lookup_max": 2}', "--json")
    assert code == 0, err
    info = json.loads(out)
    assert (info["enable_prefix_caching"], info["prefix_caching_hash_algo"]) == (False, "sha256_cbor")
    assert info["quantization"] == "q4_0"
    assert info["speculative_config"]["num_speculative_tokens"] == 3
    assert info["speculative_config"]["prompt_lookup_min"] == 2
    code, out, _ = _run(capsys, "config")
    assert "prefix caching      on (hash sha256)" in out and "speculative         off" in out


def test_prefix_hash_flag_choices_match_the_config():
    from forwardkit.commands.engine_flags import PREFIX_HASH_ALGOS
    from forwardkit.config.cache import HASH_ALGOS

    assert PREFIX_HASH_ALGOS == HASH_ALGOS


def test_mode_as_a_string_number_is_accepted(capsys):
    code, out, err = _run(capsys, "config", "-cc", '{"mode": "2"}', "--json")
    assert code == 0, err
    assert json.loads(out)["mode"] == "DYNAMO_TRACE_ONCE"


def test_config_json_with_model_type_only(capsys, ckpt, tmp_path):
    import shutil

    path = tmp_path / "typed"
    shutil.copytree(ckpt, path)
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]
    (path / "config.json").write_text(json.dumps(config))
    code, out, err = _run(capsys, "generate", "--model", str(path), *ENGINE, "--prompt-token-ids",
                          "5,6", "--max-tokens", "2", "--output", "ids")
    assert code == 0, err
    assert len(out.strip().split(",")) == 2


def test_enforce_eager_logs_no_warning():
    proc = subprocess.run([sys.executable, "-m", "forwardkit.cli", "generate", *ENGINE,
                           "--prompt-token-ids", "1,2", "--max-tokens", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "WARNING" not in proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["generate", "--help"],
                                  ["bench", "--help"], ["config", "--help"]])
def test_help_and_version_do_not_import_torch(argv):
    code = ("import sys\nfrom forwardkit import cli\n"
            f"try:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()


def test_flag_copies_match_the_config_layer():
    from forwardkit.commands.bench import MODEL_SHAPE_NAMES
    from forwardkit.commands.engine_flags import (
        ALL2ALL_BACKENDS,
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        DEFAULT_MAX_NUM_SEQS,
    )
    from forwardkit.config import model_shapes, parallel, scheduler

    assert ALL2ALL_BACKENDS == parallel.ALL2ALL_BACKENDS
    assert (DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_NUM_BATCHED_TOKENS) == (
        scheduler.DEFAULT_MAX_NUM_SEQS, scheduler.DEFAULT_MAX_NUM_BATCHED_TOKENS)
    assert list(MODEL_SHAPE_NAMES) == list(model_shapes.model_shape_names())
