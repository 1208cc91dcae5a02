"""Answering an admitted request from its events: whole (one JSON body) or streamed (SSE
chunks, the usage chunk, [DONE]). serving.py (one choice), serving_n.py (n choices) and
responses/serve.py (the Responses API) build their replies on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.router.api import openai_response
from pdserve.router.api.client_stream import ClientGone, SSEStream, guarded
from pdserve.router.api.echo import Echo
from pdserve.router.api.logprobs_format import LogprobsFormatter
from pdserve.router.api.openai_request import CompletionRequest
from pdserve.router.api.tool_output import ToolOutput
from pdserve.router.errors import APIError
from pdserve.router.runtime import Runtime, Ticket
from pdserve.router.scheduling.routing import RoutePlan
from pdserve.router.transport.dispatch import Delta, RequestState

E = TypeVar("E")  # an event: a Delta, or (choice index, Delta)
C = TypeVar("C")  # all of a request's events, collected


@dataclass(frozen=True)
class Admitted:
    """One admitted request, routed: what every ``respond`` gets (``serve`` builds it)."""

    request: Request
    req: CompletionRequest
    rs: RequestState
    plan: RoutePlan
    ticket: Ticket


async def answer(
    rt: Runtime,
    call: Admitted,
    events: AsyncGenerator[E, None],
    collect: Callable[[AsyncGenerator[E, None]], Awaitable[C]],
    whole: Callable[[C], dict[str, Any]],
    stream: Callable[[E], tuple[str, AsyncIterator[str]]],
) -> Response:
    """Answer from ``events`` (one choice's or n choices'): whole, or streamed once the first
    event is in, so that a failure before it is still an HTTP error with a status."""
    request, rs = call.request, call.rs
    try:
        if not call.req.stream:
            got = await guarded(request, collect(events))
            rt.finish(rs, 200)
            return JSONResponse(whole(got))
        first = await guarded(request, anext(events))
    except APIError:
        await events.aclose()
        raise
    except ClientGone:
        rt.finish(rs, 499)
        return Response(status_code=499)
    except StopAsyncIteration:
        raise APIError(502, "the workers returned no tokens") from None

    async def cleanup() -> None:
        with contextlib.suppress(Exception):
            await events.aclose()  # aborts on the workers when unfinished
        call.ticket.release()
        rt.finish(rs, rs.status)

    head, rest = stream(first)
    return SSEStream(
        head, rest, cleanup, rt.cfg.stream_write_timeout_s, rt.metrics.slow_readers.inc
    )


def formatter(
    rt: Runtime, req: CompletionRequest, ec: Echo | None = None
) -> LogprobsFormatter | None:
    if req.sampling.logprobs is None or req.hide_logprobs:
        return None
    fmt = LogprobsFormatter(rt.tokenizer.tok, req.chat, req.tokens_as_ids)
    if ec is not None:
        ec.shift(fmt)
    return fmt


def _delta_logprobs(fmt: LogprobsFormatter | None, d: Delta) -> dict[str, Any] | None:
    if fmt is None:
        return None
    if d.logprobs is None and d.token_ids:
        raise APIError(502, "a worker sent tokens without the logprobs asked for")
    return fmt.format(d.token_ids, d.logprobs or ())


class Chunks:
    """SSE text for each delta of one stream: text and logprobs, or tool-call deltas."""

    def __init__(
        self,
        req: CompletionRequest,
        rs: RequestState,
        fmt: LogprobsFormatter | None,
        index: int = 0,
    ) -> None:
        self.rid, self.model, self.chat = rs.request_id, req.model, req.chat
        self.index = index
        self.fmt = fmt
        self.tools = ToolOutput(req.tools) if req.tools is not None else None
        self.text = openai_response.TextChunks(self.rid, self.model, self.chat, index)

    def __call__(self, d: Delta) -> str:
        if self.tools is None:
            return self.text(d.text, d.finish_reason, _delta_logprobs(self.fmt, d))
        deltas, finish = self.tools.feed(d.text), None
        if d.finish_reason is not None:
            more, finish = self.tools.finish(d.finish_reason)
            deltas += more
        rid, model, i = self.rid, self.model, self.index
        out = "".join(openai_response.delta_chunk(rid, model, x, index=i) for x in deltas)
        if finish is not None:
            out += openai_response.delta_chunk(rid, model, {}, finish, index=i)
        return out


async def sse_tail(
    req: CompletionRequest,
    rs: RequestState,
    events: AsyncIterator[E],
    chunks: Callable[[E], str],
    usage: Callable[[], dict[str, Any]],
    last: Callable[[E], bool] | None = None,
) -> AsyncIterator[str]:
    """A stream after its first chunk: ``chunks`` of each of ``events`` (empty ones
    skipped), the usage chunk when asked (``usage()`` once the tokens are all in), [DONE];
    an error midway is its body. (``chunks`` is called here, not in a generator of its own
    around ``events``: one async generator less per stream.)

    ``last(event)``: nothing follows that event (a choice's finish_reason): the stream's
    end goes out with it, in one write, before the worker's reply is read to its end (the
    connection back to the pool) instead of after it, often a loop turn later (one write
    per stream less, and [DONE] sooner)."""
    try:
        async for event in events:
            text = chunks(event)
            if last is not None and last(event):
                yield text + _end(req, rs, usage)
                with contextlib.suppress(APIError):  # the client has its [DONE]
                    async for _ in events:  # the worker's reply, to its end
                        pass
                return
            if text:
                yield text
        yield _end(req, rs, usage)
    except APIError as err:
        rs.status = err.status
        yield openai_response.sse(err.body())
        yield openai_response.DONE


def _end(req: CompletionRequest, rs: RequestState, usage: Callable[[], dict[str, Any]]) -> str:
    """The stream's end: the usage chunk when asked, then [DONE]."""
    tail = ""
    if req.include_usage:
        tail = openai_response.chunk(rs.request_id, req.model, req.chat, use=usage())
    rs.status = 200
    return tail + openai_response.DONE
