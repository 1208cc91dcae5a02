"""Fixtures of the worker tests (helpers live in worker_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """The single-process engine: the oracle for disaggregated outputs."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_bytes=6_000_000
    )
    return LLMEngine(cfg)
