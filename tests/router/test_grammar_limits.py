"""Pathological structured-output specs are refused at the router, naming the field and the
limit, before any worker compiles them (issue 24 item 3); ordinary ones pass. Through the
router with fake workers: no worker sees a refused request."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pdserve.router.api.grammar_limits import MAX_ALTERNATIVES, check_grammar
from pdserve.router.errors import APIError

pytestmark = pytest.mark.unit


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _tools(n: int) -> list[dict[str, Any]]:
    params = {"type": "object", "properties": {"x": {"type": "string", "enum": ["a", "b"]}}}
    return [
        {"type": "function", "function": {"name": f"f{i}", "parameters": params}} for i in range(n)
    ]


@pytest.mark.parametrize(
    ("spec", "code"),
    [
        (
            {"type": "json_schema", "schema": {"enum": list(range(MAX_ALTERNATIVES + 1))}},
            "grammar_too_many_alternatives",
        ),
        (
            {"type": "choice", "choice": [f"c{i}" for i in range(MAX_ALTERNATIVES + 1)]},
            "grammar_too_many_alternatives",
        ),
        ({"type": "json_schema", "schema": _deep(12)}, "grammar_too_deep"),
        ({"type": "regex", "regex": "a" * 70_000}, "grammar_too_large"),
    ],
)
def test_past_a_bound_is_refused(spec: dict[str, Any], code: str) -> None:
    with pytest.raises(APIError) as err:
        check_grammar({**spec, "param": "response_format"})
    assert err.value.param == "response_format" and err.value.code == code


def test_ordinary_specs_pass() -> None:
    check_grammar({"type": "json_schema", "schema": _deep(5), "param": "response_format"})
    check_grammar({"type": "regex", "regex": "[a-z]{1,8}", "param": "guided_regex"})
    check_grammar(None)


async def test_refused_through_the_router(cluster_factory) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    async with cluster_factory(max_schema_bytes=4096) as c, httpx.AsyncClient(base_url=c.url) as h:
        many = {**chat, "tools": _tools(200), "tool_choice": "required"}  # one alternation
        r = await h.post("/v1/chat/completions", json=many)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert "--max-schema-bytes" in r.json()["error"]["message"]
        big = {
            **chat,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"enum": ["v" * 50] * 100}},
            },
        }
        r = await h.post("/v1/chat/completions", json=big)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        assert all(st.requests == [] for st in c.prefill + c.decode)
