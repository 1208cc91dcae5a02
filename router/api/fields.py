"""Every request field the API knows, and what the server does with it.

A field not listed here is refused with 400 naming it: silently ignoring an option
would hand the client output it did not ask for. docs/router.md has the same table
(tests/router/test_fields.py keeps the two in step).
"""

from __future__ import annotations

from typing import Any

from pdserve.router.errors import invalid

# Honoured by both endpoints.
COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "logprobs",
        "n",
        "stream",
        "stream_options",
        "user",
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "structured_outputs",
        "return_tokens_as_token_ids",
        "cache_salt",
    }
)
CHAT = COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
}
COMPLETIONS = COMMON | {"prompt", "best_of", "echo", "suffix", "prompt_logprobs"}
# Accepted, with no effect on the output (bookkeeping fields of OpenAI's platform).
NO_EFFECT = frozenset({"metadata", "service_tier", "prompt_cache_key", "safety_identifier"})
# Accepted only at these values.
ONLY: dict[str, tuple[Any, ...]] = {
    "store": (None, False),
    "modalities": (None, ["text"]),
}


def check_fields(body: dict[str, Any], chat: bool) -> None:
    known = CHAT if chat else COMPLETIONS
    if body.keys() <= known:  # the common case: one set operation in C
        return
    for name, value in body.items():
        if name in known or name in NO_EFFECT:
            continue
        if name in ONLY:
            if value not in ONLY[name]:
                raise invalid(f"{name}={value!r} is not supported by this server", name)
            continue
        where = "" if name not in CHAT | COMPLETIONS else " on this endpoint"
        raise invalid(f"{name} is not supported{where} by this server", name)
