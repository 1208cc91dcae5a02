"""The workers' side of signed calls (pdserve/signing.py) as ASGI glue: read the body,
check the call, answer 401 or pass the call on with the proof added to the reply.

Used by :class:`~pdserve.worker.http.SecretCheck` (every route through FastAPI) and by
the direct lane (worker/direct.py): one check, one replay cache per worker process.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve import keys, signing
from pdserve.worker.own_address import OwnAddress

MAX_BODY_BYTES = 64 << 20  # read before the tag's check (the header is checked first)
BODY_TIMEOUT_S = 30.0  # a body trickled slower than this is a 408


class BodyTooLarge(Exception):
    pass


async def read_body(receive: Any) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands the app the body already read, then the real channel's
    messages (a disconnect)."""
    sent = False

    async def again() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def with_proof(send: Any, value: bytes) -> Any:
    async def proved(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {
                **message,
                "headers": [*message.get("headers", []), (signing.PROOF_KEY, value)],
            }
        await send(message)

    return proved


class CallCheck:
    """Checks one ASGI call: ``await check(scope, receive, send)`` returns the receive
    to serve it with and the proof header's value for the reply (None: unsigned, on an
    open route), or None after answering 401 / 413 itself. With ``required``
    false (the open routes: probes, metrics) an unsigned call is served too, and a signed
    one still gets its proof: the router's first contact, its health check, proves the
    worker."""

    def __init__(self, ring: keys.KeyRing, refuse: Any) -> None:
        self.verifier = signing.Verifier(ring)
        self.own = OwnAddress()
        self.refuse = refuse  # (status, message) -> an ASGI response
        self.body_timeout_s = BODY_TIMEOUT_S

    async def __call__(
        self, scope: Any, receive: Any, send: Any, required: bool = True
    ) -> tuple[Any, bytes | None] | None:
        auth, host = None, ""
        for name, value in scope["headers"]:
            if name == signing.HEADER_KEY:
                auth = value.decode("latin-1")
            elif name == b"host":
                host = value.decode("latin-1")
        if required and self.verifier.ring:  # the header alone, before the body is read
            why = self.verifier.precheck(auth)
            if not why and not await self.own.names_me(host, scope.get("server")):
                why = f"the call names another worker (Host {host!r})"
            if why:
                await self.refuse(401, why)(scope, receive, send)
                return None
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await read_body(receive)
        except BodyTooLarge:
            await self.refuse(413, f"body over {MAX_BODY_BYTES} bytes")(scope, receive, send)
            return None
        except TimeoutError:
            await self.refuse(408, f"body not received within {self.body_timeout_s:g} s")(
                scope, receive, send
            )
            return None
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        if auth is None and not required:
            return replay(body, receive), None
        verdict = self.verifier.check(
            scope["method"], target.decode("latin-1"), auth, body, host=host
        )
        if verdict.key is None and not required:
            return replay(body, receive), None
        if verdict.key is None:
            await self.refuse(401, verdict.reason)(scope, receive, send)
            return None
        proof = signing.proof(verdict.key, auth or "").encode() if verdict.key else None
        return replay(body, receive), proof
