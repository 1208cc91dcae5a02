"""The compiled lane's planner (rust/router_lane/src/plan.rs) against the Python scheduler,
its reference: the same stream of requests, snapshots (loads, health, KV capacity) and KV
events, with the Python rng's state handed over (ties are broken by the same draws), must
give the same plan every time: kind, prefill and decode order, matched tokens, and the
round-robin counter after it. Each request's blocks are stored in each side's own index
(the plan's store), so a divergence would also show in later matches.

Skipped where the module is not built (scripts/setup.sh builds it when cargo is there).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import replace
from typing import Any

import pytest

from pdserve.protocol import hashing
from pdserve.protocol.contract import WorkerStats
from pdserve.router import lane_plan
from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.scheduling.prefix_index import KVEventView, PrefixIndex
from pdserve.router.scheduling.scheduler import Scheduler
from pdserve.router.scheduling.snapshot import Snapshot, WorkerView
from pdserve.testing.lane import lane_mod, needs_lane

pytestmark = pytest.mark.unit


CONFIGS: list[dict[str, Any]] = [
    {},  # the defaults: prefix + load + balance on prefill, kv + running on decode
    {"disagg_threshold": 0},
    {"disagg_threshold": 40, "scorers": (("prefix", 1.0), ("load", 1.0))},
    {"picker": "round-robin"},
    {"scorers": (("load", 1.0),), "decode_scorer_weights": (("running", 1.0),)},  # no prefix
    {"scorers": (("prefix", 3.0), ("balance", 1.0), ("free-kv", 0.25))},
    {"decode_filters": ("fits-kv",), "decode_scorer_weights": (("kv", 1.0), ("prefix", 1.0))},
    {"prefix_index_capacity": 24},  # evictions on the way
]


def _worker(rng: random.Random, url: str, role: str, block: int) -> WorkerView:
    total = rng.choice([0, 64, 512])
    stats = WorkerStats(
        worker_id=rng.choice(["", f"id-{url[-2:]}"]),
        running=rng.randrange(0, 6),
        waiting=rng.randrange(0, 3),
        loading=rng.randrange(0, 2),
        queued_prompt_tokens=rng.choice([0, 0, 100, 2048, 5000]),
        kv_blocks_total=total,
        kv_blocks_free=rng.randrange(0, total + 1) if total else 0,
        block_size=block,
    )
    return WorkerView(
        url,
        role,
        healthy=rng.random() > 0.1,
        stats=stats,
        inflight=rng.randrange(0, 4),
        inflight_prompt_tokens=rng.choice([0, 300]),
        reported=rng.random() > 0.5,
        since_report=rng.randrange(0, 3),
        since_report_tokens=rng.choice([0, 64]),
    )


def _snapshot(rng: random.Random, n_prefill: int, n_decode: int) -> Snapshot:
    block = rng.choice([4, 4, 8])
    workers = [_worker(rng, f"http://p{i:02d}", "prefill", block) for i in range(n_prefill)]
    workers += [_worker(rng, f"http://d{i:02d}", "decode", block) for i in range(n_decode)]
    rng.shuffle(workers)
    return Snapshot(tuple(workers))


def _prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    """A shared prefix (a few groups) and a tail, or a fresh prompt: matches, partial
    matches and misses."""
    head = rng.choice(prefixes) if rng.random() < 0.7 else []
    cut = rng.randrange(0, len(head) + 1) if head else 0
    return head[:cut] + [rng.randrange(0, 50_000) for _ in range(rng.randrange(0, 160))]


def _python_plan(sched: Scheduler, ids: list[int], snap: Snapshot, salt: str | None) -> Any:
    try:
        plan = sched.plan(ids, snap, salt, None)
    except APIError as err:
        assert err.code == "no_worker"
        return ("no_worker",)
    return (
        plan.kind,
        [w.url for w in plan.prefill],
        [w.url for w in plan.decode],
        plan.matched_tokens,
    )


@needs_lane
@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: ",".join(o) or "defaults")
def test_same_requests_same_plans(overrides: dict[str, Any]) -> None:
    cfg = RouterConfig(model_dir="/m", **overrides)
    key = hashing.hash_key()
    rng = random.Random(zlib.crc32(",".join(overrides).encode()))  # not hash(): salted per run
    sched = Scheduler(
        cfg, PrefixIndex(cfg.prefix_index_capacity), RouterMetrics(), random.Random(7)
    )
    rust = lane_plan.planner(lane_mod, cfg, key)
    assert rust.uses_prefix == cfg.uses_prefix
    prefixes = [[rng.randrange(0, 50_000) for _ in range(256)] for _ in range(4)]
    snap = _snapshot(rng, 4, 4)
    kinds: set[str] = set()
    for step in range(400):
        if step % 25 == 0:  # loads, health and capacity move; once, no worker at all
            snap = (
                Snapshot(())
                if step == 300
                else _snapshot(rng, rng.randrange(0, 5), rng.randrange(0, 5))
            )
        elif step % 7 == 0:  # one worker's in-flight count moves
            i = rng.randrange(len(snap.workers)) if snap.workers else None
            if i is not None:
                ws = list(snap.workers)
                ws[i] = replace(ws[i], inflight=ws[i].inflight + 1, since_report=1)
                snap = Snapshot(tuple(ws))
        if step % 11 == 0 and snap.prefill:  # a prefill worker's KV event
            wid = rng.choice(snap.prefill).worker_id
            ids = rng.choice(prefixes)[: rng.randrange(4, 256)]
            hashes = hashing.block_hashes(ids, snap.block_size, hashing.ROOT_HASH, key)
            if rng.random() < 0.6:
                sched.index.stored(wid, hashes)
                rust.kv_stored(wid, hashes)
            elif rng.random() < 0.7:
                sched.index.removed(wid, hashes)
                rust.kv_removed(wid, hashes)
            else:
                sched.index.drop_worker(wid)
                rust.kv_drop(wid)
        ids = _prompt(rng, prefixes)
        salt = rng.choice([None, None, None, "k:tenant"])
        rust.set_workers(lane_plan.rows(snap))
        state = sched.rng.getstate()[1]
        rust.set_rng(list(state[:624]), state[624])
        rust.rr = sched._rr
        want = _python_plan(sched, ids, snap, salt)
        got = rust.plan(ids, salt)
        assert got == want, f"step {step}: {ids=} {salt=}"
        assert rust.rr == sched._rr
        assert rust.index_len() == len(sched.index)
        kinds.add(want[0])
    assert {"remote_prefill", "local_prefill", "no_worker"} <= kinds  # the stream covered all


@needs_lane
def test_block_hashes_and_salt_roots_are_the_pythons() -> None:
    key = hashing.hash_key()
    ids = list(range(1000, 1037))
    for salt, extra in ((None, None), ("k:a", None), ("", "lora-hash"), ("r:x", "h")):
        root = hashing.salt_root(salt, extra)
        assert lane_mod.salt_root(key, salt, extra) == root
        assert lane_mod.block_hashes(ids, 8, key, salt, extra) == hashing.block_hashes(
            ids, 8, root, key
        )
    assert lane_mod.block_hashes(ids, 8, b"another key") != hashing.block_hashes(ids, 8, 0, key)


@needs_lane
def test_a_kv_tier_in_use_is_declined() -> None:
    """Blocks in a KV tier below a pool weigh in the Python scheduler's prefix score
    (tier_index.py): the Rust planner does not mirror tiers, so it declines."""
    cfg = RouterConfig(model_dir="/m")
    rust = lane_plan.planner(lane_mod, cfg, hashing.hash_key())
    rust.set_workers(lane_plan.rows(_snapshot(random.Random(1), 2, 2)))
    assert rust.plan([1, 2, 3]) is not None
    rust.set_tiers_present(True)
    assert rust.plan([1, 2, 3]) is None


@needs_lane
def test_the_lanes_planner_over_the_mirrored_index() -> None:
    """As the router runs it (router/lane_plan.LanePlanner): the KV events reach the Rust
    planner through the index it mirrors (``PrefixIndex.attach``: stores, removals, a
    ``cleared``, a seq gap's drop), the rows only when a view moved; its plans are the
    reference scheduler's, fed the same events. A tier event turns it to the scheduler."""
    cfg = RouterConfig(model_dir="/m")
    key = hashing.hash_key()
    rng = random.Random(3)
    ref = Scheduler(cfg, PrefixIndex(cfg.prefix_index_capacity), RouterMetrics(), random.Random(5))
    mirrored = PrefixIndex(cfg.prefix_index_capacity)
    metrics = RouterMetrics()
    own = Scheduler(cfg, mirrored, metrics, random.Random(5))
    lane = lane_plan.LanePlanner(lane_plan.planner(lane_mod, cfg, key), own, mirrored)
    prefixes = [[rng.randrange(0, 50_000) for _ in range(256)] for _ in range(3)]
    snap = _snapshot(rng, 4, 4)
    seq: dict[str, int] = {}
    for step in range(300):
        if step % 40 == 0:
            snap = _snapshot(rng, 4, 4)
        if step % 5 == 0 and snap.prefill:
            wid = rng.choice(snap.prefill).worker_id
            ids = rng.choice(prefixes)[: rng.randrange(4, 256)]
            hashes = tuple(hashing.block_hashes(ids, snap.block_size, 0, key))
            kind = rng.choice(["stored", "stored", "removed", "cleared"])
            seq[wid] = seq.get(wid, 0) + (2 if rng.random() < 0.05 else 1)  # a gap now and then
            ev = KVEventView(kind, wid, seq[wid], hashes)
            ref.index.apply(ev)
            mirrored.apply(ev)
        ids = _prompt(rng, prefixes)
        state = ref.rng.getstate()[1]
        lane.rust.set_rng(list(state[:624]), state[624])
        want = _python_plan(ref, ids, snap, None)
        if want == ("no_worker",):
            with pytest.raises(APIError, match="no worker is ready"):
                lane.plan(ids, snap, None)
        else:
            assert lane.plan(ids, snap, None) == want[:3], f"step {step}"
        assert own._rr == ref._rr
    decided = metrics.child(metrics.decisions, "remote_prefill").value
    assert decided == ref.metrics.child(ref.metrics.decisions, "remote_prefill").value > 0
    mirrored.apply(KVEventView("stored", snap.prefill[0].worker_id, 10_000, (1, 2), "host"))
    assert lane.rust.plan([1, 2, 3]) is None  # declined: the scheduler plans
    assert lane.plan(list(range(300)), snap, None)[0] in ("remote_prefill", "local_prefill")


@needs_lane
def test_values_out_of_range_are_planned_by_the_scheduler() -> None:
    """A block hash outside 128 bits in a worker's KV event, a count outside 64 bits in
    its stats: the index and the request never fail; the scheduler plans."""
    cfg = RouterConfig(model_dir="/m")
    ref = Scheduler(cfg, PrefixIndex(cfg.prefix_index_capacity), RouterMetrics(), random.Random(5))
    mirrored = PrefixIndex(cfg.prefix_index_capacity)
    own = Scheduler(cfg, mirrored, RouterMetrics(), random.Random(5))
    lane = lane_plan.LanePlanner(
        lane_plan.planner(lane_mod, cfg, hashing.hash_key()), own, mirrored
    )
    snap = _snapshot(random.Random(2), 2, 2)
    huge = replace(snap.workers[0], stats=replace(snap.workers[0].stats, running=2**70))
    wide = Snapshot((huge, *snap.workers[1:]))
    assert (
        lane.plan(list(range(300)), wide, None)
        == _python_plan(ref, list(range(300)), wide, None)[:3]
    )
    assert lane.synced
    ev = KVEventView("stored", snap.prefill[0].worker_id, 1, (2**130, 5))
    ref.index.apply(ev)
    mirrored.apply(ev)  # no exception: the mirror is left behind
    assert not lane.synced and len(mirrored) == len(ref.index)
    for n in (300, 20, 500):
        assert (
            lane.plan(list(range(n)), snap, None)
            == _python_plan(ref, list(range(n)), snap, None)[:3]
        )
