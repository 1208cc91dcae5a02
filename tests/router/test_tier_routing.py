"""Tier-aware prefix routing, table-driven: KV events that carry a tier fill the tier index,
a hit is weighed by its tier, and a prefix in the shared tier is a hit on every prefill
worker (no server)."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.protocol.codec import encode
from pdserve.protocol.contract import WorkerStats
from pdserve.protocol.kv_events import KVEvent
from pdserve.router.config import RouterConfig
from pdserve.router.scheduling.prefix_index import KVEventView, PrefixIndex
from pdserve.router.scheduling.profile import build_profile
from pdserve.router.scheduling.route_request import RouteRequest, ScorerWeight
from pdserve.router.scheduling.scorers import prefix_match
from pdserve.router.scheduling.snapshot import WorkerView
from pdserve.router.scheduling.tier_index import TierIndex, parse_weights

pytestmark = pytest.mark.unit

HASHES = (11, 12, 13, 14)
WORKERS = ("p0", "p1", "p2")


def _view(kind: str, wid: str, seq: int, hashes: tuple[int, ...], tier: str) -> KVEventView:
    """Through the wire: the worker's codec bytes, parsed as the router does."""
    return KVEventView.parse(encode(KVEvent(kind, wid, seq, list(hashes), tier)))


def _index(events: list[tuple[str, str, tuple[int, ...], str]]) -> PrefixIndex:
    index = PrefixIndex(1000)
    seqs: dict[str, int] = {}
    for kind, wid, hashes, tier in events:
        seqs[wid] = seqs.get(wid, 0) + 1
        index.apply(_view(kind, wid, seqs[wid], hashes, tier))
    return index


# (events, expected worker -> weighted blocks of HASHES), default weights pool 1, host 0.8,
# disk 0.5, shared 0.3
CASES = {
    "nothing anywhere": ([], {}),
    "pool only": ([("stored", "p0", HASHES[:2], "pool")], {"p0": 2.0}),
    "host below the pool": (
        [("stored", "p0", HASHES[:2], "pool"), ("stored", "p0", HASHES[2:], "host")],
        {"p0": 2 + 2 * 0.8},
    ),
    "disk and host: the faster counts": (
        [("stored", "p1", HASHES, "disk"), ("stored", "p1", HASHES, "host")],
        {"p1": 4 * 0.8},
    ),
    "removed from host, still on disk": (
        [
            ("stored", "p1", HASHES, "disk"),
            ("stored", "p1", HASHES, "host"),
            ("removed", "p1", HASHES[1:], "host"),
        ],
        {"p1": 0.5 * 0},  # host kept only block 0 ... its disk entry was replaced: see below
    ),
    "shared: every worker": (
        [("stored", "p2", HASHES, "shared")],
        {w: 4 * 0.3 for w in WORKERS},
    ),
    "shared after one's pool": (
        [("stored", "p0", HASHES[:1], "pool"), ("stored", "p1", HASHES, "shared")],
        {"p0": 1 + 3 * 0.3, "p1": 4 * 0.3, "p2": 4 * 0.3},
    ),
    "a gap in the chain stops the match": (
        [("stored", "p0", (11, 13, 14), "host")],
        {"p0": 0.8},
    ),
    "pool cleared drops the worker's tiers too (resync)": (
        [("stored", "p0", HASHES, "host"), ("cleared", "p0", (), "pool")],
        {},
    ),
}
# A block in host and disk is kept at its faster tier; host's removal forgets it (the disk
# copy is still there but unknown: a conservative miss, never a false hit).
CASES["removed from host, still on disk"] = (
    CASES["removed from host, still on disk"][0],
    {"p1": 0.8},
)


@pytest.mark.parametrize("name", list(CASES))
def test_tier_match_table(name: str) -> None:
    events, want = CASES[name]
    index = _index(events)
    pool = index.match(HASHES)
    tiers = index.tiers.match(HASHES, pool, WORKERS)
    got = {w: max(pool.get(w, 0), tiers.get(w, 0.0)) for w in {*pool, *tiers}}  # as scored
    assert got == pytest.approx(want), name
    # pool events alone never fill the tier index, tier events never the pool's
    assert all(index.match(HASHES).get(w, 0) <= want.get(w, 0) for w in WORKERS)


def _worker(wid: str) -> WorkerView:
    stats = WorkerStats(role="prefill", worker_id=wid, kv_blocks_free=100, kv_blocks_total=100)
    return WorkerView(f"http://{wid}", "prefill", stats=stats)


@pytest.mark.parametrize(
    ("events", "winner"),
    [
        ([("stored", "p1", HASHES, "host")], "p1"),  # its host tier beats two misses
        ([("stored", "p0", HASHES, "disk"), ("stored", "p1", HASHES, "host")], "p1"),
        ([("stored", "p0", HASHES, "pool"), ("stored", "p2", HASHES, "host")], "p0"),
        ([("stored", "p0", HASHES[:1], "pool"), ("stored", "p2", HASHES, "host")], "p2"),
    ],
)
def test_the_cheapest_load_wins(events: list, winner: str) -> None:  # type: ignore[type-arg]
    index = _index(events)
    pool = index.match(HASHES)
    req = RouteRequest(70, HASHES, 16, pool, tier_matched=index.tiers.match(HASHES, pool, WORKERS))
    profile = build_profile((), [ScorerWeight("prefix-match", 1.0)], "max-score")
    order = profile.order([_worker(w) for w in WORKERS], req, random.Random(0), 0)
    assert order[0].worker_id == winner


def test_a_shared_prefix_is_a_hit_on_every_worker() -> None:
    index = _index([("stored", "p0", HASHES, "shared")])
    pool = index.match(HASHES)
    req = RouteRequest(70, HASHES, 16, pool, tier_matched=index.tiers.match(HASHES, pool, WORKERS))
    assert {w: prefix_match(_worker(w), req) for w in WORKERS} == pytest.approx(
        {w: 0.3 for w in WORKERS}
    )
    assert prefix_match(_worker("p0"), RouteRequest(70, HASHES, 16, pool)) == 0.0


def test_weights_are_configurable_and_checked() -> None:
    assert parse_weights("shared=0.9")["shared"] == 0.9 and parse_weights("")["host"] == 0.8
    tiers = TierIndex(10, parse_weights("disk=0.9"))
    tiers.stored("p0", "disk", HASHES)
    assert tiers.match(HASHES, {}, ["p0"]) == {"p0": pytest.approx(3.6)}
    for bad in ("gpu=0.5", "host", "host=2"):
        with pytest.raises(ValueError, match="prefix-tier-weights"):
            RouterConfig(model_dir="m", prefix_tier_weights=bad)
    with pytest.raises(ValueError, match="tier"):
        KVEventView.parse(
            json.dumps({"kind": "stored", "worker_id": "p", "seq": 1, "tier": "gpu"}).encode()
        )


def test_shared_entries_are_bounded() -> None:
    tiers = TierIndex(capacity=3)
    tiers.stored("p0", "shared", [1, 2, 3, 4, 5])
    assert len(tiers) == 3 and tiers.match([1], {}, ["p0"]) == {}
