"""Fixtures of the engine tests (helpers live in engine_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import tiny_config

from pdserve.engine.llm_engine import LLMEngine


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
