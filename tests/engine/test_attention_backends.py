"""The attention back-end registry: chosen by device, by name, refused with reasons.

The back-ends' outputs are compared with each other in test_triton_attention.py (the
Triton one needs the interpreter, in a child process) and test_cpu_kernel.py.
"""

from __future__ import annotations

import pytest
import torch

from pdserve import env
from pdserve.engine import attention_backends as ab
from pdserve.engine import cpu_kernel, triton_attention

pytestmark = pytest.mark.unit


def _shape(device: str = "cpu", block_size: int = 16, head_dim: int = 32) -> ab.AttentionShape:
    return ab.AttentionShape(torch.device(device), torch.float32, 4, 2, head_dim, block_size)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.ATTENTION_BACKEND, raising=False)


def test_unknown_name_lists_the_valid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"'flash'; valid: cpu, gather, triton"):
        ab.choose(_shape(), "flash")
    monkeypatch.setenv(env.ATTENTION_BACKEND, "xformers")
    with pytest.raises(ValueError, match=r"'xformers'; valid: cpu, gather, triton"):
        ab.choose(_shape())


def test_device_defaults() -> None:
    # CUDA takes the Triton kernels: the check needs no GPU (triton imports on CPU).
    assert ab.choose(_shape("cuda")) == ab.TRITON
    want_cpu = ab.CPU if cpu_kernel.load() is not None else ab.GATHER
    assert ab.choose(_shape("cpu")) == want_cpu
    # A shape the Triton kernels do not take falls back to the reference path.
    assert ab.choose(_shape("cuda", block_size=8)) == ab.GATHER
    assert ab.choose(_shape("meta")) == ab.GATHER


def test_named_backend_wins_or_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ab.choose(_shape("cuda"), "gather") == ab.GATHER
    monkeypatch.setenv(env.ATTENTION_BACKEND, "gather")
    assert ab.choose(_shape("cpu")) == ab.GATHER
    with pytest.raises(ValueError, match=r"'cpu' cannot run here: .*CPU memory only"):
        ab.choose(_shape("cuda"), "cpu")
    with pytest.raises(ValueError, match="power-of-two blocks"):
        ab.choose(_shape("cuda", block_size=24), "triton")
    if not triton_attention.interpreted():  # this process: triton as the suite found it
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            ab.choose(_shape("cpu"), "triton")


def test_cuda_takes_mla_latent_width_on_triton() -> None:
    """DeepSeek's latent (512 + 64 = 576, one KV head for 128 query heads) takes the
    Triton kernels' chunked-width form on CUDA (refused before it existed: head_dim <=
    256); a head wider than the widest width tried still takes the gather path."""
    mla = ab.AttentionShape(torch.device("cuda"), torch.bfloat16, 128, 1, 576, 16)
    assert ab.choose(mla) == ab.TRITON
    too_wide = triton_attention.MAX_HEAD_DIM + 64
    assert ab.choose(ab.AttentionShape(mla.device, mla.dtype, 128, 1, too_wide, 16)) == ab.GATHER
    with pytest.raises(ValueError, match=f"16 <= head_dim <= {triton_attention.MAX_HEAD_DIM}"):
        ab.choose(ab.AttentionShape(mla.device, mla.dtype, 128, 1, too_wide, 16), "triton")
