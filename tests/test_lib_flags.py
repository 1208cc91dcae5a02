"""bench/lib/flags.py: the flags of a bench written as data parse as the long form did."""

from __future__ import annotations

import argparse

import pytest
from lib import flags

pytestmark = pytest.mark.unit


def _parser() -> argparse.ArgumentParser:
    p = flags.parser("A bench.\n\nMore.", "a short run")
    flags.add_ints(p, batch=16, prompt_len=(32, 512))
    flags.add_options(
        p,
        eager=(False, "a switch"),
        real_model=("", "a string"),
        tol=(0.15, "a float"),
        macs=(1 << 19, "an int"),
        hbm_gbps=(float, "a float, None when not given"),
    )
    return p


def test_defaults_and_kinds() -> None:
    args = _parser().parse_args([])
    assert vars(args) == {
        "quick": False,
        "batch": 16,
        "prompt_len": [32, 512],
        "eager": False,
        "real_model": "",
        "tol": 0.15,
        "macs": 1 << 19,
        "hbm_gbps": None,
    }
    given = ["--eager", "--real-model", "m", "--tol", "0.5", "--macs", "7", "--hbm-gbps", "3350"]
    args = _parser().parse_args([*given, "--prompt-len", "1", "2"])
    assert (args.eager, args.real_model, args.tol, args.macs) == (True, "m", 0.5, 7)
    assert args.hbm_gbps == 3350.0 and args.prompt_len == [1, 2]


def test_a_value_of_the_wrong_kind_is_refused_by_name(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--macs", "1.5"])
    assert "--macs: invalid int value: '1.5'" in capsys.readouterr().err


def test_help_carries_each_line() -> None:
    text = _parser().format_help()
    assert "A bench." in text and "a float, None when not given" in text
