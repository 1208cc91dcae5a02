"""Workers compile the forward unless told not to: ``--enforce-eager`` or the env var.

The compiled path itself (outputs, no compile after the warm-up) is tested in
test_fidelity.py::test_compiled_forward.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_all_free

from pdserve.engine.engine_args import add_engine_arguments, engine_config_from_args
from pdserve.engine.llm_engine import LLMEngine
from pdserve.local.processes import ClusterSpec, LocalCluster
from pdserve.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.cluster


def _config(argv: list[str]) -> bool:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(["--model", "m", *argv])).compile


def test_compile_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    assert _config([]) is True
    assert _config(["--enforce-eager"]) is False


def test_workers_compile_in_the_background_unless_told_to_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's core serves eager and compiles in the background (engine/compile_job.py);
    ``--compile-before-ready`` waits; in-process engines (generate, profile) compile first."""
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)

    def config(*argv: str, background: bool) -> tuple[bool, bool]:
        args = parser.parse_args(["--model", "m", *argv])
        c = engine_config_from_args(args, background=background)
        return c.compile, c.compile_in_background

    assert config(background=True) == (True, True)
    assert config("--compile-before-ready", background=True) == (True, False)
    assert config(background=False) == (True, False)


@pytest.mark.parametrize(("value", "compiled"), [("1", False), ("0", True), ("", True)])
def test_env_forces_eager(monkeypatch: pytest.MonkeyPatch, value: str, compiled: bool) -> None:
    monkeypatch.setenv("PDSERVE_ENFORCE_EAGER", value)
    assert _config([]) is compiled


def test_up_passes_enforce_eager_to_every_worker(tmp_path: Path) -> None:
    from pdserve.local import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path), "--enforce-eager"])
    spec = ClusterSpec(
        model_dir=str(tmp_path),
        num_prefill=1,
        num_decode=1,
        worker_args=up.worker_args(args),
        log_dir=str(tmp_path),
    )
    assert "--enforce-eager" in LocalCluster(spec)._common("decode-0", 8900)
    assert up.worker_args(parser.parse_args(["--model", str(tmp_path)])) == ()


def test_failed_compile_falls_back_to_eager(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No compiler or an inductor bug must cost speed, not the worker."""
    from pdserve.engine import compiled, model_runner

    def broken(model: torch.nn.Module) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("inductor: no C++ compiler found")

        return forward

    monkeypatch.setattr(model_runner.compiled, "compiled_forward", broken)
    assert model_runner.compiled is compiled
    engine = make_engine(num_blocks=64, compile=True)
    assert not engine.runner.compiled and engine.runner.forward is engine.runner.model
    assert_all_free(engine)
    assert not engine.requests and engine.stats().prompt_tokens == 0
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eager = make_engine(num_blocks=64)
    prompts = [[5, 6, 7, 8], [9] * 20]
    assert engine.generate(prompts, params) == eager.generate(prompts, params)
    assert_all_free(engine)
