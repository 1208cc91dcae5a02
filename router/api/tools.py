"""Tool calling, request side: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

* ``none``: the tools are not shown to the model; it answers in text.
* ``auto``: the tools are shown (through the chat template when it renders tools,
  else in the default system prompt below); the reply is parsed for
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (router/api/tool_output.py).
* ``required`` / a named function: the reply is generated under a JSON-schema grammar
  built from the functions' parameters, so it is a valid call even from a random model:
  ``[{"name": ..., "arguments": {...}}, ...]`` (at most MAX_PARALLEL_CALLS items, one
  when ``parallel_tool_calls`` is false) for ``required``; the arguments object alone
  for a named function.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from pdserve.router.errors import invalid

# At most this many calls in one reply to tool_choice "required" (a sampling model could
# otherwise add calls until max_tokens runs out, leaving an unfinished array).
MAX_PARALLEL_CALLS = 4
DEFAULT_TOOLS_PROMPT = (
    "You can call these functions. Their JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one block per call, and nothing else:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <JSON object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolConfig:
    tools: tuple[dict[str, Any], ...]  # the "function" objects
    choice: str  # "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def function(self, name: str) -> dict[str, Any] | None:
        return next((f for f in self.tools if f["name"] == name), None)


def parse_tools(body: dict[str, Any]) -> ToolConfig | None:
    """The request's tool settings; None when no tool may be called."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(named, str):
            raise invalid(
                'tool_choice must be {"type": "function", "function": {"name"}}', "tool_choice"
            )
        if named not in {f["name"] for f in functions}:
            raise invalid(f"tool_choice names {named!r}, which is not in tools", "tool_choice")
        choice = "named"
    elif choice not in ("auto", "required"):
        raise invalid("tool_choice must be none, auto, required or a named function", "tool_choice")
    return ToolConfig(tuple(functions), choice, named, parallel is not False)


def _functions(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid("tools must be a list", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise invalid(
                f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools"
            )
        name, params = fn.get("name"), fn.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not name or name in names:
            raise invalid(f"tools[{i}].function.name must be a unique, non-empty string", "tools")
        if not isinstance(params, dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema", "tools")
        names.add(name)
        out.append({**fn, "parameters": params or {"type": "object"}})
    return out


def grammar_spec(cfg: ToolConfig) -> dict[str, Any] | None:
    """The structured-output spec that makes the reply a valid call (required / named)."""
    if cfg.choice == "named":
        fn = cfg.function(cfg.named or "")
        assert fn is not None
        return {"type": "json_schema", "schema": fn["parameters"], "param": "tool_choice"}
    if cfg.choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in cfg.tools
    ]
    max_items = MAX_PARALLEL_CALLS if cfg.parallel else 1
    array = {"type": "array", "minItems": 1, "maxItems": max_items, "items": {"anyOf": calls}}
    return {"type": "json_schema", "schema": array, "param": "tool_choice"}


def template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def default_messages(
    messages: list[dict[str, Any]], cfg: ToolConfig | None
) -> list[dict[str, Any]]:
    """Messages for a chat template that does not render tools: the tool list in a system
    message, assistant tool calls as ``<tool_call>`` blocks, tool results as text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls:
            blocks = "\n".join(_call_block(c) for c in calls)
            out.append({"role": "assistant", "content": (m.get("content") or "") + blocks})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if cfg is not None:
        listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in cfg.tools)
        prompt = DEFAULT_TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_block(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    with contextlib.suppress(ValueError):  # else the client's own text, shown as sent
        args = json.loads(args) if isinstance(args, str) else args
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def chat_inputs(
    tokenizer: Any, messages: list[dict[str, Any]], cfg: ToolConfig | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for ``apply_chat_template``: the template's own tool format
    when it has one, else the default format in plain messages."""
    if template_renders_tools(tokenizer):
        tools = [{"type": "function", "function": f} for f in cfg.tools] if cfg else None
        return messages, tools
    if cfg is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    return default_messages(messages, cfg), None
