"""The router's fast read of a prefill reply (pdserve/protocol/prefill_reply.py) against the
general codec: the same messages in, the same errors for bad bodies.

Hypothesis draws the replies (a KV handle or none, usage, logprobs, wild text) and also
bodies with one field, or one field of the handle, broken or missing."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from codec_checks import broken_bodies, junk, outcome
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.protocol.codec import decode, encode, to_dict
from pdserve.protocol.contract import KVHandle, LoraRef, PrefillReply, Usage
from pdserve.protocol.prefill_reply import decode_prefill_reply

pytestmark = pytest.mark.unit

texts = st.text(st.characters(), max_size=12)
ints = st.integers(-(2**63), 2**63)
floats = st.floats(allow_nan=True, allow_infinity=True)
top = st.lists(st.tuples(ints, floats), max_size=2)
logprobs = st.one_of(st.none(), st.lists(st.tuples(floats, top), max_size=2))
usages = st.one_of(st.none(), st.builds(Usage, *(st.integers(0, 10**9),) * 3))
loras = st.one_of(st.none(), st.just(LoraRef("ad", "0" * 64)))


@st.composite
def handles(draw: Any) -> KVHandle:
    block = draw(st.integers(1, 32))
    n = draw(st.integers(1, 200))
    full = n // block
    return KVHandle(
        draw(texts),
        draw(texts),
        draw(st.sampled_from(["tcp://127.0.0.1:5", "ipc://x"])),
        draw(st.lists(st.integers(-1, 10**6), min_size=-(-n // block), max_size=-(-n // block))),
        n,
        draw(st.lists(ints, max_size=full)),
        block,
        draw(st.sampled_from(["", "n0"])),
        draw(st.one_of(st.integers(0, 60), st.floats(0, 60))),
        draw(texts),
        draw(st.sampled_from([1, 2])),
        draw(loras),
    )


replies = st.builds(
    PrefillReply,
    texts,
    ints,
    texts,
    st.one_of(st.none(), texts),
    st.one_of(st.none(), handles()),
    ints,
    ints,
    usages,
    logprobs,
    logprobs,
)


def same_outcome(raw: bytes) -> None:
    assert outcome(decode_prefill_reply, raw) == outcome(lambda r: decode(r, PrefillReply), raw)


@settings(max_examples=300, deadline=None)
@given(replies)
def test_reads_the_codecs_message(reply: PrefillReply) -> None:
    raw = encode(reply)
    same_outcome(raw)
    same_outcome(json.dumps(to_dict(reply)).encode())  # another writer's spacing


def test_the_common_reply_is_read_without_the_codec(monkeypatch: Any) -> None:
    """The fast path is taken for a reply as the workers write it (no codec call)."""
    from pdserve.protocol import token_lines  # fast_decode: the codec calls it would make

    handle = KVHandle("r1", "p0", "tcp://127.0.0.1:5", [0, 1], 20, [7], 16, "n", 30.0, "tcp")
    reply = PrefillReply("r1", 5, "x", None, handle, 0, 20, Usage(20, 1, 0))
    monkeypatch.setattr(token_lines, "from_dict", None)  # would fail if called
    monkeypatch.setattr(token_lines, "decode", None)
    assert decode_prefill_reply(encode(reply)) == reply


values = junk(ints, floats, texts)
# every field of the message (and of its handle), the tag, and one the codec does not know
REPLY_FIELDS = [*(f.name for f in dataclasses.fields(PrefillReply)), "type", "extra"]
HANDLE_FIELDS = [*(f.name for f in dataclasses.fields(KVHandle)), "type", "extra"]


@settings(max_examples=300, deadline=None)
@given(broken_bodies(replies, REPLY_FIELDS, values))
def test_a_broken_field_fails_as_in_the_codec(raw: bytes) -> None:
    same_outcome(raw)


def _with_handle(handle: KVHandle) -> PrefillReply:
    return PrefillReply("r", 1, "", None, handle, 0, 1)


@settings(max_examples=300, deadline=None)
@given(broken_bodies(handles().map(_with_handle), HANDLE_FIELDS, values, inside="kv_handle"))
def test_a_broken_handle_field_fails_as_in_the_codec(raw: bytes) -> None:
    same_outcome(raw)


def test_not_json_fails_as_in_the_codec() -> None:
    for raw in (b"", b"{", b"[]", b"null", b'{"type": "prefill_reply"} x', b"\xff{}"):
        same_outcome(raw)
