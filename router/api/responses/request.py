"""OpenAI's Responses API (``POST /v1/responses``), stateless: a request body becomes the
chat completions body it means, and runs the chat path whole (template, tools, structured
outputs, P/D dispatch); router/api/responses/output.py writes the reply and its events.

    input (string | items) ──┐            instructions ──▶ first system message
    message items ───────────┼─▶ messages  max_output_tokens ──▶ max_completion_tokens
    function_call items ─────┤            tools [{type, name, parameters}] ──▶ chat tools
    function_call_output ────┘            text.format ──▶ response_format

Nothing is stored: ``store: true`` and ``previous_response_id`` are refused by name (a
client that needs history sends it as ``input`` items), as is every field this server
does not honour (RESPONSES below; docs/router.md has the table).
"""

from __future__ import annotations

from typing import Any

from pdserve.router.errors import invalid

# Chat fields a Responses body carries under the same name, passed through as they are.
PASSED = (
    "temperature",
    "top_p",
    "seed",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "user",
    "cache_salt",
    "parallel_tool_calls",
)
# Honoured (translated to the chat request, or echoed back in the response object).
RESPONSES = frozenset(
    {
        *("model", "input", "instructions", "max_output_tokens", "tools", "tool_choice"),
        *("text", "stream", "store", "metadata", *PASSED),
    }
)
# Accepted with no effect (OpenAI platform bookkeeping).
NO_EFFECT = frozenset({"service_tier", "safety_identifier", "prompt_cache_key"})
# Accepted only at these values (what a stateless text-only server does anyway).
ONLY: dict[str, tuple[Any, ...]] = {
    "store": (None, False),
    "previous_response_id": (None,),
    "conversation": (None,),
    "background": (None, False),
    "truncation": (None, "disabled"),
    "include": (None, []),
    "reasoning": (None,),
}
WHY = {
    "store": "this server keeps no responses (stateless): send store: false",
    "previous_response_id": "this server keeps no responses (stateless): send the earlier "
    "turns as input items",
    "conversation": "this server keeps no conversations (stateless)",
}


def chat_body(body: Any) -> dict[str, Any]:
    """The chat completions body of a Responses request; 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    _check_fields(body)
    out: dict[str, Any] = {"model": body.get("model")}
    out["messages"] = _instructions(body.get("instructions")) + input_messages(body.get("input"))
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise invalid("max_output_tokens must be a positive integer", "max_output_tokens")
        out["max_completion_tokens"] = limit
    for name in PASSED:
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("stream") is not None:
        if not isinstance(body["stream"], bool):
            raise invalid("stream must be a boolean", "stream")
        out["stream"] = body["stream"]
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    return out


def _check_fields(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name in ONLY:
            if value not in ONLY[name]:
                why = WHY.get(name, "is not supported by this server")
                raise invalid(f"{name}={value!r}: {why}", name)
        elif name not in RESPONSES and name not in NO_EFFECT:
            raise invalid(f"{name} is not supported on /v1/responses by this server", name)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("metadata must be an object", "metadata")


def _instructions(text: Any) -> list[dict[str, Any]]:
    if text is None:
        return []
    if not isinstance(text, str):
        raise invalid("instructions must be a string", "instructions")
    return [{"role": "system", "content": text}]


ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; items in order, with
    consecutive function calls joined into one assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("input is required: a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise invalid(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, i))
        elif kind == "function_call":
            call = _function_call(item, i)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_call_output(item, i))
        else:
            raise invalid(
                f"input[{i}].type {kind!r} is not supported by this server "
                "(message, function_call, function_call_output)",
                "input",
            )
    return out


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"input[{i}].role must be one of {list(ROLES)}", "input")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(
                    f"input[{i}].content: {kind!r} parts are not supported by this "
                    "server (text only)",
                    "input",
                )
            if not isinstance(part.get("text"), str):
                raise invalid(f"input[{i}].content: a text part needs 'text'", "input")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise invalid(f"input[{i}].content must be a string or a list of text parts", "input")
    return {"role": role, "content": content}


def _function_call(item: dict[str, Any], i: int) -> dict[str, Any]:
    name, args, call_id = item.get("name"), item.get("arguments", ""), item.get("call_id")
    if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
        raise invalid(
            f"input[{i}]: a function_call needs call_id, name and arguments (strings)", "input"
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _call_output(item: dict[str, Any], i: int) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not isinstance(output, str):
        raise invalid(
            f"input[{i}]: a function_call_output needs call_id and output (strings)", "input"
        )
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(
                f"tools[{i}]: only function tools are supported by this server, got {kind!r}",
                "tools",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise invalid(f"tools[{i}].strict must be a boolean", "tools")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice  # none | auto | required: checked by the chat path
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise invalid(
        'tool_choice must be none, auto, required or {"type": "function", "name"}', "tool_choice"
    )


def _format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise invalid("text must be an object with format", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise invalid("text.format.schema must be an object", "text")
        js = {"name": fmt.get("name", "response"), "schema": schema}
        if fmt.get("strict") is not None:
            js["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": js}
    raise invalid("text.format.type must be text, json_object or json_schema", "text")
