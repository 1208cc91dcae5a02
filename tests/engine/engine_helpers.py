"""Engine test helpers: engine configs on the tiny model, the leak check, the HF reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.tiny_engine import TINY_BLOCK_BYTES as TINY_BLOCK_BYTES
from pdserve.testing.tiny_engine import tiny_config as tiny_config


def assert_all_free(target: LLMEngine | BlockManager) -> None:
    """Every KV block is free again (cached-but-unowned blocks count as free)."""
    if not isinstance(target, LLMEngine):
        assert target.num_free_blocks == target.num_blocks, (
            f"{target.num_blocks - target.num_free_blocks} KV blocks still owned"
        )
        assert all(b.ref_count == 0 for b in target.blocks)
    else:
        assert target.kv.all_free, f"{target.kv.num_used_blocks} KV blocks still owned"
        assert not target.requests and not target.held
        assert not target.scheduler.has_work


def family_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    """A model family's engine on CPU in float32, with a 4 MiB KV pool (its block size
    depends on the family's layers)."""
    return EngineConfig(
        model=str(model_dir), dtype="float32", device="cpu", kv_cache_bytes=4 << 20, **overrides
    )


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[Any] = field(default_factory=list)
    num_deltas: int = 0


def run_requests(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, Result]:
    """Add every request, step to completion, and gather each request's outputs (logprobs
    too)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    results = {rid: Result() for rid in requests}
    while engine.has_work:
        for out in engine.step():
            r = results[out.request_id]
            assert r.finish_reason is None, "output after the finish"
            assert out.logprobs is None or len(out.logprobs) == len(out.token_ids)
            r.token_ids += out.token_ids
            r.text += out.text
            r.finish_reason = out.finish_reason
            r.logprobs += out.logprobs or []
            r.num_deltas += 1
    return results
