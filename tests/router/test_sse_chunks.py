"""A stream's pre-built SSE chunk (openai_response.TextChunks) is ``openai_response.chunk``'s,
byte for byte: completions and chat, any index, text, finish reason and logprobs."""

from __future__ import annotations

import json
import time
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.router.api import openai_response

pytestmark = pytest.mark.unit

texts = st.text(st.characters(), max_size=16)
values = st.recursive(
    st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), texts),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)
logprobs = st.one_of(st.none(), st.dictionaries(texts, values, max_size=4))
finishes = st.one_of(st.none(), st.sampled_from(["stop", "length", "tool_calls"]), texts)


@settings(max_examples=300, deadline=None)
@given(texts, texts, st.booleans(), st.integers(0, 300), texts, finishes, logprobs)
def test_text_chunks_are_chunk_byte_for_byte(
    rid: str,
    model: str,
    chat: bool,
    index: int,
    text: str,
    finish: str | None,
    lps: dict[str, Any] | None,
) -> None:
    with mock.patch.object(time, "time", return_value=1_700_000_000.75):
        want = openai_response.chunk(rid, model, chat, text, finish, logprobs=lps, index=index)
        got = openai_response.TextChunks(rid, model, chat, index)(text, finish, lps)
    assert got == want
    body = json.loads(got.removeprefix("data: "))
    assert body["created"] == 1_700_000_000 and body["choices"][0]["index"] == index


def test_the_clock_is_read_per_chunk_as_before() -> None:
    chunks = openai_response.TextChunks("cmpl-1", "m", False)
    with mock.patch.object(time, "time", return_value=100.0):
        first = chunks("a", None)
    with mock.patch.object(time, "time", return_value=101.0):
        second = chunks("b", "stop")
    assert '"created":100,' in first and '"created":101,' in second
