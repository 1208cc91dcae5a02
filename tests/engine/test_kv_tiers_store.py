"""The KV tiers on their own: the entry codec's checks, the host tier's LRU, the disk tier's
atomic, symlink-proof files, the shared tier against a real redis-server on loopback, and
the store's writer and loader threads (bounded, never failing a caller)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.engine.kv_tiers import codec
from pdserve.engine.kv_tiers.base import Tier
from pdserve.engine.kv_tiers.disk import DiskTier
from pdserve.engine.kv_tiers.host import HostTier
from pdserve.engine.kv_tiers.redis_server import LocalRedis, start_redis
from pdserve.engine.kv_tiers.redis_tier import RedisTier
from pdserve.engine.kv_tiers.store import TieredStore

pytestmark = pytest.mark.unit

SHAPE = (2, 2, 4, 2, 8)
NS = codec.namespace("m", torch.float32, SHAPE)


def _block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    server = start_redis(maxmemory="32mb", password="tier-test")
    yield server
    server.stop()


def test_codec_round_trip_and_every_check() -> None:
    key, other = codec.block_key(NS, 1), codec.block_key(NS, 2)
    entry = codec.encode(key, _block(0))
    assert torch.equal(codec.decode(entry, key, torch.float32, SHAPE), _block(0))
    flipped = bytearray(entry)
    flipped[-1] ^= 1
    bad = {
        "another block": (entry, other, torch.float32, SHAPE),
        "truncated": (entry[:-4], key, torch.float32, SHAPE),
        "header only": (entry[:20], key, torch.float32, SHAPE),
        "bit flip": (bytes(flipped), key, torch.float32, SHAPE),
        "dtype": (entry, key, torch.float16, SHAPE),
        "shape": (entry, key, torch.float32, (2, 2, 4, 2, 4)),
    }
    for name, args in bad.items():
        with pytest.raises(codec.BadEntry):
            codec.decode(*args)
            pytest.fail(f"{name}: decoded")
    assert codec.namespace("other-model", torch.float32, SHAPE) != NS


def test_host_tier_lru_bound_and_compression() -> None:
    entry = codec.encode(codec.block_key(NS, 0), _block(0))
    tier = HostTier(capacity_bytes=len(entry) * 3)
    gone: list[bytes] = []
    tier.on_evict = gone.extend
    keys = [codec.block_key(NS, i) for i in range(5)]
    for k in keys[:3]:
        assert tier.put(k, entry)
    assert tier.get(keys[0]) == entry  # now most recently used
    tier.put(keys[3], entry)
    assert gone == [keys[1]] and tier.used_bytes <= tier.capacity_bytes
    assert not tier.put(keys[4], entry * 4)  # larger than the whole tier: not kept
    packed = HostTier(1 << 20, compress=True)
    zeros = codec.encode(keys[0], torch.zeros(SHAPE))
    packed.put(keys[0], zeros)
    assert packed.get(keys[0]) == zeros and packed.used_bytes < len(zeros) // 4


def test_disk_tier_atomic_bounded_and_symlink_proof(tmp_path: Path) -> None:
    entry = codec.encode(codec.block_key(NS, 0), _block(0))
    tier = DiskTier(str(tmp_path / "kv"), capacity_bytes=len(entry) * 2)
    keys = [codec.block_key(NS, i) for i in range(3)]
    for k in keys:
        tier.put(k, entry)
    assert len(tier) == 2 and not tier.contains(keys[0])  # oldest file deleted
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == sorted(
        k.hex() + ".kv" for k in keys[1:]
    )
    # A planted symlink is never followed: reading it fails, the store would count it.
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    link = tmp_path / "kv" / (keys[1].hex() + ".kv")
    link.unlink()
    link.symlink_to(secret)
    with pytest.raises(OSError):
        tier.get(keys[1])
    # Restart: the index is rebuilt from the files (symlinks and leftovers ignored).
    (tmp_path / "kv" / "x.kv.1.tmp").write_bytes(b"half")
    again = DiskTier(str(tmp_path / "kv"), capacity_bytes=len(entry) * 2)
    assert again.contains(keys[2]) and not again.contains(keys[1])
    assert again.get(keys[2]) == entry
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "kv").iterdir())


def test_redis_tier_against_a_real_server(redis_server: LocalRedis) -> None:
    tier = RedisTier(redis_server.url, password="tier-test", timeout_s=1.0)
    key = codec.block_key(NS, 7)
    entry = codec.encode(key, _block(7))
    assert tier.get(key) is None and not tier.contains(key)
    tier.put(key, entry)
    assert tier.contains(key) and tier.get(key) == entry
    tier.delete(key)
    assert tier.get(key) is None
    with pytest.raises(Exception, match=r"(?i)auth"):  # the password is required
        RedisTier(redis_server.url, password=None).get(key)
    tier.close()


class _Broken(Tier):
    name = "host"

    def put(self, key: bytes, value: bytes) -> bool:
        raise OSError("disk on fire")

    def get(self, key: bytes) -> bytes | None:
        raise OSError("disk on fire")

    def contains(self, key: bytes) -> bool:
        return True

    def delete(self, key: bytes) -> None:
        pass


class _Slow(HostTier):
    def get(self, key: bytes) -> bytes | None:
        time.sleep(0.3)
        return super().get(key)

    def put(self, key: bytes, value: bytes) -> bool:
        time.sleep(0.3)
        return super().put(key, value)


def _store(tiers: list[Tier], pool: torch.Tensor, **kw: float) -> TieredStore:
    def write_block(block_id: int, block: torch.Tensor) -> None:
        pool[block_id].copy_(block)

    return TieredStore(tiers, NS, torch.float32, SHAPE, write_block, **kw)  # type: ignore[arg-type]


def _wait(store: TieredStore, n: int) -> list:  # type: ignore[type-arg]
    out: list = []  # type: ignore[type-arg]
    end = time.monotonic() + 5
    while len(out) < n and time.monotonic() < end:
        out += store.poll()
        time.sleep(0.002)
    return out


def test_store_loads_a_prefix_and_stops_at_a_miss_or_bad_entry(tmp_path: Path) -> None:
    pool = torch.zeros((8, *SHAPE))
    disk = DiskTier(str(tmp_path), 1 << 20)
    store = _store([HostTier(1 << 20), disk], pool)
    for h in (10, 11, 12, 14):
        store.evicted(h, _block(h))
    store.flush()
    assert store.stats.blocks_written == {"host": 4, "disk": 4}
    assert store.may_have(10) and not store.may_have(13)
    store.start_load("a", [10, 11, 12, 13, 14], [0, 1, 2, 3, 4])
    [done] = _wait(store, 1)
    assert done.num_blocks == 3 and all(torch.equal(pool[i], _block(10 + i)) for i in range(3))
    assert store.stats.hits["host"] == 3 and store.stats.misses == 1
    # Corrupt block 11 in both tiers: the load stops before it; the entries are dropped.
    store.tiers[0].put(codec.block_key(NS, 11), b"PDKV garbage")
    path = tmp_path / (codec.block_key(NS, 11).hex() + ".kv")
    path.write_bytes(path.read_bytes()[:-10])
    store.start_load("b", [10, 11], [5, 6])
    [done] = _wait(store, 1)
    assert done.num_blocks == 1 and store.stats.bad_entries == 2
    assert not store.may_have(11)
    kinds = {(k, t) for k, t, _ in store.drain_events()}
    assert ("stored", "host") in kinds and ("stored", "disk") in kinds
    store.close()


def test_store_never_fails_or_waits_on_a_broken_or_slow_tier() -> None:
    pool = torch.zeros((4, *SHAPE))
    store = _store([_Broken()], pool, load_timeout_s=5.0)
    store.evicted(1, _block(1))
    store.flush()
    store.start_load("a", [1], [0])
    [done] = _wait(store, 1)
    assert done.num_blocks == 0 and store.stats.errors["host"] == 2
    store.close()
    slow = _Slow(1 << 20)
    store = _store([slow], pool, load_timeout_s=0.1)
    for h in (1, 2, 3):
        HostTier.put(slow, codec.block_key(NS, h), codec.encode(codec.block_key(NS, h), _block(h)))
    pool.zero_()
    store.start_load("b", [1, 2, 3], [0, 1, 2])
    [done] = _wait(store, 1)
    assert done.timed_out and done.num_blocks == 0 and store.stats.load_timeouts == 1
    time.sleep(0.4)  # the loader's late read: it writes nothing once cut off
    assert not pool.any()
    store.close()


def test_a_full_write_queue_drops_instead_of_waiting() -> None:
    pool = torch.zeros((2, *SHAPE))
    store = _store([_Slow(1 << 20)], pool, write_queue_blocks=1)
    store._writes.put((0, _block(0)))  # the queue is full (the writer may hold one more)
    start = time.monotonic()
    for h in range(50):
        store.evicted(h, _block(h))
    assert time.monotonic() - start < 0.25 and store.stats.dropped_writes >= 48
    store.close()


def test_metrics_render_hits_bytes_and_load_latency(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.engine.kv_tiers.metrics import TierCollector

    pool = torch.zeros((4, *SHAPE))
    store = _store([HostTier(1 << 20), DiskTier(str(tmp_path), 1 << 20)], pool)
    store.evicted(1, _block(1))
    store.flush()
    store.start_load("a", [1, 2], [0, 1])
    _wait(store, 1)
    registry = CollectorRegistry()
    registry.register(TierCollector(store.stats, "prefill"))
    text = generate_latest(registry).decode()
    entry = len(codec.encode(codec.block_key(NS, 1), _block(1)))
    assert 'pdserve_kv_tier_hits_total{role="prefill",tier="host"} 1.0' in text
    assert 'pdserve_kv_tier_hits_total{role="prefill",tier="disk"} 0.0' in text
    assert f'direction="written",role="prefill",tier="disk"}} {float(entry)}' in text
    assert 'pdserve_kv_tier_misses_total{role="prefill"} 1.0' in text
    assert 'pdserve_kv_tier_load_seconds_count{role="prefill"} 1.0' in text
    store.close()
