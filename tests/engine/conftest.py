"""Fixtures of the engine tests (helpers live in engine_helpers.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import tiny_config

from pdserve.engine.llm_engine import LLMEngine


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
