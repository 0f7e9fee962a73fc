"""Chat conversations to prompt token ids, as vLLM's ``LLM.chat`` renders them.

Each conversation is a list of ``{"role": ..., "content": ...}`` messages (content a string or a
list of ``{"type": "text", "text": ...}`` parts, joined with newlines). It is rendered to text
with the tokenizer's chat template (or the ``chat_template`` given), then tokenized without
adding special tokens: the template writes them itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["ChatTokenizer", "render_chats"]


class ChatTokenizer(Protocol):
    """What chat rendering uses of a Hugging Face tokenizer."""

    chat_template: str | None

    def apply_chat_template(self, conversation: list[dict[str, str]], *, tokenize: bool,
                            chat_template: str | None, add_generation_prompt: bool,
                            continue_final_message: bool, **kwargs: object) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _content(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ValueError(f"{where}.content[{j}]={_short(part)} is invalid; only text parts "
                                 "{'type': 'text', 'text': ...} are supported (no multimodal models "
                                 "here)")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where}.content={_short(content)} is invalid; expected a string or a list "
                     "of text parts")


def _conversations(messages: object) -> list[list[dict[str, str]]]:
    """One conversation or a list of them, each message checked."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages={_short(messages)} is invalid; expected a conversation (a "
                         "non-empty list of {'role': ..., 'content': ...} dicts) or a list of them")
    batch = isinstance(messages[0], (list, tuple))
    convs = list(messages) if batch else [messages]
    out = []
    for i, conv in enumerate(convs):
        prefix = f"messages[{i}]" if batch else "messages"
        if not isinstance(conv, (list, tuple)) or not conv:
            raise ValueError(f"{prefix}={_short(conv)} is invalid; expected a non-empty list of "
                             "messages")
        rendered = []
        for j, msg in enumerate(conv):
            where = f"{prefix}[{j}]"
            if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
                raise ValueError(f"{where}={_short(msg)} is invalid; expected a dict with a string "
                                 "'role' and a 'content'")
            item = {k: v for k, v in msg.items() if k != "content"}
            item["content"] = _content(where, msg.get("content", ""))
            rendered.append(item)
        out.append(rendered)
    return out


def render_chats(tokenizer: ChatTokenizer, messages: object, chat_template: str | None,
                 add_generation_prompt: bool, continue_final_message: bool,
                 chat_template_kwargs: Mapping[str, object] | None) -> list[list[int]]:
    """Prompt token ids per conversation; ``ValueError`` naming what is wrong (a message, no
    template, both generation prompt and continuing the final message)."""
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError(f"chat_template={_short(chat_template)} is invalid; expected the "
                         "template's Jinja text or None")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=True needs add_generation_prompt=False (the "
                         "final message is continued, not answered)")
    if chat_template is None and not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template; pass chat_template=... (a Jinja "
                         "template, as in transformers)")
    extra = dict(chat_template_kwargs or {})
    prompts = []
    for conv in _conversations(messages):
        text = tokenizer.apply_chat_template(
            conv, tokenize=False, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **extra)
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return prompts

