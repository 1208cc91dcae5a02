"""``POST /tokenize`` and ``POST /detokenize`` with vLLM's request and response shapes.

/tokenize takes a completions-style ``prompt`` (``add_special_tokens``, default true)
or a chat-style ``messages`` (``add_generation_prompt``, default true;
``continue_final_message``, ``chat_template_kwargs``: router/api/chat_options.py) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; /detokenize takes
``{"tokens"}`` and answers ``{"prompt"}``. Chat input may carry ``tools`` (and
``tool_choice``): they are rendered as a chat completion would render them.
``model`` is optional, checked if given.

Both pass the gates a completion passes before its body is read (``handle``): the
API key, the key's requests-per-minute bucket and ``--max-queue`` admission; then
the body's size, depth and Unicode limits, and ``--max-prompt-chars`` before the
text is tokenized. They run on the tokenizer threads the completions share, so
without these a client could keep those threads busy for everyone else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request

from pdserve.router import edge
from pdserve.router.api.chat_options import flag, parse_chat_options
from pdserve.router.api.openai_request import check_model, parse_messages
from pdserve.router.api.tools import chat_inputs, parse_tools
from pdserve.router.edge import bound_text
from pdserve.router.errors import invalid
from pdserve.router.runtime import Runtime


async def handle(
    rt: Runtime, request: Request, fn: Callable[[Runtime, Any], dict[str, Any]]
) -> dict[str, Any]:
    """``fn`` (tokenize or detokenize) on the request's body, admitted as a completion is:
    the key and its request bucket, the body under its size and time limits, then a slot
    under --max-queue before any parsing or tokenizing."""
    caller, client = rt.gate(request)
    if rt.peers is not None:  # the key's request bucket and count at its owner
        await rt.take_request(client)
    try:
        raw = await edge.read_body(request, rt.cfg.max_body_bytes, rt.cfg.body_timeout_s)
        ticket = rt.admission.try_now(client)
        if ticket is None:
            ticket = await rt.admit(client, caller.priority)
    except BaseException:
        rt.untake(client)
        raise
    try:
        return await rt.off_loop(_parsed, fn, rt, raw)
    finally:
        ticket.release()


def _parsed(fn: Callable[[Runtime, Any], dict[str, Any]], rt: Runtime, raw: bytes) -> Any:
    return fn(rt, edge.parse_json(raw))


def _check(rt: Runtime, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    if body.get("model") is not None:
        check_model(body["model"], rt.served_names)
    return body


def tokenize(rt: Runtime, body: Any) -> dict[str, Any]:
    body = _check(rt, body)
    tok = rt.tokenizer
    if "messages" in body:
        parsed = parse_messages(body["messages"])
        options = parse_chat_options(body, parsed)
        cfg = parse_tools(body)
        size = edge.chat_chars(parsed, cfg.tools if cfg else None, options.kwargs)
        bound_text(size, "messages", rt.cfg.max_prompt_chars)
        messages, tools = chat_inputs(tok.tok, list(parsed), cfg)
        ids = tok.encode_chat(messages, tools=tools, options=options)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise invalid("prompt (a string) or messages is required", "prompt")
        bound_text(len(prompt), "prompt", rt.cfg.max_prompt_chars)
        ids = list(
            tok.tok.encode(prompt, add_special_tokens=flag(body, "add_special_tokens", True))
        )
    strs = tok.tok.convert_ids_to_tokens(ids) if flag(body, "return_token_strs", False) else None
    max_len = rt.discovery.snapshot().max_model_len or tok.config_max_len
    return {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs}


def detokenize(rt: Runtime, body: Any) -> dict[str, Any]:
    body = _check(rt, body)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise invalid("tokens must be a list of token ids", "tokens")
    bad = [t for t in ids if not 0 <= t < rt.tokenizer.vocab_size]
    if bad:
        raise invalid(f"token id {bad[0]} is outside the vocabulary", "tokens")
    return {"prompt": rt.tokenizer.tok.decode(ids)}
