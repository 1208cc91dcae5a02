"""The CPU grammar mask (engine/structured.py ``_apply_cpu``) equals xgrammar's own kernel."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.structured import _apply_cpu

pytestmark = pytest.mark.unit


def _random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    return torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(
        torch.int32
    )


@pytest.mark.parametrize("vocab", [8192, 3072, 3000])  # whole words and a partial last word
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [0], [2]])
def test_the_mask_equals_xgrammars_kernel(vocab: int, rows: list[int]) -> None:
    import xgrammar as xgr

    bitmask = _random_bitmask(4, vocab, seed=vocab + len(rows))
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    ours, theirs = logits.clone(), logits.clone()
    _apply_cpu(ours, bitmask[:4], rows)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=rows)
    assert torch.equal(ours, theirs)
    untouched = [r for r in range(4) if r not in rows]
    assert torch.equal(ours[untouched], logits[untouched])  # other rows keep their logits
    # Not a no-op: about half of each masked row's tokens are now -inf (random bits).
    banned = torch.isinf(ours[rows]).float().mean().item()
    assert 0.4 < banned < 0.6


def test_tokens_past_the_bitmask_are_masked() -> None:
    """A model vocabulary padded past the grammar's: the extra ids are never allowed."""
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)  # 64 tokens, all allowed
    logits = torch.zeros(2, 80)
    _apply_cpu(logits, bitmask, [0, 1])
    assert torch.isinf(logits[:, 64:]).all() and not torch.isinf(logits[:, :64]).any()
