"""The tiny model's engine configuration, for the engine tests and the benches that run a
real engine on CPU (bench/chaos_isolation.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve.engine.config import EngineConfig

# The tiny model's block: 4 layers * K/V * 16 tokens * 2 KV heads * 32 dims * 4 bytes.
TINY_BLOCK_BYTES = 4 * 2 * 16 * 2 * 32 * 4


def tiny_config(model_dir: Path, num_blocks: int = 256, **overrides: Any) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=num_blocks * TINY_BLOCK_BYTES,
        **overrides,
    )
