"""The OpenAI completion bodies the benches send."""

from __future__ import annotations

from typing import Any


def greedy_stream(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streamed completion of ``prompt``: greedy, exactly ``max_tokens`` tokens (EOS
    ignored), with the usage in its last chunk."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
