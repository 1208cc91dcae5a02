"""The tiers under a real engine (tiny model, CPU): a prefix evicted from the pool comes back
from each tier with the same greedy output as a cold run; a tenant never loads another's
blocks from any tier; a broken shared store, corrupted files and an abort mid-load all end
in a recompute (or a clean abort), never a failed request or a leaked block."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import assert_all_free

from pdserve.engine.kv_tiers import codec
from pdserve.engine.kv_tiers.config import TierConfig
from pdserve.engine.kv_tiers.redis_server import LocalRedis, free_port, start_redis
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import RequestStatus
from pdserve.protocol.hashing import block_hashes
from pdserve.protocol.sampling_params import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
POOL_BLOCKS = 24
DOC = [(i * 37) % 2900 + 50 for i in range(97)]  # 6 full blocks + 1 token


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    server = start_redis(maxmemory="64mb")
    yield server
    server.stop()


def _tiers(kind: str, tmp_path: Path, redis_server: LocalRedis) -> TierConfig:
    return {
        "host": TierConfig(host_bytes=8 << 20),
        "disk": TierConfig(disk_path=str(tmp_path / "kv"), disk_bytes=8 << 20),
        "shared": TierConfig(shared_url=redis_server.url),
    }[kind]


def _run(engine: LLMEngine, rid: str, prompt: list[int], **kw: Any) -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens of one request run alone."""
    engine.add_request(rid, prompt, GREEDY, **kw)
    tokens: list[int] = []
    cached = 0
    while engine.has_work:
        for out in engine.step():
            tokens += out.token_ids
            cached = out.num_cached_tokens if out.finished else cached
    return tokens, cached


def _evict_all(engine: LLMEngine, seed: int) -> None:
    """Fill the whole pool with other prompts (every cached block is reused once)."""
    for i in range(3):
        filler = [(seed * 1000 + i * 131 + j * 7) % 2900 + 60 for j in range(16 * 9)]
        _run(engine, f"fill-{seed}-{i}", filler)
    assert engine.tier_store is not None
    engine.tier_store.flush()


@pytest.fixture
def tiered(
    make_engine: Callable[..., LLMEngine], tmp_path: Path, redis_server: LocalRedis
) -> Iterator[Callable[..., LLMEngine]]:
    made: list[LLMEngine] = []

    def make(kind: str, **cfg: Any) -> LLMEngine:
        base = _tiers(kind, tmp_path, redis_server)
        engine = make_engine(POOL_BLOCKS, kv_tiers=TierConfig(**{**base.__dict__, **cfg}))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        assert_all_free(engine)
        assert engine.tier_store is not None
        engine.tier_store.close()
    redis_server.client().flushall()


@pytest.mark.parametrize("kind", ["host", "disk", "shared"])
def test_an_evicted_prefix_comes_back_from_the_tier(
    kind: str, tiered: Callable[..., LLMEngine], make_engine: Callable[..., LLMEngine]
) -> None:
    cold = make_engine(POOL_BLOCKS)
    want, _ = _run(cold, "cold", DOC)
    assert_all_free(cold)
    engine = tiered(kind)
    first, cached = _run(engine, "a1", DOC)
    assert first == want and cached == 0
    _evict_all(engine, seed=1)
    assert engine.kv.cached_prefix(block_hashes(DOC, 16), len(DOC)) == []  # gone from the pool
    again, cached = _run(engine, "a2", DOC)
    store = engine.tier_store
    assert store is not None
    assert again == want
    assert cached == 96 and store.stats.hits[kind] == 6  # every full block but the last token's
    assert store.stats.bytes_read[kind] > 6 * 16 * 1024
    assert engine.stats().prefix_cache_hit_tokens >= 96


def test_a_tenant_never_loads_another_tenants_blocks(
    tiered: Callable[..., LLMEngine], tmp_path: Path
) -> None:
    # One engine with every tier, so no tier can leak: same prompt, two tenants.
    engine = tiered("shared", host_bytes=8 << 20, disk_path=str(tmp_path / "all"))
    _run(engine, "a", DOC, cache_salt="k:tenant-a")
    _evict_all(engine, seed=2)
    store = engine.tier_store
    assert store is not None
    _, cached = _run(engine, "b", DOC, cache_salt="k:tenant-b")
    assert cached == 0 and sum(store.stats.hits.values()) == 0
    # Tenant A's blocks are there all along, in every tier: A hits, B did not.
    _evict_all(engine, seed=3)
    _, cached = _run(engine, "a-again", DOC, cache_salt="k:tenant-a")
    assert cached == 96 and store.stats.hits["host"] == 6


def test_a_dead_shared_store_costs_a_recompute_not_a_request(
    tiered: Callable[..., LLMEngine], redis_server: LocalRedis
) -> None:
    engine = tiered("shared", load_timeout_s=0.5)
    want, _ = _run(engine, "a", DOC)
    _evict_all(engine, seed=4)
    dead = start_redis()
    dead.stop()  # a port nobody listens on any more
    store = engine.tier_store
    assert store is not None
    store.tiers[0].client = type(store.tiers[0])(dead.url, timeout_s=0.2).client  # type: ignore[attr-defined]
    got, cached = _run(engine, "a2", DOC)
    assert got == want and cached == 0 and store.stats.errors["shared"] >= 1


def test_corrupt_disk_entries_are_recomputed_never_used(
    tiered: Callable[..., LLMEngine], tmp_path: Path
) -> None:
    engine = tiered("disk")
    want, _ = _run(engine, "a", DOC)
    _evict_all(engine, seed=5)
    files = sorted((tmp_path / "kv").iterdir())
    assert files
    for f in files:  # flip one byte in the payload of every stored block
        data = bytearray(f.read_bytes())
        data[codec.HEADER_BYTES + 5] ^= 0xFF
        f.write_bytes(bytes(data))
    got, cached = _run(engine, "a2", DOC)
    store = engine.tier_store
    assert store is not None
    assert got == want and cached == 0 and store.stats.bad_entries == 1


def test_an_abort_while_loading_frees_the_blocks(tiered: Callable[..., LLMEngine]) -> None:
    engine = tiered("host")
    _run(engine, "a", DOC)
    _evict_all(engine, seed=6)
    engine.add_request("a2", DOC, GREEDY)
    engine.step()  # admitted: its prefix is loading from the host tier
    assert engine.requests["a2"].status is RequestStatus.WAITING_FOR_TIER_LOAD
    engine.abort("a2")
    while engine.has_work:
        engine.step()


def test_tier_events_reach_the_router_index(tiered: Callable[..., LLMEngine]) -> None:
    """The prefill worker's publisher sends the tier's events; the router's index, fed
    through a real ZeroMQ SUB socket, then scores the evicted prompt as a host-tier hit."""
    import time

    import zmq

    from pdserve.router.scheduling.prefix_index import KVEventView, PrefixIndex
    from pdserve.worker.core.events import KVEventPublisher

    engine = tiered("host")
    pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", "p0", engine, any_port=True)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub.port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.2)  # the slow joiner
    _run(engine, "a", DOC)
    _evict_all(engine, seed=7)
    pub.hook(engine)
    index = PrefixIndex(10_000)
    while sub.poll(500):
        for frame in sub.recv_multipart()[1:]:
            index.apply(KVEventView.parse(frame))
    hashes = block_hashes(DOC, 16)
    assert index.match(hashes).get("p0", 0) == 0  # gone from the pool ...
    assert index.tiers.match(hashes, {}, ["p0", "p1"]) == {"p0": pytest.approx(6 * 0.8)}
    sub.close()
    pub.close()
