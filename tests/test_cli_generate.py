"""``forwardkit generate`` through ``cli.main``: built-in model, a saved checkpoint with a
tokenizer, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from forwardkit import cli

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tmp_path_factory) -> str:
    """A tiny random Llama saved with save_pretrained plus a word-level fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = str(tmp_path_factory.mktemp("ckpt_tok"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(["generate", *argv])
    except SystemExit as exc:  # argparse rejects bad flag values itself (exit 2)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_builtin_model_prints_ids(capsys):
    code, out, _ = _run(capsys, "--prompt-token-ids", "1,2,3", "--prompt-token-ids", "5, 6",
                        "--max-tokens", "4", "--ignore-eos", "--max-model-len", "64",
                        "--max-num-seqs", "2", "--enforce-eager")
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        ids = [int(t) for t in line.split(",")]
        assert len(ids) == 4 and all(0 <= t < 4096 for t in ids)


def test_builtin_model_is_deterministic_json(capsys):
    argv = ("--prompt-token-ids", "7,8,9", "--max-tokens", "3", "--temperature", "0.9",
            "--top-k", "50", "--top-p", "0.9", "--seed", "3", "--output", "json",
            "--max-model-len", "64", "--enforce-eager")
    code, first, _ = _run(capsys, *argv)
    assert code == 0
    record = json.loads(first)
    assert record["prompt_token_ids"] == [7, 8, 9] and len(record["token_ids"]) <= 3
    assert record["finish_reason"] in ("length", "stop")
    assert _run(capsys, *argv)[1] == first  # same seed, same tokens


def test_checkpoint_with_tokenizer_prints_text(capsys, checkpoint_with_tokenizer):
    code, out, err = _run(capsys, "--model", checkpoint_with_tokenizer, "--prompt", "the cat sat",
                          "--max-tokens", "5", "--ignore-eos", "--enforce-eager")
    assert code == 0, err
    words = json.loads(out.strip()).split()  # the text as a JSON string: one line
    assert 1 <= len(words) <= 5 and set(words) <= set(WORDS) | {"<unk>", "<s>"}
    code, out, err = _run(capsys, "--model", checkpoint_with_tokenizer, "--prompt", "hello world",
                          "--max-tokens", "5", "--ignore-eos", "--output", "json", "--enforce-eager")
    record = json.loads(out)
    assert code == 0 and record["prompt"] == "hello world"
    assert record["prompt_token_ids"] == [3, 4] and len(record["token_ids"]) == 5


def test_bad_model_dir_is_one_line_error(capsys, tmp_path):
    code, out, err = _run(capsys, "--model", str(tmp_path / "nope"), "--prompt-token-ids", "1")
    assert code != 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "nope" in lines[0] and lines[0].startswith("forwardkit generate: error:")


def test_text_prompt_without_tokenizer_is_an_error(capsys):
    code, _, err = _run(capsys, "--prompt", "hi", "--max-model-len", "64", "--enforce-eager")
    assert code != 0 and "tokenizer" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, match", [
    ((), "no prompts"),
    (("--prompt-token-ids", "1,x"), "comma-separated integer token ids"),
    (("--prompt-token-ids", "1", "--top-p", "0"), "top_p"),
    (("--prompt-token-ids", "1", "--temperature", "-1"), "expected a number >= 0"),
    (("--prompt-token-ids", "1", "-dp", "2"), "needs one process per rank"),
])
def test_bad_arguments(capsys, argv, match):
    code, _, err = _run(capsys, *argv)
    assert code != 0 and match in err


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--prompt ", "--prompt-token-ids", "--max-tokens", "--temperature", "--top-k",
                 "--top-p", "--seed", "--ignore-eos", "--model", "--max-num-seqs"):
        assert flag in out


def test_unsafe_cache_dir_shows_the_library_reason(capsys, tmp_path, monkeypatch):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv("FORWARDKIT_CACHE_ROOT", str(root))
    monkeypatch.delenv("FORWARDKIT_DISABLE_COMPILE_CACHE", raising=False)
    code, _, err = _run(capsys, "-O.mode=3", "--prompt-token-ids", "1,2", "--max-tokens", "1")
    assert code != 0
    assert "refusing to use compile cache directory" in err and "counting_backend" not in err
    assert len(err.strip().splitlines()) == 1
