"""Checking ``LLM.generate``'s inputs and turning them into requests, before any state changes.

``parse_prompts`` accepts the prompt forms vLLM's ``LLM.generate`` does (text, token-id lists,
``{"prompt_token_ids": ...}`` / ``{"prompt": ...}`` dicts) and raises ``ValueError`` naming the
argument, the bad value and what is accepted. ``build_requests`` makes one ``Request`` per
completion (``n`` per prompt; completion ``i`` of a seeded prompt samples with ``seed + i``)
without touching the engine's id counter or seeded random generator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol, TypeAlias

from forwardkit.engine.request import Request
from forwardkit.engine.sampling_params import SamplingParams

__all__ = ["ParsedPrompt", "PromptsArg", "TokenIdsArg", "Tokenizer", "build_requests",
           "parse_prompts"]

# What ``LLM.generate`` documents; ``parse_prompts`` checks every value at run time anyway.
PromptItem: TypeAlias = str | Mapping[str, object] | Sequence[int]
PromptsArg: TypeAlias = str | Mapping[str, object] | Sequence[PromptItem] | None
TokenIdsArg: TypeAlias = Sequence[int] | Sequence[Sequence[int]] | None


class Tokenizer(Protocol):
    """What the engine uses of a Hugging Face tokenizer."""

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

class ParsedPrompt(NamedTuple):
    """One checked prompt: its text (None when token ids were given), its token ids and its
    ``cache_salt`` (None: none given)."""

    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None


_ACCEPTED_PROMPTS = ("expected a string, a list of strings, a dict with 'prompt_token_ids' or "
                     "'prompt', or a list of such dicts (token ids go in prompt_token_ids=[[...]])")
_ACCEPTED_ITEM = ("expected text, a list of token ids, or a dict with 'prompt_token_ids' "
                  "(token ids go in prompt_token_ids=[[...]])")
_ACCEPTED_IDS = "expected a list of integer token ids or a list of such lists"


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_prompts(
    prompts: object, prompt_token_ids: object, tokenizer: Tokenizer | None, vocab_size: int,
    model_name: str | None = None,
) -> list[ParsedPrompt]:
    """One :class:`ParsedPrompt` per prompt; raises ``ValueError`` on any malformed input.

    A dict prompt may carry ``"cache_salt"``: a non-empty string that keeps its KV blocks apart
    from every prompt with another (or no) salt in the prefix cache."""
    if prompts is not None and prompt_token_ids is not None:
        raise ValueError("pass either prompts or prompt_token_ids, not both")
    items: list[object]
    if prompt_token_ids is not None:
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids={_short(prompt_token_ids)} is invalid; {_ACCEPTED_IDS}")
        ids = list(prompt_token_ids)
        if ids and not isinstance(ids[0], (list, tuple)):
            items = [ids]
        else:
            for i, one in enumerate(ids):
                if not isinstance(one, (list, tuple)):
                    raise ValueError(
                        f"prompt_token_ids[{i}]={_short(one)} is invalid; {_ACCEPTED_IDS}"
                    )
            items = ids
    elif prompts is None:
        raise ValueError("generate() needs prompts (text or {'prompt_token_ids': [...]}) "
                         "or prompt_token_ids")
    elif isinstance(prompts, (str, dict)):
        items = [prompts]
    elif isinstance(prompts, (list, tuple)):
        items = list(prompts)
    else:
        raise ValueError(f"prompts={_short(prompts)} is invalid; {_ACCEPTED_PROMPTS}")
    return [_one_prompt(i, item, tokenizer, vocab_size, model_name) for i, item in enumerate(items)]


def _cache_salt(index: int, item: Mapping[str, object]) -> str | None:
    salt = item.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"prompt {index}: cache_salt={_short(salt)} is invalid; expected a "
                         "non-empty string or no cache_salt")
    return salt


def _one_prompt(index: int, item: object, tokenizer: Tokenizer | None, vocab: int,
                model_name: str | None) -> ParsedPrompt:
    if isinstance(item, dict):
        salt = _cache_salt(index, item)
        if "prompt_token_ids" in item:
            return ParsedPrompt(item.get("prompt"), _check_ids(index, item["prompt_token_ids"], vocab),
                                salt)
        if "prompt" not in item:
            raise ValueError(f"prompt {index}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        text = item["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"prompt {index}: 'prompt'={_short(text)} is invalid; expected text "
                             "(token ids go in 'prompt_token_ids')")
        return ParsedPrompt(text, _encode(index, text, tokenizer, model_name), salt)
    if not isinstance(item, (str, list, tuple)):
        raise ValueError(f"prompt {index} is {type(item).__name__} {_short(item)}; {_ACCEPTED_ITEM}")
    if isinstance(item, str):
        return ParsedPrompt(item, _encode(index, item, tokenizer, model_name))
    return ParsedPrompt(None, _check_ids(index, item, vocab))


def _encode(index: int, text: str, tokenizer: Tokenizer | None, model_name: str | None) -> list[int]:
    if tokenizer is None:
        raise ValueError(
            f"prompt {index} is text but the model ships no tokenizer "
            f"(model={model_name!r}); pass prompt_token_ids, or LLM(tokenizer=DIR)"
        )
    return list(tokenizer.encode(text))


def _check_ids(index: int, ids: object, vocab: int) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"prompt {index}: prompt_token_ids={_short(ids)} is invalid; "
                         "expected a list of integer token ids")
    ids = list(ids)
    for t in ids:
        if not _is_id(t) or not 0 <= t < vocab:
            raise ValueError(f"prompt {index}: token id {_short(t)} is not an integer in [0, {vocab})")
    return ids


def build_requests(
    prompts: Sequence[ParsedPrompt],
    params: Sequence[SamplingParams],
    first_id: int,
    eos_token_id: int | Iterable[int] | None,
    max_model_len: int,
    decode: Callable[[SamplingParams], Callable[[list[int]], str] | None],
) -> list[tuple[str, list[Request]]]:
    """``(request id, completions)`` per prompt, without random generators (assigned later).

    A prompt with ``n > 1`` gets children ``"{i}_{id}"`` with ``n=1`` and, when the prompt is
    seeded, ``seed + i`` (vLLM's parallel sampling); only child 0 computes prompt logprobs.
    """
    groups = []
    for offset, ((text, ids, salt), p) in enumerate(zip(prompts, params)):
        rid = str(first_id + offset)
        if p.n == 1:
            children = [(rid, p)]
        else:
            children = [(f"{i}_{rid}", p.clone(n=1, seed=None if p.seed is None else p.seed + i))
                        for i in range(p.n)]
        reqs = []
        for i, (child_id, cp) in enumerate(children):
            req = Request(child_id, ids, cp, prompt=text, eos_token_id=eos_token_id,
                          max_model_len=max_model_len, index=i, decode=decode(cp),
                          cache_salt=salt)
            if i > 0:
                req.drop_prompt_logprobs()  # the siblings share the prompt: computed once
            reqs.append(req)
        groups.append((rid, reqs))
    return groups
