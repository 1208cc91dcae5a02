"""``pdserve up --lora NAME=PATH``: every worker and the router get the adapter, its path
absolute; a bad value stops ``up`` before any process starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.local.up import add_arguments, router_args, worker_args

pytestmark = pytest.mark.unit


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_lora_goes_to_workers_and_router(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sql").mkdir()
    monkeypatch.chdir(tmp_path)
    args = _args("--lora", "sql=sql", "--lora", f"chat={tmp_path}", "--worker-arg=--max-loras=2")
    want = ["--lora", f"sql={tmp_path / 'sql'}", "--lora", f"chat={tmp_path}"]
    assert list(worker_args(args)) == [*want, "--max-loras=2"]
    assert router_args(args)[2:6] == want


@pytest.mark.parametrize("value", ["sql", "=x", "sql=/no/such/dir"])
def test_bad_lora_is_refused(value: str) -> None:
    with pytest.raises(SystemExit, match="--lora"):
        worker_args(_args("--lora", value))
