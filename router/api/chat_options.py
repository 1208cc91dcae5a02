"""How a chat request asks its messages to be rendered: vLLM's chat-template fields.

- ``add_generation_prompt`` (default true): end the prompt with the assistant's header,
  so the model answers as the assistant;
- ``continue_final_message`` (default false): the last message is the assistant's,
  left open, and the model goes on writing it (prefilling the start of an answer);
  it cannot be combined with ``add_generation_prompt`` true;
- ``chat_template_kwargs``: further variables for the model's template (for example
  ``{"enable_thinking": false}``); the names ``apply_chat_template`` itself takes are
  refused, so a client cannot swap the template or the messages through them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.router.errors import invalid

# apply_chat_template's own parameters: never template variables.
RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True)
class ChatTemplateOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs


def parse_chat_options(
    body: dict[str, Any], messages: tuple[dict[str, Any], ...]
) -> ChatTemplateOptions:
    gen = flag(body, "add_generation_prompt", True)
    cont = flag(body, "continue_final_message", False)
    if gen and cont:
        raise invalid(
            "continue_final_message needs add_generation_prompt false (both cannot be true)",
            "continue_final_message",
        )
    if cont and (not messages or messages[-1]["role"] != "assistant"):
        raise invalid(
            "continue_final_message needs the last message to be the assistant's",
            "continue_final_message",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs must be an object", "chat_template_kwargs")
    taken = sorted(RESERVED & set(kwargs))
    if taken:
        raise invalid(
            f"chat_template_kwargs may not set {taken}: use the request's own fields",
            "chat_template_kwargs",
        )
    return ChatTemplateOptions(gen, cont, dict(kwargs))


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean field of a request body (absent or null: ``default``); else 400."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be a boolean", name)
    return value
