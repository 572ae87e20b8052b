"""A chat conversation to prompt token ids: the one place that renders chat turns.

The device agent owns the tokenizer, so it renders: the token streamer forwards the
OpenAI messages as they came and never needs the model. A tokenizer with a chat
template (SmolLM2's ChatML) renders through it, generation prompt included, exactly
as `tokenizer.apply_chat_template(messages, add_generation_prompt=True)`; one
without a template (the demo model) gets plain 'role: content' lines ending in
'assistant:'. The model's end-of-turn token is its eos (SmolLM2: `<|im_end|>`),
which stops the generation and is never shown as text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# OpenAI's newer name for the system role; templates know only "system".
_ROLE_ALIASES = {"developer": "system"}


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (malformed turns, or the template refused it)."""


def normalize_turns(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """{"role", "content"} string pairs; ChatTemplateError for anything else."""
    if not messages:
        raise ChatTemplateError("a chat needs at least one message")
    turns = []
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise ChatTemplateError("each message needs a string role and string content")
        turns.append({"role": _ROLE_ALIASES.get(role, role), "content": content})
    return turns


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def plain_chat_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """For a tokenizer without a template: 'role: content' lines, then 'assistant:'."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in normalize_turns(messages)) + "assistant:"


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The prompt ids of a conversation, ready for the assistant's next turn."""
    turns = normalize_turns(messages)
    if not has_chat_template(tokenizer):
        return list(tokenizer.encode(plain_chat_text(turns), add_special_tokens=False))
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
    except TemplateError as exc:  # e.g. a template that raises on roles out of order
        raise ChatTemplateError(f"the model's chat template refused the conversation: {exc}") from exc
    return [int(t) for t in ids]
