"""The Triton attention kernels compiled for an H100/H200 (sm_90) with no GPU here:
``triton.compile`` to a ``GPUTarget`` runs the whole pipeline down to ptxas, and
cuobjdump (shipped with triton) reads the cubin's registers and stack per thread. A
kernel that spills is slow on the GPU day; one that does not compile fails there."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.engine import triton_attention as ta

SM90 = GPUTarget("cuda", 90, 32)
DATA = ("q_ptr", "k_ptr", "v_ptr", "o_ptr")
FLOAT32 = ("part_ptr", "sinks_ptr")


def _signature(fn: Any, consts: dict[str, Any], dtype: str) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}" if name in DATA else "*fp32" if name in FLOAT32 else "*i32"
        else:
            sig[name] = "fp32" if name in ("scale", "softcap") else "i32"
    return sig


def wide_usage(heads: int, decode: bool, head_dim: int = 576) -> dict[str, int]:
    """``_attention`` at one KV head of a wide ``head_dim`` for ``heads`` query heads, as
    ``paged_attention`` launches it (bfloat16, decode tiles split or 64-row prefill tiles):
    registers and stack bytes per thread, warps."""
    block_g = ta.group_rows(heads, 1)
    block_q = 1 if decode else max(1, ta.PREFILL_ROWS // block_g)
    block_m = max(ta.DECODE_ROWS, block_q * block_g)
    consts = {
        "G": heads,
        "BLOCK_G": block_g,
        "BLOCK_Q": block_q,
        "BLOCK_M": block_m,
        "D": head_dim,
        "CHUNK_D": ta.CHUNK_D,
        "CHUNKS": triton.cdiv(head_dim, ta.CHUNK_D),
        "BLOCK_SIZE": 16,
        "HAS_SOFTCAP": False,
        "HAS_SINKS": False,
        "PRECISION": "tf32",
        "SPLITS": 4 if decode else 1,
    }
    fn = ta._attention
    names = fn.arg_names
    src = ASTSource(
        fn=fn,
        signature=_signature(fn, consts, "bf16"),
        constexprs={(names.index(k),): v for k, v in consts.items()},
    )
    warps = ta.wide_warps(block_m)
    kernel = triton.compile(src, target=SM90, options={"num_warps": warps})
    return {**_resources(kernel.asm["cubin"]), "warps": warps, "block_m": block_m}


def _resources(cubin: bytes) -> dict[str, int]:
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    assert found, out
    return {"registers": int(found.group(1)), "stack": int(found.group(2))}
