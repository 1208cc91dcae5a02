"""transformers' own greedy generation: the reference the engine's tokens are compared with."""

from __future__ import annotations

from typing import Any

import torch


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy generate of ``prompt`` on the model's device, forced to exactly
    ``max_tokens`` new tokens."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            # No EOS: generation never stops early and EOS is never masked, like ignore_eos.
            eos_token_id=None,
            pad_token_id=model.config.pad_token_id,
        )
    return [int(t) for t in out[0, len(prompt) :].tolist()]
