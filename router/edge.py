"""Limits at the router's edge, applied before anything costly happens.

* the body is read up to ``--max-body-bytes`` (413 without reading the rest), and
  within ``--body-timeout`` seconds (408), before the request takes an admission slot;
* JSON nested deeper than 32 levels or holding invalid Unicode (a lone
  surrogate such as ``"\\ud800"``, which JSON lets through) is a 400 naming the
  top-level field it sits in (``pdserve.jsonguard``, shared with the workers);
* prompt text longer than ``--max-prompt-chars`` is a 400 before it is tokenized (for a
  chat: contents, tool calls, tools and template variables together).

Parsing, these checks and tokenization run on the runtime's tokenizer threads
(``serving.prepare``), never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from starlette.requests import ClientDisconnect, Request

from pdserve.coalesce import BODY_COMPLETE
from pdserve.jsonguard import BadJSON, loads_checked
from pdserve.router.api.openai_request import CompletionRequest
from pdserve.router.errors import APIError, invalid


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")


async def read_body(request: Request, limit: int, timeout: float = 30.0) -> bytes:
    """The body, at most ``limit`` bytes, in at most ``timeout`` seconds: a larger one is
    refused as soon as its Content-Length says so or the bytes read pass the limit; one
    still arriving at the deadline is a 408 (a client trickling bytes holds nothing)."""
    first = None
    if request.scope.get(BODY_COMPLETE):  # all in already: one receive that cannot wait
        first, more = await _whole_body(request, limit)
        if not more:
            return first
    try:
        async with asyncio.timeout(timeout):
            return await _read_body(request, limit, first)
    except TimeoutError:
        raise body_timeout(timeout) from None


def body_timeout(seconds: float) -> APIError:
    """The 408 of a body still arriving after ``seconds`` (the compiled lane's too)."""
    return APIError(
        408,
        f"the request body did not arrive within {seconds:g} s (--body-timeout)",
        code="request_timeout",
    )


async def _whole_body(request: Request, limit: int) -> tuple[bytes, bool]:
    """The body the router's protocol holds whole (``BODY_COMPLETE``), and whether more
    follows (never, from uvicorn's cycle): no timer and no stream around one receive (~1%
    of the router's CPU per request)."""
    _check_length(request, limit)
    message = await request.receive()
    if message["type"] == "http.disconnect":
        raise APIError(499, "the client closed the request", code="client_closed")
    body: bytes = message.get("body", b"")
    if len(body) > limit:
        raise too_large(limit)
    return body, bool(message.get("more_body", False))


def _check_length(request: Request, limit: int) -> None:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise invalid("Content-Length is not a number")
        if int(length) > limit:
            raise too_large(limit)


async def _read_body(request: Request, limit: int, first: bytes | None = None) -> bytes:
    if first is None:
        _check_length(request, limit)
    chunks, size = [first] if first else [], len(first or b"")
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
        return loads_checked(raw)
    except BadJSON as exc:
        raise invalid(str(exc), exc.field) from exc


def check_text_length(req: CompletionRequest, limit: int) -> None:
    """Bound the text handed to the template and the tokenizer (their time grows with it)."""
    if req.messages is not None:
        tools = req.tools.tools if req.tools is not None else None
        kwargs = req.template.kwargs if req.template is not None else None
        size, field = chat_chars(req.messages, tools, kwargs), "messages"
    else:
        size, field = len(req.prompt_text or ""), "prompt"
    bound_text(size, field, limit)


def chat_chars(messages: Sequence[dict[str, Any]], tools: Any, kwargs: Any) -> int:
    """The characters a chat request hands its template: every message's content, and the
    JSON of everything else the template may paste (tool calls and their arguments, names,
    tool definitions, template variables), so none of them is a way around the limit."""
    size = 0
    for m in messages:
        size += len(m["content"])
        extra = {k: v for k, v in m.items() if k not in ("role", "content")}
        size += len(json.dumps(extra, ensure_ascii=False)) if extra else 0
    for more in (tools, kwargs):
        size += len(json.dumps(more, ensure_ascii=False)) if more else 0
    return size


def bound_text(size: int, field: str, limit: int) -> None:
    """A 400 naming ``field`` when its ``size`` characters pass ``limit``."""
    if size > limit:
        raise invalid(
            f"{field} holds {size} characters; at most {limit} are accepted",
            field,
            "context_length_exceeded",
        )
