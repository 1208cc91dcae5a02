"""codec.encode through orjson (pdserve/protocol/fast_dumps.py): every message reads back
as json.dumps' bytes would, and a NaN or an infinity, which orjson would write as null,
goes through json instead."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.protocol.codec import decode, encode, to_dict
from pdserve.protocol.contract import (
    GenerateRequest,
    KVHandle,
    LoraRef,
    PrefillReply,
    PrefillRequest,
)
from pdserve.protocol.fast_dumps import dumps, finite_tree
from pdserve.protocol.prefill_reply import decode_prefill_reply
from pdserve.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def _json(body: object) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _same(msg: object) -> None:
    """encode(msg) reads back as json's bytes (NaN compared as NaN)."""
    got, want = json.loads(encode(msg)), json.loads(_json(to_dict(msg)))
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


finite = st.floats(allow_nan=False, allow_infinity=False)
any_float = st.floats(allow_nan=True, allow_infinity=True)
text = st.text(max_size=12)  # lone surrogates included: orjson refuses them, json writes them
big_or_small = st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(-(2**80), 2**80))
json_like = st.recursive(
    st.none() | st.booleans() | big_or_small | any_float | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    sp=st.builds(
        SamplingParams,
        temperature=any_float,
        top_p=finite,
        logit_bias=st.dictionaries(st.integers(0, 2**40), any_float, max_size=3),
        structured=st.none() | st.dictionaries(text, json_like, max_size=3),
        seed=st.none() | big_or_small,
        stop=st.lists(text, max_size=2),
    ),
    ids=st.lists(big_or_small, max_size=8),
)
def test_worker_messages_read_back_as_json_writes_them(sp: SamplingParams, ids: list[int]) -> None:
    """Sampling parameters as any caller may build them (unvalidated: NaN, infinities,
    integers past 64 bits, lone surrogates, int keys): the bytes always mean what json's
    mean."""
    _same(PrefillRequest("r", ids, sp, "salt", LoraRef("a", None)))
    handle = KVHandle("r", "agent", "tcp://127.0.0.1:1", [0], 1, [], 16, "n", sp.temperature)
    _same(GenerateRequest("r", ids, sp, handle, 3))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_float_is_written_by_json(bad: float) -> None:
    """orjson writes NaN as null; the codec must not: the worker reads it back as NaN."""
    cases = [
        PrefillRequest("r", [1], SamplingParams(temperature=bad)),
        PrefillRequest("r", [1], SamplingParams(logit_bias={5: bad})),
        PrefillRequest("r", [1], SamplingParams(structured={"schema": {"maximum": [bad]}})),
        GenerateRequest(
            "r", [1], SamplingParams(), KVHandle("r", "a", "tcp://h:1", [0], 1, [], 16, "n", bad)
        ),
    ]
    for msg in cases:
        raw = encode(msg)
        assert b"NaN" in raw or b"Infinity" in raw, raw
        _same(msg)


def test_the_hot_messages_take_orjson() -> None:
    """The router's two worker messages, validated, are written by orjson (UTF-8 text is
    not escaped, as json would): the fast path is the one taken."""
    sp = SamplingParams(max_tokens=4, logit_bias={3: 1.5}).validate()
    hashes = [2**127 + 5, 2**100, 7]  # block hashes are 128-bit: past what orjson writes
    handle = KVHandle("é", "a", "tcp://h:1", [0, 1, 2], 48, hashes, 16, "n", 30.0)
    reply = encode(PrefillReply("é", 5, "x", None, handle, 0, 48))
    read = decode_prefill_reply(reply).kv_handle  # the router's: it keeps the body it read
    assert read is not None
    for msg in (
        PrefillRequest("é", [1, 2], sp),
        GenerateRequest("é", [1, 2], sp),
        GenerateRequest("é", [1, 2], sp, handle, 5),
        GenerateRequest("é", [1, 2], sp, read, 5),
    ):
        raw = encode(msg)
        assert "é".encode() in raw and b"\\u00e9" not in raw, raw
        assert decode(raw) == msg
        _same(msg)


def test_dumps_falls_back_where_orjson_refuses() -> None:
    body = {"big": 2**70, "lone": "\ud800", "keys": {1: 2.5}}
    assert json.loads(dumps(body, finite=True)) == json.loads(_json(body))
    assert dumps({"x": math.nan}, finite=False) == b'{"x":NaN}'


@settings(max_examples=200, deadline=None)
@given(json_like)
def test_finite_tree(value: object) -> None:
    assert finite_tree(value) == _no_nan(value)


def _no_nan(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(map(_no_nan, value.values()))
    if isinstance(value, list):
        return all(map(_no_nan, value))
    return True
