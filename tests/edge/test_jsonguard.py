"""pdserve.jsonguard: the JSON decoding both the router and the workers use."""

from __future__ import annotations

import pytest

from pdserve.jsonguard import MAX_JSON_DEPTH, BadJSON, loads_checked


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
    [b"null", b"5", b'"s"', b'{"a": ' + b"[" * 31 + b"]" * 31 + b"}",
     '{"t": "héllo 😀 \\ud83d\\ude00"}'.encode(),  # a surrogate *pair* is one character
     b'{"prompt": "NaN Infinity", "x": 1e308, "y": -0.0}'],  # the words in text, real numbers
)  # fmt: skip
def test_accepted(raw: bytes) -> None:
    loads_checked(raw)
