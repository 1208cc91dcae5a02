"""Limits at the router's edge, applied before anything costly happens.

* the body is read up to ``--max-body-bytes`` (413 without reading the rest), and
  within ``--body-timeout`` seconds (408), before the request takes an admission slot;
* JSON nested deeper than 32 levels or holding invalid Unicode (a lone
  surrogate such as ``"\\ud800"``, which JSON lets through) is a 400 naming the
  top-level field it sits in (``pdserve.jsonguard``, shared with the workers);
* prompt text longer than ``--max-prompt-chars`` is a 400 before it is tokenized.

Parsing, these checks and tokenization run on the runtime's tokenizer threads
(``serving.prepare``), never on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import ClientDisconnect, Request

from pdserve.jsonguard import BadJSON, loads_checked
from pdserve.router.errors import APIError, invalid
from pdserve.router.protocol import GenerateRequest


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")


async def read_body(request: Request, limit: int, timeout: float = 30.0) -> bytes:
    """The body, at most ``limit`` bytes, in at most ``timeout`` seconds: a larger one is
    refused as soon as its Content-Length says so or the bytes read pass the limit; one
    still arriving at the deadline is a 408 (a client trickling bytes holds nothing)."""
    try:
        async with asyncio.timeout(timeout):
            return await _read_body(request, limit)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s "
                       "(--body-timeout)", code="request_timeout") from None  # fmt: skip


async def _read_body(request: Request, limit: int) -> bytes:
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
        return loads_checked(raw)
    except BadJSON as exc:
        raise invalid(str(exc), exc.field) from exc


def check_text_length(req: GenerateRequest, limit: int) -> None:
    """Bound the text handed to the tokenizer (its time grows with the text)."""
    if req.messages is not None:
        size, field = sum(len(m["content"]) for m in req.messages), "messages"
    else:
        size, field = len(req.prompt_text or ""), "prompt"
    bound_text(size, field, limit)


def bound_text(size: int, field: str, limit: int) -> None:
    """A 400 naming ``field`` when its ``size`` characters pass ``limit``."""
    if size > limit:
        raise invalid(f"{field} holds {size} characters; at most {limit} are accepted", field,
                      "context_length_exceeded")  # fmt: skip
