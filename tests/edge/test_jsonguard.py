"""pdserve.jsonguard: the JSON decoding both the router and the workers use."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.jsonguard import MAX_JSON_DEPTH, BadJSON, loads_checked

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"[" * 100_000 + b"]" * 100_000, None),  # RecursionError inside json.loads
        (b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}", "a"),
        (b'{"prompt": "a\\ud800b"}', "prompt"),
        (b'{"m": [{"content": "x\\uDFFFy"}]}', "m"),
        (b'{"k\\udbff": 1}', "k\\udbff"),
        (b"\xff\xfe{}", None),
        (b'{"a": 1', None),
        # not JSON (RFC 8259), though json.loads takes them: a schema bound or a bias that
        # is no number would reach the workers
        (b'{"temperature": NaN}', "temperature"),
        (
            b'{"response_format": {"json_schema": {"schema": {"maximum": Infinity}}}}',
            "response_format",
        ),
        (b'{"model": "m", "logit_bias": {"5": [1, -Infinity]}}', "logit_bias"),
        (b"[NaN]", None),
    ],
)
def test_refused(raw: bytes, field: str | None) -> None:
    with pytest.raises(BadJSON) as err:
        loads_checked(raw)
    assert str(err.value)
    if field is not None and "\\" not in field:
        assert err.value.field == field


@pytest.mark.parametrize(
    "raw",
    [
        b"null",
        b"5",
        b'"s"',
        b'{"a": ' + b"[" * 31 + b"]" * 31 + b"}",
        '{"t": "héllo 😀 \\ud83d\\ude00"}'.encode(),  # a surrogate *pair* is one character
        b'{"prompt": "NaN Infinity", "x": 1e308, "y": -0.0}',
    ],  # the words in text, real numbers
)
def test_accepted(raw: bytes) -> None:
    loads_checked(raw)


_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(_plain, st.sampled_from(["utf-8", "utf-16", "utf-32", "utf-16-le"]))
def test_reads_what_json_loads_reads(value: object, encoding: str) -> None:
    """One decoder kept for every body reads bytes in every encoding json.loads takes."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        raw = text.encode(encoding)
    except UnicodeEncodeError:  # a lone surrogate: refused either way, tested above
        return
    try:
        want = json.loads(raw)
    except ValueError:
        with pytest.raises(BadJSON):
            loads_checked(raw)
        return
    if "\\ud" in text.lower() or any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        return
    assert loads_checked(raw) == want
