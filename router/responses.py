"""OpenAI response bodies and SSE chunks for completions and chat completions."""

from __future__ import annotations

import json
import time
from typing import Any


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _choice(
    chat: bool, text: str, finish: str | None, stream: bool, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    key = "delta" if stream else "message"
    content: dict[str, Any] = (
        {"content": text} if stream else {"role": "assistant", "content": text}
    )
    return {"index": 0, key: content, "logprobs": logprobs, "finish_reason": finish}


def _object(chat: bool, stream: bool) -> str:
    if chat:
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


def full_response(
    rid: str,
    model: str,
    chat: bool,
    text: str,
    finish: str | None,
    use: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": _object(chat, False),
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(chat, text, finish, False, logprobs)],
        "usage": use,
    }


def chunk(
    rid: str,
    model: str,
    chat: bool,
    text: str | None = None,
    finish: str | None = None,
    use: dict[str, Any] | None = None,
    role: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> str:
    body: dict[str, Any] = {
        "id": rid,
        "object": _object(chat, True),
        "created": int(time.time()),
        "model": model,
        "choices": [],
    }
    if role:
        body["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}]  # fmt: skip
    elif text is not None:
        body["choices"] = [_choice(chat, text, finish, True, logprobs)]
    if use is not None:
        body["usage"] = use
    return sse(body)


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
