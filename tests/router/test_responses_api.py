"""/v1/responses, table-driven, without workers: a Responses body becomes the chat body it
means (or a 400 naming the Responses field), and chat deltas become the Responses events in
order. tests/router/test_responses_e2e.py runs the official client against real workers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.router.api.responses.output import Events, Shape, output_items
from pdserve.router.api.responses.request import chat_body
from pdserve.router.errors import APIError

pytestmark = pytest.mark.unit


def test_input_items_become_messages() -> None:
    body = {
        "model": "m",
        "instructions": "be brief",
        "max_output_tokens": 7,
        "temperature": 0,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get", "arguments": '{"a":1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "It is sunny."}],
            },
        ],
        "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "store": False,
    }
    out = chat_body(body)
    assert out["messages"][0] == {"role": "system", "content": "be brief"}
    assert out["messages"][1] == {"role": "user", "content": "weather?"}
    calls = out["messages"][2]["tool_calls"]  # consecutive calls: one assistant message
    assert [c["id"] for c in calls] == ["c1", "c2"] and out["messages"][2]["content"] is None
    assert out["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert out["messages"][4] == {"role": "assistant", "content": "It is sunny."}
    assert out["max_completion_tokens"] == 7 and out["temperature"] == 0
    assert out["tools"] == [
        {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
    ]
    assert out["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    assert out["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert "store" not in out


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "c"}, "conversation"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"whatever": 1}, "whatever"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "grammar"}}}, "text"),
        ({"tool_choice": {"type": "mcp"}}, "tool_choice"),
    ],
)
def test_refused_by_name(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        chat_body({"model": "m", "input": "hi", **extra})
    assert err.value.status == 400 and err.value.param == param


def test_accepted_at_their_default() -> None:
    chat_body(
        {
            "model": "m",
            "input": "hi",
            "store": False,
            "truncation": "disabled",
            "include": [],
            "background": False,
            "service_tier": "auto",
        }
    )


def _events(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.split("\n\n"):
        if block:
            kind, data = block.split("\n")
            body = json.loads(data.removeprefix("data: "))
            assert kind == "event: " + body["type"]
            out.append(body)
    return out


def test_events_text_then_calls() -> None:
    ev = Events(Shape("resp_1", {"model": "m"}))
    text = ev.start() + ev.delta({"content": "Hel"}) + ev.delta({"content": "lo"})
    name = {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            }
        ]
    }
    text += ev.delta(name) + ev.delta(
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    )
    text += ev.delta({"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]})
    text += ev.finish("tool_calls", {"input_tokens": 1})
    events = _events(text)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "Hello"
    assert done["output"][1]["arguments"] == '{"a":1}' and done["output"][1]["call_id"] == "call_1"
    assert events[12]["arguments"] == '{"a":1}' and events[1]["response"]["status"] == "in_progress"


def test_cut_short_is_incomplete_and_empty_reply_has_a_message() -> None:
    ev = Events(Shape("resp_2", {"model": "m"}))
    events = _events(ev.start() + ev.finish("length", {}))
    assert events[-1]["type"] == "response.incomplete"
    done = events[-1]["response"]
    assert done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["output"][0]["content"][0]["text"] == ""


def test_whole_message_items() -> None:
    call = {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msg = {"content": None, "tool_calls": [call]}
    items = output_items(msg)
    assert [i["type"] for i in items] == ["function_call"] and items[0]["call_id"] == "call_9"
    assert output_items({"content": "hi"})[0]["content"][0]["text"] == "hi"
