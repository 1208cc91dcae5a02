"""Fixtures of the engine tests (helpers live in engine_helpers.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import tiny_config
from family_matrix import SERVED, Served, reference

from pdserve.engine.llm_engine import LLMEngine
from tests.model_families import Family, cached_family


@pytest.fixture(autouse=True)
def _default_dynamo_stance() -> Iterator[None]:
    """The engine trims dynamo's guard checks process-wide once its one compiled model is
    warm (engine/compiled.py); a later test's own torch.compile in this process would then
    raise "Recompilation triggered with skip_guard_eval_unsafe stance". Which tests share
    a process depends on xdist's timing, so each test leaves the stance as it found it."""
    yield
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never loaded: nothing set
    if eval_frame is not None and eval_frame._is_skip_guard_eval_unsafe_stance():
        torch.compiler.set_stance("default", skip_guard_eval_unsafe=False)


@pytest.fixture
def make_engine(tiny_model_dir: Path) -> Iterator[Callable[..., LLMEngine]]:
    """``make_engine(num_blocks=..., **config)``: an LLMEngine on the tiny model, float32 CPU."""

    def make(num_blocks: int = 256, **overrides: Any) -> LLMEngine:
        engine = LLMEngine(tiny_config(tiny_model_dir, num_blocks, **overrides))
        assert engine.kv.num_blocks == num_blocks
        return engine

    yield make


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


@pytest.fixture(scope="module")
def family_dir(tiny_model_dir: Path) -> Callable[[Family], Path]:
    """A family's model directory (family_matrix.py), built once a module (and cached on
    disk across sessions: tests/model_families.py)."""
    dirs: dict[str, Path] = {}

    def get(family: Family) -> Path:
        if family.id not in dirs:
            dirs[family.id] = cached_family(family, tiny_model_dir)
        return dirs[family.id]

    return get


@pytest.fixture(params=SERVED, ids=[f.id for f in SERVED])
def served(request: pytest.FixtureRequest, family_dir: Callable[[Family], Path]) -> Served:
    """Each served family of the matrix with transformers' greedy tokens for its prompts."""
    model_dir = family_dir(request.param)
    return Served(request.param, model_dir, reference(model_dir))
