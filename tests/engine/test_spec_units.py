"""The n-gram proposer, the per-request draft back-off and the config's parse, alone."""

from __future__ import annotations

import pytest

from pdserve.engine.ngram_proposer import NgramProposer
from pdserve.engine.spec_config import SpecConfig, parse_speculative
from pdserve.engine.spec_decode import PAUSE_STEPS, Backoff

pytestmark = pytest.mark.unit


def test_ngram_longest_match_most_recent_first() -> None:
    p = NgramProposer(k=3, min_n=1, max_n=3)
    # "1 2 3" occurs twice: the most recent earlier occurrence is followed by 7 8 9.
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 0, 2, 3]) == [7, 8, 9]
    # No 3-gram or 2-gram match, a 1-gram one: the token after the last earlier 5.
    assert p.propose([5, 6, 9, 5, 4, 5]) == [4, 5]
    assert p.propose([5, 6, 9, 5, 4, 5], k=1) == [4]
    assert NgramProposer(k=3, min_n=2, max_n=3).propose([5, 6, 9, 5, 4, 5]) == []
    assert p.propose([1]) == [] and p.propose([1, 1]) == [1]
    assert p.propose([4, 4, 4, 4]) == [4]  # the match may overlap the suffix


def test_backoff_halves_pauses_and_grows_back() -> None:
    b = Backoff(4)
    b.after(4, 0, 4)
    assert (b.k, b.pause) == (2, 0)
    b.after(2, 0, 4)
    b.after(1, 0, 4)
    assert (b.k, b.pause) == (1, PAUSE_STEPS)
    b.after(1, 1, 4)
    b.after(2, 2, 4)
    b.after(4, 4, 4)
    assert b.k == 4
    b.after(4, 2, 4)  # some accepted: unchanged
    assert b.k == 4


def test_parse() -> None:
    assert parse_speculative("ngram:k=4") == SpecConfig("ngram", 4, 2, 4)
    assert parse_speculative("ngram:k=2, min_n=1, max_n=5") == SpecConfig("ngram", 2, 1, 5)
    assert parse_speculative("ngram") == SpecConfig("ngram")
    assert parse_speculative(None) is None and parse_speculative("off") is None
    with pytest.raises(ValueError, match="min_n <= max_n"):
        parse_speculative("ngram:min_n=3,max_n=2")
    with pytest.raises(ValueError, match="key=value"):
        parse_speculative("ngram:k")
