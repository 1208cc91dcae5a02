"""KVPool on the CPU: zeroed, committed only as its blocks are used, and sized within
what the worker may take (its memory cgroup's limit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine import kv_pool
from pdserve.engine.kv_pool import KVPool, KVShape, budget_bytes, cgroup_room

pytestmark = pytest.mark.unit

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


def _cgroup(tmp_path: Path, v2: bool, limit: str, usage: int, inactive: int) -> Path:
    """A fake /sys/fs/cgroup and /proc/self/cgroup for this process's group ``/pod/c``."""
    root = tmp_path / "cgroup"
    if v2:
        d, files, key = root / "pod/c", ("memory.max", "memory.current"), "inactive_file"
        line = "0::/pod/c\n"
    else:
        d = root / "memory/pod/c"
        files, key = ("memory.limit_in_bytes", "memory.usage_in_bytes"), "total_inactive_file"
        line = "4:memory:/pod/c\n3:cpuset:/\n"
    d.mkdir(parents=True)
    (d / files[0]).write_text(limit + "\n")
    (d / files[1]).write_text(f"{usage}\n")
    (d / "memory.stat").write_text(f"anon 5\n{key} {inactive}\n")
    (tmp_path / "self").write_text(line)
    return root


@pytest.mark.parametrize("v2", [True, False])
def test_cgroup_limit_bounds_what_a_pool_may_take(tmp_path: Path, v2: bool) -> None:
    """Inside a container /proc/meminfo is the node's: a worker with a 1 GiB limit on a big
    node sized its default pool from the node's memory and was OOM-killed as it filled."""
    root = _cgroup(tmp_path, v2, str(1 << 30), 700 * MIB, 100 * MIB)
    assert cgroup_room(str(root), str(tmp_path / "self")) == (1 << 30) - 600 * MIB


@pytest.mark.parametrize("limit", ["max", "9223372036854771712"])
def test_no_cgroup_limit_leaves_meminfo(tmp_path: Path, limit: str) -> None:
    root = _cgroup(tmp_path, limit == "max", limit, 700 * MIB, 0)
    assert cgroup_room(str(root), str(tmp_path / "self")) is None
    assert cgroup_room(str(root), str(tmp_path / "missing")) is None


def test_explicit_budget_over_what_the_worker_can_take_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_pool, "cgroup_room", lambda: 256 * MIB)
    cpu = torch.device("cpu")
    assert kv_pool.available_bytes(cpu) <= 256 * MIB
    assert budget_bytes(cpu, 128 * MIB, None) == 128 * MIB
    assert budget_bytes(cpu, None, None) <= int(0.1 * 256 * MIB)  # the default share of it
    with pytest.raises(ValueError, match="--kv-cache-bytes 536870912 is more than"):
        budget_bytes(cpu, 512 * MIB, None)
