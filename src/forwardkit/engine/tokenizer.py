"""Tokenizer loading: a checkpoint's own tokenizer through ``transformers``, if it ships one."""

from __future__ import annotations

import os
from typing import Any

from forwardkit.config.gguf import is_gguf_path, open_gguf
from forwardkit.logger import init_logger

__all__ = ["load_tokenizer", "has_tokenizer_files", "TOKENIZER_FILES"]

logger = init_logger(__name__)

# Any of these in a checkpoint directory means it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(model_dir: str | None) -> bool:
    """Whether ``model_dir`` holds tokenizer files."""
    if not model_dir or not os.path.isdir(model_dir):
        return False
    return any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES)


def _gguf_tokenizer(path: str) -> Any | None:
    """The tokenizer ``transformers`` builds from a GGUF file's own vocabulary, or None (with a
    warning saying why) when the file has none or ``transformers`` cannot build it."""
    if open_gguf(path).metadata.get("tokenizer.ggml.model") in (None, "no_vocab"):
        return None  # the file carries no vocabulary
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                             gguf_file=os.path.basename(path),
                                             local_files_only=True)
    except Exception as exc:  # ImportError, an unsupported vocabulary type, ...
        logger.warning("GGUF file %s: transformers cannot build its tokenizer (%s: %s); text "
                       "prompts need tokenizer=DIR", path, type(exc).__name__, exc)
        return None


def load_tokenizer(model_dir: str | None) -> Any | None:
    """``AutoTokenizer.from_pretrained(model_dir)`` (local files only), or None if none ships.
    For a GGUF file, the tokenizer of its own vocabulary when ``transformers`` can build it.

    Raises ``RuntimeError`` naming the directory if tokenizer files exist but cannot be loaded
    (for example when ``transformers`` is missing).
    """
    if is_gguf_path(model_dir):
        assert model_dir is not None
        return _gguf_tokenizer(model_dir)
    if not has_tokenizer_files(model_dir):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a dev dependency
        raise RuntimeError(
            f"{model_dir} ships a tokenizer but 'transformers' is not installed; "
            "pip install 'forwardkit[hf]'"
        ) from exc
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:
        raise RuntimeError(f"could not load the tokenizer in {model_dir}: {exc}") from exc
