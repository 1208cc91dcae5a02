"""Limits at the router's edge, applied before anything costly happens.

* the body is read up to ``--max-body-bytes`` (413 without reading the rest);
* JSON nested deeper than ``MAX_JSON_DEPTH`` or holding invalid Unicode (a lone
  surrogate such as ``"\\ud800"``, which JSON lets through) is a 400 naming the
  top-level field it sits in;
* prompt text longer than ``--max-prompt-chars`` is a 400 before it is tokenized.

Parsing, these checks and tokenization run on the runtime's tokenizer threads
(``Runtime.prepare``), never on the event loop.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from pdserve.engine.sampling_params import valid_text
from pdserve.router.errors import APIError, invalid
from pdserve.router.protocol import GenerateRequest

MAX_JSON_DEPTH = 32  # OpenAI bodies need 5 (messages -> parts -> part); 32 is generous
# A lone surrogate can only come from a \uD800-\uDFFF escape: raw UTF-8 cannot encode one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes: a larger one is refused as soon as its
    Content-Length says so, or as soon as the bytes read pass the limit."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise invalid("Content-Length is not a number")
        if int(length) > limit:
            raise too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "the client closed the request", code="client_closed") from None
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """Decode and check a request body (CPU-bound: call it off the event loop)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise invalid(f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from exc
    check_tree(body, check_text=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def check_tree(body: Any, check_text: bool = True) -> None:
    """Depth at most ``MAX_JSON_DEPTH``; every string and key valid Unicode (when
    ``check_text``). A 400 names the top-level field the problem sits in."""
    if not isinstance(body, (dict, list)):
        return  # a bare scalar: parse_request refuses it, it is never read
    stack: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while stack:
        node, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise invalid(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", field)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            where = field if field is not None or not isinstance(key, str) else key
            if check_text and isinstance(key, str) and not valid_text(key):
                raise invalid("a key holds invalid Unicode (a lone surrogate)", where)
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1, where))
            elif check_text and isinstance(value, str) and not valid_text(value):
                raise invalid(f"{where or 'the body'} holds invalid Unicode (a lone surrogate)",
                              where)  # fmt: skip


def check_text_length(req: GenerateRequest, limit: int) -> None:
    """Bound the text handed to the tokenizer (its time grows with the text)."""
    if req.messages is not None:
        size, field = sum(len(m["content"]) for m in req.messages), "messages"
    else:
        size, field = len(req.prompt_text or ""), "prompt"
    if size > limit:
        raise invalid(f"{field} holds {size} characters; at most {limit} are accepted", field,
                      "context_length_exceeded")  # fmt: skip
