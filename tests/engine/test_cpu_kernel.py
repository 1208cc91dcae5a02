"""The CPU paged-attention kernel against the gather path (the reference).

One step mixes decodes of different context lengths, a continuing prefill chunk
and a fresh prefill over a pool whose blocks are scattered; both paths run the
same attention call and must agree, in float32 and bfloat16, with and without
grouped-query heads, on one thread and two.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import attention as A
from pdserve.engine import cpu_kernel
from pdserve.engine.kv_pool import KVPool, KVShape
from pdserve.engine.model_runner import ModelRunner, ScheduledChunk
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

BS = 16
pytestmark = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C++ compiler here")


class _Layer(torch.nn.Module):
    layer_idx = 0


def _runner(pool: KVPool, kernel: bool) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.device, runner.dtype = BS, torch.device("cpu"), pool.shape.dtype
    runner.num_layers, runner.num_kv_heads = 1, pool.shape.num_kv_heads
    runner.head_dim, runner.decode_group_rows = pool.shape.head_dim, 8
    runner._gather_buffer, runner.use_kernel, runner.pool = None, kernel, pool
    return runner


def _chunks(rng: random.Random, num_blocks: int) -> list[ScheduledChunk]:
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    chunks = []
    # (context before the step, tokens this step): decodes, a continuing chunk, a fresh one
    for i, (done, n) in enumerate([(0, 1), (1, 1), (15, 1), (16, 1), (200, 1), (77, 1),
                                   (40, 23), (0, 30)]):  # fmt: skip
        total = done + n
        req = Request(f"r{i}", [5] * total, SamplingParams())
        req.block_ids = [free.pop() for _ in range(-(-total // BS))]
        req.num_computed_tokens = done
        chunks.append(ScheduledChunk.of(req, n))
    return chunks


def _attend(runner: ModelRunner, chunks: list[ScheduledChunk], q, k, v) -> torch.Tensor:  # type: ignore[no-untyped-def]
    _ids, _pos, slots, _rows = runner._flatten(chunks)
    A.CURRENT.pool, A.CURRENT.meta = runner.pool, runner._metadata(chunks, slots)
    try:
        out, _ = A.paged_attention(_Layer(), q, k, v, None, scaling=q.shape[-1] ** -0.5)
    finally:
        A.CURRENT.pool = A.CURRENT.meta = None
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "threads"), [(4, 2, 32, 1), (8, 8, 64, 2), (6, 1, 16, 1)]
)
def test_kernel_matches_gather(dtype: torch.dtype, hq: int, hkv: int, d: int, threads: int) -> None:
    rng = random.Random(hq * 100 + d)
    torch.manual_seed(hq * 100 + d)
    shape = KVShape(1, hkv, d, BS, dtype)
    pools = [KVPool(shape, 64, torch.device("cpu")) for _ in range(2)]
    history = torch.randn(pools[0].tensor.shape).to(dtype)  # earlier steps' K/V
    chunks = _chunks(rng, 64)
    t = sum(c.num_tokens for c in chunks)
    # A transposed query, as transformers hands it over: [1, Hq, T, D] over [T, Hq, D].
    q = torch.randn(1, t, hq, d).to(dtype).transpose(1, 2)
    k, v = torch.randn(1, hkv, t, d).to(dtype), torch.randn(1, hkv, t, d).to(dtype)
    outs = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for pool, kernel in zip(pools, (True, False), strict=True):
            pool.tensor.copy_(history)
            runner = _runner(pool, kernel)
            meta = runner._metadata(chunks, runner._flatten(chunks)[2])
            assert (meta.kernel is not None) == kernel and (not meta.decodes) == kernel
            outs.append(_attend(runner, chunks, q, k, v).float())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(pools[0].tensor, pools[1].tensor)  # the same new K/V written
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


def test_kernel_limits() -> None:
    assert cpu_kernel.supports(torch.float32, 32, 8, 128)
    assert not cpu_kernel.supports(torch.float16, 32, 8, 128)  # no fp16 path: gather
    assert not cpu_kernel.supports(torch.float32, 32, 2, 128)  # 16 query heads per KV head
    assert not cpu_kernel.supports(torch.float32, 4, 4, 512)
