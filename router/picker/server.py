"""The endpoint picker's ext_proc service: one gRPC stream per HTTP request.

    proxy                                   picker
    request_headers ───────────────────────▶ kept (buffered mode: answered CONTINUE)
    request_body × n (end_of_stream last) ──▶ buffered; at the end: parse, pick
                    ◀─────────────────────── full duplex: headers response (destination
                                              header + envoy.lb metadata), then the body
                                              streamed back; buffered: the body response
                                              carries the mutation and the metadata
    response_headers ──────────────────────▶ the served endpoint noted; CONTINUE
    response_body × n ─────────────────────▶ passed through chunk by chunk
                                              (full duplex: echoed as streamed_response)

With ``--gateway-token-file`` every stream must carry the gateway's credential as gRPC
metadata (``x-pdserve-gateway-token``), checked before the first message is read; a
stream without it ends UNAUTHENTICATED. So only the gateway picks, and only the
gateway's ``served`` metadata (which endpoint answered: a failed primary is taken out)
is believed (issue 44 item 2).

A bad request is answered at once (ImmediateResponse with OpenAI's error body): 400
naming the field, 413, 401, 503 with no worker. The proxy's body mode is read from the
first message's ``protocol_config``; ``STREAMED``/``BUFFERED_PARTIAL`` request bodies
cannot be picked on (the headers go upstream before the body is in) and get a 500 that
says which modes work.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from pdserve.router.errors import APIError
from pdserve.router.picker import envoy_msgs as msgs
from pdserve.router.picker.pick import Pick, Picker

log = logging.getLogger(__name__)
BODY_PIECE = 64 << 10  # bytes of request body per streamed_response message
GATEWAY_TOKEN_KEY = "x-pdserve-gateway-token"  # gRPC metadata keys are lower case


@dataclass
class _Exchange:
    """One HTTP request's state on its stream."""

    duplex_request: bool = False
    duplex_response: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    subset: frozenset[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    pick: Pick | None = None
    served_seen: bool = False


class ExtProc(ep_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker, gateway_token: str = "") -> None:
        self.picker = picker
        self.gateway_token = gateway_token.encode()

    def _from_gateway(self, context: Any) -> bool:
        if not self.gateway_token:
            return True
        given = b""
        for key, value in context.invocation_metadata() or ():
            if key == GATEWAY_TOKEN_KEY:
                given = value.encode() if isinstance(value, str) else value
        return hmac.compare_digest(given, self.gateway_token)

    async def Process(  # the gRPC method's name
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        if not self._from_gateway(context):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {GATEWAY_TOKEN_KEY}"
            )
            return
        ex = _Exchange()
        try:
            async for msg in request_iterator:
                done = False
                async for out in self._handle(ex, msg):
                    yield out
                    done = out.HasField("immediate_response")
                if done:
                    return
        finally:
            if ex.pick is not None:
                self.picker.release(ex.pick)

    async def _handle(
        self, ex: _Exchange, msg: ep.ProcessingRequest
    ) -> AsyncIterator[ep.ProcessingResponse]:
        kind = msg.WhichOneof("request")
        if msg.HasField("protocol_config"):
            cfg = msg.protocol_config
            ex.duplex_request = cfg.request_body_mode == msgs.FULL_DUPLEX
            ex.duplex_response = cfg.response_body_mode == msgs.FULL_DUPLEX
        if kind == "request_headers":
            ex.headers = msgs.header_map(msg.request_headers)
            ex.subset = msgs.subset_hint(msg)
            try:  # a bad key is refused before the picker buffers a byte of its body
                self.picker.rt.keys.caller(ex.headers.get("authorization", ""))
            except APIError as err:
                yield _refusal(err)
                return
            if msg.request_headers.end_of_stream:  # no body (a GET): load alone picks
                yield await self._routed(ex, None, in_body=False)
            elif not ex.duplex_request:
                yield msgs.headers_response()
        elif kind == "request_body":
            async for out in self._request_body(ex, msg.request_body):
                yield out
        elif kind == "request_trailers":
            yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
        elif kind == "response_headers":
            self._note_served(ex, msg)
            yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        elif kind == "response_body":
            self._note_served(ex, msg)
            chunk = msg.response_body
            if ex.duplex_response:
                yield msgs.streamed_body(chunk.body, chunk.end_of_stream, response=True)
            else:
                yield ep.ProcessingResponse(response_body=ep.BodyResponse())
            if chunk.end_of_stream and ex.pick is not None:
                self.picker.release(ex.pick)
        elif kind == "response_trailers":
            yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())

    async def _request_body(
        self, ex: _Exchange, chunk: ep.HttpBody
    ) -> AsyncIterator[ep.ProcessingResponse]:
        ex.body += chunk.body
        limit = self.picker.rt.cfg.max_body_bytes
        if len(ex.body) > limit:
            yield _refusal(APIError(413, f"request body is over {limit} bytes"))
            return
        if not chunk.end_of_stream:
            if not ex.duplex_request:  # streamed: the headers are upstream already
                yield _refusal(
                    APIError(
                        500,
                        "the endpoint picker needs the request body "
                        "in FULL_DUPLEX_STREAMED or BUFFERED mode",
                    )
                )
            return  # full duplex: nothing goes upstream until the pick is made
        body = bytes(ex.body)
        routed = await self._routed(ex, body, in_body=not ex.duplex_request)
        yield routed
        if ex.duplex_request and not routed.HasField("immediate_response"):
            # Back in pieces, as they came: one message per piece stays far below gRPC's
            # message limits whatever the body's size.
            for start in range(0, max(len(body), 1), BODY_PIECE):
                piece = body[start : start + BODY_PIECE]
                yield msgs.streamed_body(piece, start + BODY_PIECE >= len(body))

    async def _routed(
        self, ex: _Exchange, body: bytes | None, in_body: bool
    ) -> ep.ProcessingResponse:
        path = ex.headers.get(":path", "")
        try:
            ex.pick = await self.picker.pick(path, ex.headers, body, ex.subset)
        except APIError as err:
            return _refusal(err)
        except Exception as exc:  # a bug must not hang the proxy's request
            log.exception("endpoint pick failed on %s", path)
            return _refusal(APIError(500, f"internal error: {type(exc).__name__}"))
        extra = dict(ex.pick.set_headers)
        if body is not None and ex.duplex_request:
            extra["content-length"] = str(len(body))  # the body goes back as we send it
        common, metadata = msgs.routed(ex.pick.endpoints, extra, ex.pick.remove_headers)
        if in_body:
            return msgs.body_response(common, metadata)
        return msgs.headers_response(common, metadata)

    def _note_served(self, ex: _Exchange, msg: ep.ProcessingRequest) -> None:
        if ex.pick is None or ex.served_seen:
            return
        served = msgs.served_endpoint(msg)
        if served:
            ex.served_seen = True
            self.picker.served(ex.pick, served)


def _refusal(err: APIError) -> ep.ProcessingResponse:
    if err.status >= 500:
        log.warning("endpoint pick refused (%d): %s", err.status, err.message)
    return msgs.immediate(err.status, err.body(), err.message)
