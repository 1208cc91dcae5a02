"""``POST /v1/responses``: the chat path, entered and left in the Responses API's shapes.

``serving.serve`` runs it as any completion (gate, body limits, admission, the tokenizer
threads, routing, dispatch); this module supplies the two ends: the body → chat request
(router/api/responses/request.py, errors naming the Responses field) and the reply → ``response``
object or events (router/api/responses/output.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pdserve.router import edge
from pdserve.router.api import serving
from pdserve.router.api.answer import Admitted, answer
from pdserve.router.api.openai_request import CompletionRequest
from pdserve.router.api.responses.output import Events, Shape, output_items, status_of, usage
from pdserve.router.api.responses.request import chat_body
from pdserve.router.api.tool_output import ToolOutput
from pdserve.router.errors import APIError
from pdserve.router.runtime import Runtime
from pdserve.router.transport.dispatch import Delta, RequestState

# The chat field an error names → the Responses field the client sent.
PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "max_tokens": "max_output_tokens",
}


class ResponsesCall:
    """One /v1/responses request: ``serving.serve``'s Api for it."""

    prefix = "resp_"

    def __init__(self) -> None:
        self.body: dict[str, Any] = {}

    def prepare(self, rt: Runtime, raw: bytes, chat: bool) -> tuple[CompletionRequest, list[int]]:
        body = edge.parse_json(raw)
        try:
            prepared = serving.prepare_body(rt, chat_body(body), True)
        except APIError as err:
            err.param = PARAMS.get(err.param or "", err.param)
            raise
        self.body = body
        return prepared

    async def respond(self, rt: Runtime, call: Admitted) -> Response:
        req, rs = call.req, call.rs
        shape = Shape(rs.request_id, self.body)
        events = rt.dispatcher.run(rs, call.plan)

        def whole(got: tuple[str, str | None]) -> dict[str, Any]:
            text, finish = got
            message: dict[str, Any] = {"content": text}
            if req.tools is not None:
                message, finish = ToolOutput(req.tools).message(text, finish)
            return shape.response(status_of(finish), output_items(message), _usage(rs))

        def stream(first: Delta) -> tuple[str, AsyncIterator[str]]:
            out = Events(shape)
            tools = ToolOutput(req.tools) if req.tools is not None else None
            rs.status = 499  # until the stream completes
            head = out.start() + _feed(out, tools, first, rs)
            return head, _rest(out, tools, events, rs)

        return await answer(rt, call, events, _collect, whole, stream)


async def serve_responses(rt: Runtime, request: Request) -> Response:
    return await serving.serve(rt, request, True, ResponsesCall())


def _usage(rs: RequestState) -> dict[str, Any]:
    return usage(len(rs.prompt_ids), rs.completion_tokens, rs.cached_tokens)


async def _collect(events: AsyncIterator[Delta]) -> tuple[str, str | None]:
    parts, finish = [], None
    async for d in events:
        parts.append(d.text)
        finish = d.finish_reason or finish
    return "".join(parts), finish


def _feed(out: Events, tools: ToolOutput | None, d: Delta, rs: RequestState) -> str:
    """The events of one delta; the closing ones with its finish reason."""
    if tools is None:
        text = out.delta({"content": d.text})
        finish = d.finish_reason
    else:
        deltas, finish = tools.feed(d.text), None
        if d.finish_reason is not None:
            more, finish = tools.finish(d.finish_reason)
            deltas += more
        text = "".join(out.delta(x) for x in deltas)
    if d.finish_reason is not None:
        text += out.finish(finish, _usage(rs))
    return text


async def _rest(
    out: Events, tools: ToolOutput | None, events: AsyncIterator[Delta], rs: RequestState
) -> AsyncIterator[str]:
    try:
        async for d in events:
            text = _feed(out, tools, d, rs)
            if text:
                yield text
        rs.status = 200
    except APIError as err:
        rs.status = err.status
        yield out.error(err.body())
