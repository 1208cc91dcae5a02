"""Routing is a pure function over a snapshot: table-driven, no server."""

from __future__ import annotations

import random

import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.scheduling import disagg
from pdserve.router.scheduling.registry import get_scorer
from pdserve.router.scheduling.route_request import RouteRequest
from pdserve.router.scheduling.routing import NoWorkerAvailable, plan_route
from pdserve.router.scheduling.snapshot import Snapshot, WorkerStats, WorkerView

pytestmark = pytest.mark.unit

CFG = RouterConfig(model_dir="/m", disagg_threshold=64)


def P(name: str, queued: int = 0, running: int = 0, healthy: bool = True) -> WorkerView:
    stats = WorkerStats(
        worker_id=name,
        queued_prompt_tokens=queued,
        running=running,
        kv_blocks_free=100,
        kv_blocks_total=100,
    )
    return WorkerView(f"http://{name}", "prefill", healthy, stats)


def D(name: str, free: int = 100, total: int = 100, running: int = 0, healthy: bool = True):
    stats = WorkerStats(worker_id=name, kv_blocks_free=free, kv_blocks_total=total, running=running)
    return WorkerView(f"http://{name}", "decode", healthy, stats)


def REQ(tokens: int, matched: dict[str, int] | None = None, held=None) -> RouteRequest:
    nblocks = tokens // 16
    return RouteRequest(tokens, tuple(range(1, nblocks + 1)), 16, matched or {}, held or {})


# (case, workers, request, expected kind, expected first prefill, expected first decode)
CASES = [
    ("short prompt stays local", [P("p1"), D("d1")], REQ(32), "local_prefill", None, "d1"),
    ("long prompt goes remote", [P("p1"), D("d1")], REQ(640), "remote_prefill", "p1", "d1"),
    ("no prefill worker: local", [D("d1")], REQ(640), "local_prefill", None, "d1"),
    (
        "unhealthy prefill ignored",
        [P("p1", healthy=False), D("d1")],
        REQ(640),
        "local_prefill",
        None,
        "d1",
    ),
    (
        "prefix match wins over idle",
        [P("p1"), P("p2", queued=300)],
        REQ(640, {"p2": 40}),
        "remote_prefill",
        "p2",
        "d1",
    ),
    (
        "load wins when no match",
        [P("p1", queued=4000, running=8), P("p2")],
        REQ(640),
        "remote_prefill",
        "p2",
        "d1",
    ),
    (
        "huge queue beats small match",
        [P("p1", queued=200_000, running=60), P("p2")],
        REQ(640, {"p1": 4}),
        "remote_prefill",
        "p2",
        "d1",
    ),
    (
        "new prefix goes to the emptier cache",
        [P("p1"), P("p2")],
        REQ(640, {}, {"p1": 90}),
        "remote_prefill",
        "p2",
        "d1",
    ),
    (
        "prefix match beats cache balance",
        [P("p1"), P("p2")],
        REQ(640, {"p1": 40}, {"p1": 500, "p2": 10}),
        "remote_prefill",
        "p1",
        "d1",
    ),
    (
        "decode with more free KV",
        [P("p1"), D("d1", free=10), D("d2", free=90)],
        REQ(640),
        "remote_prefill",
        "p1",
        "d2",
    ),
    (
        "decode that cannot fit the prompt is filtered",
        [D("d1", free=2, running=0), D("d2", free=50, total=1000, running=30)],
        REQ(640),
        "local_prefill",
        None,
        "d2",
    ),
    (
        "decode cache counts against threshold",
        [P("p1"), D("d1")],
        REQ(640, {"d1": 38}),
        "local_prefill",
        None,
        "d1",
    ),
]


@pytest.mark.parametrize(("case", "workers", "req", "kind", "prefill", "decode"), CASES)
def test_plan_table(case, workers, req, kind, prefill, decode) -> None:
    if not any(w.role == "decode" for w in workers):
        workers = [*workers, D("d1")]
    plan = plan_route(Snapshot(tuple(workers)), req, CFG, random.Random(0))
    assert plan.kind == kind, case
    assert (plan.prefill[0].worker_id if plan.prefill else None) == prefill, case
    assert plan.decode[0].worker_id == decode, case


def test_no_decode_worker_raises() -> None:
    with pytest.raises(NoWorkerAvailable):
        plan_route(Snapshot((P("p1"), D("d1", healthy=False))), REQ(640), CFG, random.Random(0))


def test_ties_are_broken_randomly_and_reproducibly() -> None:
    snap = Snapshot((P("a"), P("b"), P("c"), D("d")))
    firsts = {
        plan_route(snap, REQ(640), CFG, random.Random(s)).prefill[0].worker_id for s in range(40)
    }
    assert firsts == {"a", "b", "c"}
    again = [plan_route(snap, REQ(640), CFG, random.Random(7)).prefill[0].worker_id for _ in "xy"]
    assert again[0] == again[1]


def test_ranking_lists_every_candidate_for_retries() -> None:
    snap = Snapshot((P("a", queued=10_000), P("b"), D("d1"), D("d2", free=5)))
    plan = plan_route(snap, REQ(640), CFG, random.Random(0))
    assert [w.worker_id for w in plan.prefill] == ["b", "a"]
    assert [w.worker_id for w in plan.decode] == ["d1", "d2"]


def test_round_robin_rotates_in_url_order() -> None:
    cfg = RouterConfig(model_dir="/m", picker="round-robin", disagg_threshold=64)
    snap = Snapshot((P("b"), P("a", queued=99_999), D("d1"), D("d2")))
    seq = [plan_route(snap, REQ(640, {"b": 40}), cfg, random.Random(0), i) for i in range(4)]
    assert [p.prefill[0].worker_id for p in seq] == ["a", "b", "a", "b"]
    assert [p.decode[0].worker_id for p in seq] == ["d1", "d2", "d1", "d2"]


def test_inflight_counts_feed_the_load_scorer() -> None:
    busy = WorkerView(
        "http://p1",
        "prefill",
        True,
        WorkerStats(worker_id="p1"),
        inflight=12,
        inflight_prompt_tokens=9000,
    )
    plan = plan_route(Snapshot((busy, P("p2"), D("d"))), REQ(640), CFG, random.Random(0))
    assert plan.prefill[0].worker_id == "p2"


@pytest.mark.parametrize(
    ("tokens", "cached", "threshold", "have_prefill", "kind"),
    [
        (100, 0, 64, True, disagg.REMOTE_PREFILL),
        (63, 0, 64, True, disagg.LOCAL_PREFILL),
        (64, 0, 64, True, disagg.REMOTE_PREFILL),
        (1000, 950, 64, True, disagg.LOCAL_PREFILL),
        (1000, 0, 64, False, disagg.LOCAL_PREFILL),
        (5, 0, 0, True, disagg.REMOTE_PREFILL),
    ],
)
def test_disagg_decision(tokens, cached, threshold, have_prefill, kind) -> None:
    assert disagg.decide(tokens, cached, threshold, have_prefill) == kind


@pytest.mark.parametrize(
    "name", ["prefix-match", "queued-tokens", "running", "free-kv", "cache-balance"]
)
@pytest.mark.parametrize("worker", [P("x"), P("x", queued=10**9, running=10**6), D("x", 0, 0)])
def test_scorers_stay_in_unit_interval(name, worker) -> None:
    value = get_scorer(name)(worker, REQ(640, {"x": 10**6}, {"x": 10**6, "y": 3}))
    assert 0.0 <= value <= 1.0


def test_unknown_scorer_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="prefix-match"):
        get_scorer("nope")


def test_config_rejects_unknown_picker() -> None:
    with pytest.raises(ValueError, match="round-robin"):
        RouterConfig(model_dir="/m", picker="random")


def test_a_snapshots_pools_are_worked_out_once() -> None:
    """Snapshot's pools and block size (protocol/once.py: cached_property without its lock):
    computed at the first read, kept in the instance, equal to what ``role`` says."""
    snap = Snapshot((P("a"), D("b"), P("c", healthy=False), D("d")))
    assert "prefill" not in snap.__dict__
    first = snap.prefill
    assert snap.__dict__["prefill"] is first and snap.prefill is first
    assert first == snap.role("prefill") and len(first) == 1
    assert snap.decode == snap.role("decode") and len(snap.decode) == 2
    assert snap.block_size == 16 and "block_size" in snap.__dict__
    assert Snapshot.prefill.name == "prefill"  # the descriptor itself, read off the class


def test_a_pool_of_one_is_ranked_without_scoring() -> None:
    """One candidate's order needs no score: nothing is drawn from the rng for it (a pool
    of one costs the request no scorer call), and a filtered-out lone worker still comes
    back as the last resort."""
    rng = random.Random(5)
    state = rng.getstate()
    plan = plan_route(Snapshot((P("p1"), D("d1", free=0))), REQ(640), CFG, rng)
    assert (plan.prefill[0].worker_id, plan.decode[0].worker_id) == ("p1", "d1")
    assert rng.getstate() == state
    two = plan_route(Snapshot((P("p1"), D("d1", free=0), D("d2"))), REQ(640), CFG, rng)
    assert [w.worker_id for w in two.decode] == ["d2", "d1"]  # the one that fits first
