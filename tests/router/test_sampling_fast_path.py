"""``SamplingParams.validate``'s one-expression fast path (``_common_ok``) never accepts what
the field-by-field checks refuse: a property test over numbers at and around every bound,
of every plain type, and a guard that a new field cannot slip past it unnamed."""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.protocol import sampling_params as sp_mod
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams

pytestmark = pytest.mark.unit

BOUNDS = [-(2**63), -2.0, -1, 0, 1, 2.0, 10.0, 20, 100.0, 4096, 2**31, 2**32, 2**63, 2**64]
# Each bound, just inside and just outside it, as an int and as a float.
_NEAR = [
    v
    for b in BOUNDS
    for v in (
        b,
        float(b),
        math.nextafter(b, -math.inf),
        math.nextafter(b, math.inf),
        b - 1,
        b + 1,
        b - 0.5,
        b + 0.5,
    )
]
# Deduplicated by type and value: -2 and -2.0 are equal, but only one is an int.
EDGES = [*{(type(v), v): v for v in _NEAR}.values(), math.inf, -math.inf, math.nan]
ODD = [None, True, False, "1", [], {}, [1], {"1": 2.0}, ["x"], {"type": "json"}]
VALUES = st.one_of(
    st.sampled_from(EDGES),
    st.sampled_from(ODD),
    st.integers(-(2**65), 2**65),
    st.floats(allow_nan=True, allow_infinity=True),
)
FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def _slow(p: SamplingParams) -> bool:
    """The full checks' verdict: validate with the fast path switched off."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sp_mod, "_common_ok", lambda _p: False)
        try:
            p.validate()
        except (InvalidParameter, TypeError, ValueError, OverflowError):
            return False
    return True


@settings(max_examples=3000, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=3))
def test_the_fast_path_accepts_only_what_the_full_checks_accept(changes: dict[str, Any]) -> None:
    p = SamplingParams(**changes)
    if sp_mod._common_ok(p):
        assert _slow(p), changes


@pytest.mark.parametrize("name", FIELDS)
def test_each_field_at_each_edge_alone(name: str) -> None:
    """Every field set alone to every edge value (each bound, just inside and just outside
    it, as int and float; odd types): deterministic, where the property test samples."""
    for value in [*EDGES, *ODD]:
        p = SamplingParams(**{name: value})
        if sp_mod._common_ok(p):
            assert _slow(p), (name, value)


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_is_named_by_the_fast_path(name: str) -> None:
    """A field added to SamplingParams (with its own check) must be added to _common_ok
    too, or _common_ok would wave it through unchecked."""
    assert f"p.{name}" in inspect.getsource(sp_mod._common_ok), name


def test_the_fast_path_takes_the_defaults_and_a_typical_request() -> None:
    assert sp_mod._common_ok(SamplingParams())
    assert sp_mod._common_ok(SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1))
