"""Workers compile the forward unless told not to: ``--enforce-eager`` or the env var.

The compiled path itself (outputs, no compile after the warm-up) is tested in
test_fidelity.py::test_compiled_forward.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.engine.config import add_engine_arguments, engine_config_from_args
from pdserve.local.processes import ClusterSpec, LocalCluster


def _config(argv: list[str]) -> bool:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(["--model", "m", *argv])).compile


def test_compile_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    assert _config([]) is True
    assert _config(["--enforce-eager"]) is False


@pytest.mark.parametrize(("value", "compiled"), [("1", False), ("0", True), ("", True)])
def test_env_forces_eager(monkeypatch: pytest.MonkeyPatch, value: str, compiled: bool) -> None:
    monkeypatch.setenv("PDSERVE_ENFORCE_EAGER", value)
    assert _config([]) is compiled


def test_up_passes_enforce_eager_to_every_worker(tmp_path: Path) -> None:
    from pdserve.local import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path), "--enforce-eager"])
    spec = ClusterSpec(model_dir=str(tmp_path), num_prefill=1, num_decode=1,
                       worker_args=up.worker_args(args), log_dir=str(tmp_path))  # fmt: skip
    assert "--enforce-eager" in LocalCluster(spec)._common("decode-0", 8900)
    assert up.worker_args(parser.parse_args(["--model", str(tmp_path)])) == ()
