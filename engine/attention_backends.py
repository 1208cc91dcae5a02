"""One attention interface, three back-ends, chosen by device or by name.

``engine/attention.py`` is the one function transformers calls; what reads the pool
behind it is one of these, picked once per model runner:

========  =====================================  ==================================
name      runs                                   default where
========  =====================================  ==================================
cpu       the C++ kernel (paged_attention.cpp)   CPU, with a compiler
triton    the Triton kernels (triton_attention)  CUDA (CPU under TRITON_INTERPRET=1)
gather    gather blocks + SDPA, the reference    never by default; on request
========  =====================================  ==================================

``PDSERVE_ATTENTION_BACKEND`` (or the ``requested`` argument) names one; an unknown
name lists the valid ones, and a named back-end that cannot run here says why. Without
a name the device's default is used, falling back to the gather path (with a warning)
where its default cannot run (no compiler, no triton, a head layout it does not take).
Every back-end honours every per-layer option (window, soft-cap, sinks): the model is
refused at load otherwise (``model_support``), never served wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve import env

if TYPE_CHECKING:
    from pdserve.engine.model_support import LayerAttention
    from pdserve.engine.triton_attention import TritonMetadata

logger = logging.getLogger(__name__)

CPU, TRITON, GATHER = "cpu", "triton", "gather"


@dataclass(frozen=True)
class AttentionShape:
    """What a back-end needs to know to say whether it runs a model here."""

    device: torch.device
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


def _cpu_problem(s: AttentionShape) -> str | None:
    from pdserve.engine import cpu_kernel

    if s.device.type != "cpu":
        return f"the C++ kernel reads CPU memory only (device {s.device.type})"
    if not cpu_kernel.supports(s.dtype, s.num_heads, s.num_kv_heads, s.head_dim):
        return f"the C++ kernel takes float32/bfloat16, GQA groups <= 8, head_dim <= 256 ({s})"
    if cpu_kernel.load() is None:
        return f"no C++ compiler, or {env.CPU_KERNEL}=0"
    return None


def _triton_problem(s: AttentionShape) -> str | None:
    try:
        from pdserve.engine import triton_attention
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    if s.device.type == "cpu" and not triton_attention.interpreted():
        return "CPU tensors run only in triton's interpreter: set TRITON_INTERPRET=1 before start"
    if s.device.type not in ("cpu", "cuda"):
        return f"no triton target for device {s.device.type}"
    if not triton_attention.supports(s.block_size, s.num_heads, s.num_kv_heads, s.head_dim):
        widest = triton_attention.MAX_HEAD_DIM
        return f"the kernels take power-of-two blocks >= 16, 16 <= head_dim <= {widest} ({s})"
    return None


def _no_problem(_s: AttentionShape) -> str | None:
    return None


# name -> why it cannot run a model here (None: it can). Imports stay inside the checks.
BACKENDS: dict[str, Callable[[AttentionShape], str | None]] = {
    CPU: _cpu_problem,
    TRITON: _triton_problem,
    GATHER: _no_problem,
}
DEVICE_DEFAULTS = {"cpu": CPU, "cuda": TRITON}


def kernel_deferred(shape: AttentionShape) -> bool:
    """Whether the device's default is the C++ kernel, which could run this model but is
    not built yet (no back-end requested): the caller may serve with the gather path and
    build it in the background."""
    from pdserve.engine import cpu_kernel

    if env.get(env.ATTENTION_BACKEND) or DEVICE_DEFAULTS.get(shape.device.type) != CPU:
        return False
    s = shape
    return cpu_kernel.supports(s.dtype, s.num_heads, s.num_kv_heads, s.head_dim) and (
        cpu_kernel.needs_build()
    )


def choose(shape: AttentionShape, requested: str | None = None) -> str:
    """The back-end's name: ``requested``, else ``PDSERVE_ATTENTION_BACKEND``, else the
    device's default (the gather path where that cannot run)."""
    name = requested or env.get(env.ATTENTION_BACKEND)
    if name:
        if name not in BACKENDS:
            valid = ", ".join(sorted(BACKENDS))
            raise ValueError(f"unknown attention back-end {name!r}; valid: {valid}")
        problem = BACKENDS[name](shape)
        if problem is not None:
            raise ValueError(f"attention back-end {name!r} cannot run here: {problem}")
        return name
    default = DEVICE_DEFAULTS.get(shape.device.type, GATHER)
    problem = BACKENDS[default](shape)
    if problem is None:
        return default
    if default != CPU:  # a CPU without a compiler is common and logged by cpu_kernel
        logger.warning("attention: %s unavailable (%s); using the gather path", default, problem)
    return GATHER


# --- the Triton back-end's two calls (the step's metadata, one layer's attention) ---------


def triton_metadata(
    spans: Sequence[tuple[int, int, Sequence[int]]],  # (tokens before, tokens, blocks) per chunk
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    device: torch.device,
) -> TritonMetadata:
    from pdserve.engine import triton_attention

    blocks = [ids[: -(-(start + n) // block_size)] for start, n, ids in spans]
    chunks = [(start, n) for start, n, _ in spans]
    return triton_attention.step_metadata(chunks, blocks, num_heads, num_kv_heads, device)


def run_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_new: torch.Tensor,  # [T, Hkv, D]
    v_new: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    meta: TritonMetadata,
    block_size: int,
    scaling: float,
    opts: LayerAttention,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Writes the new K/V into the pool and attends in place; returns [T, Hq, D]."""
    from pdserve.engine import triton_attention

    if k_new.stride(2) != 1 or v_new.stride(2) != 1:
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    triton_attention.store_kv(k_new, v_new, k_cache, v_cache, slot_mapping)
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    sink32 = sinks.detach().float().contiguous() if opts.sinks and sinks is not None else None
    triton_attention.paged_attention(
        q,
        k_cache,
        v_cache,
        out,
        meta,
        block_size,
        scaling,
        window=opts.window,
        softcap=opts.softcap,
        sinks=sink32,
    )
    return out
