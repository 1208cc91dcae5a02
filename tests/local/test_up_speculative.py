"""``pdserve up --speculative``: what the decode workers get. A draft model's directory is
checked before any process starts and passed absolute (the workers may resolve paths from
another directory); n-gram values pass as given."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.local.up import decode_args

pytestmark = pytest.mark.unit


def _args(value: str) -> argparse.Namespace:
    return argparse.Namespace(speculative=value)


def test_values_for_the_decode_workers(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert decode_args(_args("")) == ()
    assert decode_args(_args("ngram:k=3")) == ("--speculative", "ngram:k=3")
    monkeypatch.chdir(tiny_model_dir.parent)
    got = decode_args(_args(f"draft:model={tiny_model_dir.name},k=2"))
    assert got == ("--speculative", f"draft:model={tiny_model_dir.resolve()},k=2")


def test_a_missing_draft_model_stops_up_by_name(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--speculative: draft model .* not an HF model"):
        decode_args(_args(f"draft:model={tmp_path},k=2"))
