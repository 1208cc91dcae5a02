"""KVPool on the CPU: zeroed, and committed only as its blocks are used."""

from __future__ import annotations

import torch

from pdserve.engine.kv_pool import KVPool, KVShape

MIB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_cpu_pool_reads_zero_and_costs_nothing_until_touched() -> None:
    """A 1 GiB pool: every element reads 0.0 (what masked attention relies on in blocks
    never written), yet the process's resident memory grows by far less than the pool
    until blocks are written; with ``torch.zeros`` it grew by the whole GiB at start-up
    (~1 CPU-s per 2 GiB, the default budget, in every worker start)."""
    shape = KVShape(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    before = _rss_bytes()
    pool = KVPool.from_budget(shape, 1 << 30, torch.device("cpu"))
    grown = _rss_bytes() - before
    assert pool.nbytes == pool.num_blocks * shape.bytes_per_block > 1000 * MIB
    assert grown < 64 * MIB, f"the pool made {grown / MIB:.0f} MiB resident at start"
    k, _v = pool.layer(3)
    assert k.shape == (pool.num_blocks * 16, 2, 64) and k.dtype == torch.bfloat16
    assert not pool.tensor[:, :, :64].any() and not pool.tensor[:, :, -64:].any()
    k[:16] = 1.0  # one block of layer 3's K written through the layer view
    assert pool.tensor[3, 0, 0].eq(1.0).all() and not pool.tensor[3, 1, 0].any()
    assert _rss_bytes() - before < 64 * MIB + 2 * 16 * 2 * 64 * 2 * 4096
