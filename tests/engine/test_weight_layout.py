"""Which linear weights the compiled path stores input-major (engine/compiled.py)."""

from __future__ import annotations

import torch

from pdserve.engine.compiled import transpose_linear_weights


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 12, bias=False))
    return m.to(dtype)


def test_float32_linears_become_input_major_and_compute_the_same() -> None:
    m = _model(torch.float32)
    x = torch.tensor([[1, 2, 3]])
    before = m(x)
    transpose_linear_weights(m)
    w = m[1].weight
    assert w.shape == (12, 8) and w.stride() == (1, 12)  # [in, out] in memory
    torch.testing.assert_close(m(x), before)


def test_bfloat16_linears_keep_their_layout() -> None:
    """oneDNN's bfloat16 GEMM is slower on input-major weights (measured: compiled.py)."""
    m = _model(torch.bfloat16)
    ptr = m[1].weight.data_ptr()
    transpose_linear_weights(m)
    assert m[1].weight.stride() == (8, 1) and m[1].weight.data_ptr() == ptr


def test_a_weight_shared_with_an_embedding_is_left_alone() -> None:
    m = _model(torch.float32)
    m[1] = torch.nn.Linear(8, 10, bias=False)
    m[1].weight = m[0].weight  # tied, as lm_head and embed_tokens may be
    transpose_linear_weights(m)
    assert m[1].weight.stride() == (8, 1) and m[1].weight is m[0].weight
