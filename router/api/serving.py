"""Serving one completion / chat completion: parse, admit, dispatch, respond.

Before the first token exists every failure is an HTTP error with OpenAI's
body; once streaming has started, a failure is an SSE ``error`` event followed
by ``[DONE]``. A client that goes away cancels the dispatch, which aborts the
request on its workers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response

from pdserve.protocol.codec import all_ints
from pdserve.protocol.sampling_params import InvalidParameter
from pdserve.router import edge
from pdserve.router.api import openai_response
from pdserve.router.api.answer import Admitted, Chunks, answer, formatter, sse_tail
from pdserve.router.api.client_stream import ClientGone, SSEStream, guarded
from pdserve.router.api.echo import echo_for, scored_only
from pdserve.router.api.grammar_limits import check_grammar
from pdserve.router.api.openai_request import CompletionRequest, check_model, parse_request
from pdserve.router.api.serving_n import respond_n
from pdserve.router.api.tool_output import ToolOutput
from pdserve.router.api.tools import chat_inputs
from pdserve.router.errors import APIError, invalid
from pdserve.router.picker import prefill_header
from pdserve.router.runtime import Runtime
from pdserve.router.scheduling.snapshot import Snapshot
from pdserve.router.transport.dispatch import Delta, RequestState

log = logging.getLogger(__name__)


def prepare(rt: Runtime, raw: bytes, chat: bool) -> tuple[CompletionRequest, list[int]]:
    """Body bytes to a checked request and its prompt ids. CPU-bound (JSON, the chat
    template, the tokenizer): runs on a tokenizer thread, after admission."""
    return prepare_body(rt, edge.parse_json(raw), chat)


# A completions body this small is parsed on the event loop: the hop to a tokenizer thread
# and back (a future, a lock, two GIL hand-overs) cost more than parsing it there.
INLINE_BODY_BYTES = 4096
# A text prompt this short is tokenized there too (the Rust backend: ~60 µs of CPU for 100
# tokens here, a few hundred µs of the loop at most); a longer one goes to a thread, so
# that no stream waits behind it (tests/router/test_edge_limits.py).
INLINE_TEXT_CHARS = 1024


async def prepare_small(rt: Runtime, raw: bytes) -> tuple[CompletionRequest, list[int]]:
    """``prepare`` of a small completions body: token ids are checked here, and a short
    text prompt tokenized here; any other prompt goes to a tokenizer thread, as every
    larger body does."""
    body = edge.parse_json(raw)
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and all_ints(prompt):
        return prepare_body(rt, body, False)
    if isinstance(prompt, str) and len(prompt) <= INLINE_TEXT_CHARS:
        return prepare_body(rt, body, False)
    return await rt.off_loop(prepare_body, rt, body, False)


def prepare_body(
    rt: Runtime, body: Any, chat: bool, given: tuple[str, list[int]] | None = None
) -> tuple[CompletionRequest, list[int]]:
    """The checked request and its ids. ``given``: a text and its ids from the compiled
    lane's tokenizer (router/fast_lane.py), used for a text prompt that is that text."""
    req = parse_request(body, chat, rt.cfg.default_max_tokens)
    check_model(req.model, rt.served_names)
    check_grammar(req.sampling.structured, rt.cfg.max_schema_bytes)
    try:
        req.sampling.validate(rt.tokenizer.vocab_size)
    except InvalidParameter as exc:
        raise invalid(str(exc), exc.field) from exc
    edge.check_text_length(req, rt.cfg.max_prompt_chars)
    if given is not None and req.prompt_text == given[0] and rt.tokenizer.fast_ready():
        return req, given[1]  # the same tokenizer's ids (tests/router/test_lane_tokenize.py)
    return req, prompt_ids(rt, req)


def prompt_ids(rt: Runtime, req: CompletionRequest) -> list[int]:
    if req.chat:
        assert req.messages is not None
        messages, tools = chat_inputs(rt.tokenizer.tok, list(req.messages), req.tools)
        return rt.tokenizer.encode_chat(messages, tools=tools, options=req.template)
    if req.prompt_token_ids is not None:
        ids, vocab = list(req.prompt_token_ids), rt.tokenizer.vocab_size
        if ids and max(ids) >= vocab:  # max() in C: a comprehension read vocab_size per id
            bad = next(t for t in ids if t >= vocab)
            raise invalid(f"token id {bad} is outside the vocabulary", "prompt")
        return ids
    assert req.prompt_text is not None
    return rt.tokenizer.encode(req.prompt_text)


def fit_context(rt: Runtime, snap: Snapshot, req: CompletionRequest, n: int) -> CompletionRequest:
    max_len = snap.max_model_len or rt.tokenizer.config_max_len
    if not max_len:
        return req
    field = "messages" if req.chat else "prompt"
    if n >= max_len:
        raise invalid(
            f"this model's maximum context length is {max_len} tokens; the prompt has {n}",
            field,
            "context_length_exceeded",
        )
    room = max_len - n
    if req.max_tokens_given and req.sampling.max_tokens > room:
        raise invalid(
            f"prompt ({n} tokens) + max_tokens ({req.sampling.max_tokens}) exceeds the "
            f"maximum context length {max_len}",
            "max_tokens",
            "context_length_exceeded",
        )
    if req.sampling.max_tokens > room:
        return replace(req, sampling=replace(req.sampling, max_tokens=room))
    return req


class Api(Protocol):
    """Another API served over this path (router/api/responses/serve.py): its ids, its body
    → request, and its reply."""

    prefix: str

    def prepare(self, rt: Runtime, raw: bytes, chat: bool) -> tuple[CompletionRequest, list[int]]:
        """Runs on a tokenizer thread, as ``prepare``."""

    async def respond(self, rt: Runtime, call: Admitted) -> Response: ...


async def serve(rt: Runtime, request: Request, chat: bool, api: Api | None = None) -> Response:
    prefix = api.prefix if api is not None else "chatcmpl-" if chat else "cmpl-"
    rid = prefix + os.urandom(16).hex()  # uuid4().hex's length, without its object
    try:
        caller, client = rt.gate(request)  # before the body is read or parsed
        if rt.peers is not None:  # the key's request bucket and count at its owner
            await rt.take_request(client)
        try:
            raw = await edge.read_body(request, rt.cfg.max_body_bytes, rt.cfg.body_timeout_s)
            ticket = rt.admission.try_now(client)  # the common case: a free slot, no task
            if ticket is None:
                ticket = await guarded(request, rt.admit(client, caller.priority))
        except BaseException:
            rt.untake(client)
            raise
    except ClientGone:
        return Response(status_code=499)
    except APIError as err:
        return rt.error(err)
    key = caller.key
    streaming = False
    try:
        if api is None and not chat and len(raw) <= INLINE_BODY_BYTES:
            req, ids = await prepare_small(rt, raw)
        else:
            req, ids = await rt.off_loop(api.prepare if api else prepare, rt, raw, chat)
        snap = rt.discovery.snapshot()  # one view of the workers for the whole decision
        req = fit_context(rt, snap, req, len(ids))
        cost = len(ids) + req.best_of * req.sampling.max_tokens
        if rt.peers is None:  # no coroutine on the common path
            rt.limiter.take_tokens(client, cost)
        else:
            await rt.take_tokens(client, cost)
        salt = rt.cache_salt(key, req.cache_salt)
        lora = rt.adapter_of(req.model)
        plan = rt.scheduler.plan(ids, snap, salt, lora)
        if rt.cfg.prefill_from_header:  # a decode pod's front behind the endpoint picker
            plan = prefill_header.pinned(request.headers, plan, snap, raw)
        rs = RequestState(rid, ids, req.sampling, cache_salt=salt, lora=lora)
        respond = _respond if req.best_of == 1 else respond_n
        respond = api.respond if api is not None else respond
        response = await respond(rt, Admitted(request, req, rs, plan, ticket))
        streaming = isinstance(response, SSEStream)
        return response
    except APIError as err:
        return rt.error(err)
    finally:
        if not streaming:
            ticket.release()


async def _respond(rt: Runtime, call: Admitted) -> Response:
    req, rs = call.req, call.rs
    events = rt.dispatcher.run(rs, call.plan)
    ec = echo_for(rt.tokenizer.tok, req, rs)  # the prompt in front of the reply (echo)
    if ec is not None and ec.spec.score_only:
        events = scored_only(rs, events)

    def whole(got: tuple[str, str | None, list[int], list[Any]]) -> dict[str, Any]:
        text, finish, ids, lps = got
        fmt = formatter(rt, req, ec)
        message = None
        if req.tools is not None:
            message, finish = ToolOutput(req.tools).message(text, finish)
        body = openai_response.full_response(
            rs.request_id,
            req.model,
            req.chat,
            text,
            finish,
            _usage(rs),
            fmt.format(ids, lps) if fmt is not None else None,
            message,
        )
        return ec.whole(body) if ec is not None else body

    def stream(first: Delta) -> tuple[str, AsyncIterator[str]]:
        out = Chunks(req, rs, formatter(rt, req, ec))
        head = ec.head(rs.request_id, req.model) if ec is not None else ""
        return head + _sse_head(req, rs, first, out), _sse_rest(req, rs, events, out)

    return await answer(rt, call, events, _collect, whole, stream)


async def _collect(
    events: AsyncIterator[Delta],
) -> tuple[str, str | None, list[int], list[Any]]:
    parts, finish = [], None
    ids: list[int] = []
    lps: list[Any] = []
    async for d in events:
        parts.append(d.text)
        finish = d.finish_reason or finish
        ids.extend(d.token_ids)
        lps.extend(d.logprobs or ())
    return "".join(parts), finish, ids, lps


def _usage(rs: RequestState) -> dict[str, Any]:
    return openai_response.usage(len(rs.prompt_ids), rs.completion_tokens, rs.cached_tokens)


def _sse_head(req: CompletionRequest, rs: RequestState, first: Delta, out: Chunks) -> str:
    """The stream's first chunks: the role (chat) and the first token."""
    rid, model, chat = rs.request_id, req.model, req.chat
    rs.status = 499  # until the stream completes
    role = openai_response.chunk(rid, model, chat, role=True) if chat else ""
    return role + out(first)


def _sse_rest(
    req: CompletionRequest, rs: RequestState, events: AsyncIterator[Delta], out: Chunks
) -> AsyncIterator[str]:
    return sse_tail(req, rs, events, out, lambda: _usage(rs), _finishes)


def _finishes(d: Delta) -> bool:
    return d.finish_reason is not None
