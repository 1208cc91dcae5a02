"""Tool calling without servers: request parsing, prompts, reply parsing and streaming."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.router.api.tool_output import ArrayScanner, ToolOutput
from pdserve.router.api.tools import ToolConfig, chat_inputs, grammar_spec, parse_tools
from pdserve.router.errors import APIError

pytestmark = pytest.mark.unit

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]


def cfg(choice: Any = "auto", parallel: bool = True) -> ToolConfig:
    out = parse_tools({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel})
    assert out is not None
    return out


def stream(out: ToolOutput, text: str, size: int, finish: str = "stop") -> tuple[list, str]:
    deltas = []
    for i in range(0, len(text), size):
        deltas += out.feed(text[i : i + size])
    more, reason = out.finish(finish)
    return deltas + more, str(reason)


def assemble(deltas: list[dict[str, Any]]) -> tuple[list[dict[str, str]], str]:
    """What a client builds from the deltas: calls by index, and the content."""
    calls: dict[int, dict[str, str]] = {}
    content = ""
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            if "id" in tc:
                assert call["name"] == "", "the name comes first, once"
                call["name"] = tc["function"]["name"]
            call["arguments"] += tc["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)], content


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_required_array_streams_name_then_fragments(size: int) -> None:
    text = json.dumps(
        [
            {"name": "get_weather", "arguments": {"city": 'Pa\\"ris }]', "days": 3}},
            {"name": "get_time", "arguments": {}},
        ]
    )
    deltas, finish = stream(ToolOutput(cfg("required")), text, size)
    calls, content = assemble(deltas)
    assert finish == "tool_calls" and content == ""
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": 'Pa\\"ris }]', "days": 3}
    assert json.loads(calls[1]["arguments"]) == {}
    msg, reason = ToolOutput(cfg("required")).message(text, "stop")
    assert reason == "tool_calls" and msg["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        json.loads(c["arguments"]) for c in calls
    ]


def test_named_streams_arguments_as_generated() -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    deltas, finish = stream(ToolOutput(cfg(named)), '{"tz": "UTC"}', 2)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    calls, _ = assemble(deltas)
    assert calls == [{"name": "get_time", "arguments": '{"tz": "UTC"}'}] and finish == "tool_calls"
    msg, reason = ToolOutput(cfg(named)).message('{"a', "length")  # cut short: no call
    assert reason == "length" and "tool_calls" not in msg


def test_auto_parses_blocks_and_streams_plain_text() -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    text = f"Let me check.<tool_call>\n{call}\n</tool_call>"
    msg, reason = ToolOutput(cfg()).message(text, "stop")
    assert reason == "tool_calls" and msg["content"] == "Let me check."
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    deltas, finish = stream(ToolOutput(cfg()), "  " + text[13:], 4)
    assert finish == "tool_calls" and assemble(deltas)[0][0]["name"] == "get_weather"
    deltas, finish = stream(ToolOutput(cfg()), "just text <tool_call", 3)
    assert assemble(deltas) == ([], "just text <tool_call") and finish == "stop"
    unknown = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert "tool_calls" not in ToolOutput(cfg()).message(unknown, "stop")[0]


def test_grammar_specs() -> None:
    spec = grammar_spec(cfg("required", parallel=False))
    assert spec is not None and spec["schema"]["maxItems"] == 1 and spec["param"] == "tool_choice"
    assert grammar_spec(cfg({"type": "function", "function": {"name": "get_weather"}})) == {
        "type": "json_schema",
        "schema": WEATHER["parameters"],
        "param": "tool_choice",
    }
    assert grammar_spec(cfg()) is None
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_fields(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        parse_tools(body)
    assert err.value.body()["error"]["param"] == param


def test_default_prompt_format(tiny_tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    out, tools = chat_inputs(tiny_tokenizer, messages, cfg())
    assert tools is None  # the tiny model's template does not render tools
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in out[2]["content"]
    )
    assert out[3] == {"role": "tool", "content": "sunny"}


def test_scanner_ignores_text_outside_calls() -> None:
    assert ArrayScanner().feed("[]") == []
