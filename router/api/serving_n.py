"""Serving a request with ``n`` > 1 choices (router/api/choices.py runs them).

Like serving.py's single-choice path (both answer with answer.py), with one difference
a client sees: every chunk of a stream carries its choice's ``index``, and the choices'
chunks interleave.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import Response

from pdserve.router.api import openai_response
from pdserve.router.api.answer import Admitted, Chunks, answer, formatter, sse_tail
from pdserve.router.api.choices import Choices
from pdserve.router.api.openai_request import CompletionRequest
from pdserve.router.api.tool_output import ToolOutput
from pdserve.router.runtime import Runtime
from pdserve.router.transport.dispatch import Delta, RequestState


async def respond_n(rt: Runtime, call: Admitted) -> Response:
    """n > 1 choices (router/api/choices.py); each stream chunk carries its choice's index."""
    req, rs = call.req, call.rs
    ch = Choices(rt.dispatcher, rs, call.plan, req.best_of)
    events = ch.events()

    def stream(first: tuple[int, Delta]) -> tuple[str, AsyncIterator[str]]:
        outs = [Chunks(req, rs, formatter(rt, req), i) for i in range(req.n)]
        rs.status = 499  # until the stream completes
        head = (
            "".join(
                openai_response.chunk(rs.request_id, req.model, True, role=True, index=i)
                for i in range(req.n)
            )
            if req.chat
            else ""
        )
        return head + outs[first[0]](first[1]), _sse_rest_n(req, rs, ch, events, outs)

    return await answer(
        rt,
        call,
        events,
        lambda e: _collect_n(e, req.best_of),
        lambda per: _whole_n(rt, req, rs, ch, per),
        stream,
    )


async def _collect_n(events: AsyncIterator[tuple[int, Delta]], n: int) -> list[list[Delta]]:
    per: list[list[Delta]] = [[] for _ in range(n)]
    async for i, d in events:
        per[i].append(d)
    return per


def _best(per: list[list[Delta]], n: int) -> list[list[Delta]]:
    """best_of: the n candidates with the highest sum of token logprobs, best first."""
    if len(per) == n:
        return per

    def score(deltas: list[Delta]) -> float:
        return sum(lp[0] for d in deltas for lp in d.logprobs or ())

    return sorted(per, key=score, reverse=True)[:n]


def _whole_n(
    rt: Runtime, req: CompletionRequest, rs: RequestState, ch: Choices, per: list[list[Delta]]
) -> dict[str, Any]:
    choices = []
    for i, deltas in enumerate(_best(per, req.n)):
        text = "".join(d.text for d in deltas)
        finish = next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None)
        fmt, message = formatter(rt, req), None
        lps = None
        if fmt is not None:
            ids = [t for d in deltas for t in d.token_ids]
            lps = fmt.format(ids, [x for d in deltas for x in d.logprobs or ()])
        if req.tools is not None:
            message, finish = ToolOutput(req.tools).message(text, finish)
        choices.append(openai_response.choice(i, req.chat, text, finish, lps, message))
    use = openai_response.usage(len(rs.prompt_ids), ch.completion_tokens, rs.cached_tokens)
    return openai_response.full_response(
        rs.request_id, req.model, req.chat, "", None, use, choices=choices
    )


def _sse_rest_n(
    req: CompletionRequest,
    rs: RequestState,
    ch: Choices,
    events: AsyncGenerator[tuple[int, Delta], None],
    outs: list[Chunks],
) -> AsyncIterator[str]:
    def use() -> dict[str, Any]:
        return openai_response.usage(len(rs.prompt_ids), ch.completion_tokens, rs.cached_tokens)

    return sse_tail(req, rs, events, lambda e: outs[e[0]](e[1]), use)
