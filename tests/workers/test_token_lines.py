"""The decode stream's fast line codec (pdserve/protocol/token_lines.py) against the general codec:
the same bytes out, the same messages in, the same errors for bad lines.

Hypothesis draws the messages (wild text, ids, finish reasons, nested logprobs, usage)
and, for decoding, also lines that are not messages at all or break one field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from codec_checks import broken_bodies, junk, outcome
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.protocol.codec import decode, encode, to_dict
from pdserve.protocol.contract import TokenDelta, Usage, WorkerError
from pdserve.protocol.token_lines import decode_line, encode_line

pytestmark = pytest.mark.unit

texts = st.text(st.characters(), max_size=12)
ids = st.lists(st.integers(-(2**63), 2**63), max_size=4)
finishes = st.one_of(st.none(), st.sampled_from(["stop", "length", "abort"]), texts)
floats = st.floats(allow_nan=True, allow_infinity=True)
top = st.lists(st.tuples(st.integers(0, 10**6), floats), max_size=3)
logprobs = st.one_of(st.none(), st.lists(st.tuples(floats, top), max_size=3))
usages = st.one_of(st.none(), st.builds(Usage, *(st.integers(0, 10**9),) * 3))
deltas = st.builds(TokenDelta, ids, texts, finishes, usages, st.none(), logprobs)


@settings(max_examples=200, deadline=None)
@given(deltas)
def test_encode_line_writes_the_codecs_bytes(d: TokenDelta) -> None:
    """json's bytes for the codec's form (codec.encode may write orjson's, which read back
    the same: pdserve/protocol/fast_dumps.py)."""
    line = encode_line(d.token_ids, d.text, d.finish_reason, d.usage, d.logprobs)
    assert line == json.dumps(to_dict(d), separators=(",", ":")).encode() + b"\n"
    assert same(decode(line, TokenDelta), decode(encode(d), TokenDelta))


def same(a: TokenDelta, b: TokenDelta) -> bool:
    # by their encoding: a NaN logprob is never == another NaN
    return type(a) is type(b) is TokenDelta and encode(a) == encode(b)


@settings(max_examples=200, deadline=None)
@given(deltas)
def test_decode_line_reads_the_codecs_message(d: TokenDelta) -> None:
    line = encode(d)
    assert same(decode_line(line), decode(line, TokenDelta))
    spaced = json.dumps(to_dict(d)).encode()  # another writer's spacing reads the same
    assert same(decode_line(spaced), decode(spaced, TokenDelta))


def same_outcome(line: bytes) -> None:
    """decode_line and codec.decode agree: equal messages, or CodecErrors alike."""
    assert outcome(decode_line, line) == outcome(lambda r: decode(r, TokenDelta), line)


values = junk(st.integers(), floats, texts)
FIELDS = ["token_ids", "text", "finish_reason", "usage", "error", "logprobs", "type", "extra"]


@settings(max_examples=300, deadline=None)
@given(broken_bodies(deltas, FIELDS, values))
def test_a_broken_field_fails_as_in_the_codec(raw: bytes) -> None:
    same_outcome(raw)


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"{not json}",
        b"[1, 2]",
        b"null",
        b'"x"',
        b"\xff\xfe",
        b"[" * 5000 + b"]" * 5000,
        b'{"type": "token_delta", "token_ids": [true]}',
        b'{"token_ids": [5]}',
        encode(TokenDelta(error=WorkerError("boom", code="request_failed"))),
        encode(TokenDelta([1], "x", "stop", Usage(3, 1, 0))),
    ],
)
def test_odd_lines_fail_or_pass_as_in_the_codec(line: bytes) -> None:
    same_outcome(line)


def test_the_last_line_with_usage_is_read_without_the_codec(monkeypatch: Any) -> None:
    """Every stream's last line carries the usage: it takes the fast path too."""
    from pdserve.protocol import token_lines

    d = TokenDelta([5], "x", "stop", Usage(64, 4, 0))
    monkeypatch.setattr(token_lines, "from_dict", None)  # would fail if called
    monkeypatch.setattr(token_lines, "decode", None)
    assert decode_line(encode(d)) == d
