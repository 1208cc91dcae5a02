"""What both roles' cores report about their engine (``/stats``' fixed fields)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine


def engine_info(e: LLMEngine) -> dict[str, Any]:
    """What the front end reports about the engine (``/stats``' fixed fields)."""
    return {
        "model": e.served_model_name,
        "model_id": e.model_id,
        "block_size": e.config.block_size,
        "max_model_len": e.max_model_len,
        "core_pid": os.getpid(),
    }
