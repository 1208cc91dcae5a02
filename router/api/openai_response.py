"""OpenAI response bodies and SSE chunks for completions and chat completions."""

from __future__ import annotations

import json
import time
from json.encoder import encode_basestring_ascii
from typing import Any

_ENCODER = json.JSONEncoder(separators=(",", ":"))  # what json.dumps(..., separators) builds


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _choice(
    chat: bool,
    text: str,
    finish: str | None,
    stream: bool,
    logprobs: dict[str, Any] | None,
    index: int = 0,
) -> dict[str, Any]:
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    key = "delta" if stream else "message"
    content: dict[str, Any] = (
        {"content": text} if stream else {"role": "assistant", "content": text}
    )
    return {"index": index, key: content, "logprobs": logprobs, "finish_reason": finish}


def choice(
    index: int,
    chat: bool,
    text: str,
    finish: str | None,
    logprobs: dict[str, Any] | None = None,
    message: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One choice of a whole response; ``message`` replaces the chat message (tool calls)."""
    out = _choice(chat, text, finish, False, logprobs, index)
    if message is not None:
        out["message"] = message
    return out


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
    message: dict[str, Any] | None = None,
    choices: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``message`` replaces the chat message built from ``text`` (tool calls); ``choices``
    replaces the one choice (n > 1)."""
    if choices is None:
        choices = [choice(0, chat, text, finish, logprobs, message)]
    return {
        "id": rid,
        "object": _object(chat, False),
        "created": int(time.time()),
        "model": model,
        "choices": choices,
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
    index: int = 0,
) -> str:
    body: dict[str, Any] = {
        "id": rid,
        "object": _object(chat, True),
        "created": int(time.time()),
        "model": model,
        "choices": [],
    }
    if role:
        body["choices"] = [
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
    elif text is not None:
        body["choices"] = [_choice(chat, text, finish, True, logprobs, index)]
    if use is not None:
        body["usage"] = use
    return sse(body)


def delta_chunk(
    rid: str, model: str, delta: dict[str, Any], finish: str | None = None, index: int = 0
) -> str:
    """A chat chunk with a given ``delta`` (tool-call deltas, or {} with the finish)."""
    body = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return sse(body)


def sse(body: dict[str, Any]) -> str:
    return f"data: {_ENCODER.encode(body)}\n\n"


class TextChunks:
    """``chunk(rid, model, chat, text, finish, logprobs=..., index=...)`` for one stream,
    byte for byte, with the parts that never change in a stream written once: per token
    only the text, the finish reason and the logprobs are encoded (and the clock read,
    as ``chunk`` does)."""

    def __init__(self, rid: str, model: str, chat: bool, index: int = 0) -> None:
        obj = _object(chat, True)
        self._head = f'data: {{"id":{_ENCODER.encode(rid)},"object":"{obj}","created":'
        key = '"delta":{"content":' if chat else '"text":'
        self._mid = f',"model":{_ENCODER.encode(model)},"choices":[{{"index":{index},{key}'
        self._lps = '},"logprobs":' if chat else ',"logprobs":'

    def __call__(
        self, text: str, finish: str | None, logprobs: dict[str, Any] | None = None
    ) -> str:
        lps = "null" if logprobs is None else _ENCODER.encode(logprobs)
        fin = "null" if finish is None else encode_basestring_ascii(finish)
        return (
            f"{self._head}{int(time.time())}{self._mid}{encode_basestring_ascii(text)}"
            f'{self._lps}{lps},"finish_reason":{fin}}}]}}\n\n'
        )


DONE = "data: [DONE]\n\n"
