"""lora-affinity and the knows-lora filter, table-driven over snapshots (no server)."""

from __future__ import annotations

import random

import pytest

from pdserve.protocol.contract import WorkerStats
from pdserve.router.config import RouterConfig
from pdserve.router.scheduling.filters import knows_lora
from pdserve.router.scheduling.route_request import RouteRequest
from pdserve.router.scheduling.routing import plan_route
from pdserve.router.scheduling.scorers import lora_affinity
from pdserve.router.scheduling.snapshot import Snapshot, WorkerView

pytestmark = pytest.mark.unit


def _worker(
    role: str,
    wid: str,
    resident: tuple[str, ...] = (),
    known: tuple[str, ...] = (),
    running: int = 0,
) -> WorkerView:
    stats = WorkerStats(
        role=role,
        worker_id=wid,
        loras=list(resident),
        lora_known=list(known or resident),
        running=running,
        kv_blocks_free=100,
        kv_blocks_total=100,
    )
    return WorkerView(f"http://{wid}", role, stats=stats)


@pytest.mark.parametrize(
    ("resident", "lora", "score"),
    [
        ((), None, 0.0),
        (("a",), None, 0.0),
        (("a",), "a", 1.0),
        (("b",), "a", 0.0),
        (("a", "b"), "b", 1.0),
    ],
)
def test_lora_affinity_scores(resident: tuple[str, ...], lora: str | None, score: float) -> None:
    w = _worker("decode", "d0", resident, known=("a", "b"))
    assert lora_affinity(w, RouteRequest(10, lora=lora)) == score


def test_knows_lora_keeps_workers_that_know_the_adapter() -> None:
    ws = [_worker("decode", "d0", known=("a",)), _worker("decode", "d1", known=("b",))]
    assert knows_lora(ws, RouteRequest(10)) == ws
    assert knows_lora(ws, RouteRequest(10, lora="b")) == ws[1:]
    assert knows_lora(ws, RouteRequest(10, lora="c")) == []


@pytest.mark.parametrize("seed", range(20))
def test_resident_worker_wins_at_equal_load(seed: int) -> None:
    """Equal load, one worker of each pool holds the adapter: every draw picks it; a base
    request spreads over both (ties random); a worker that does not know the adapter comes
    last even when idle."""
    snap = Snapshot(
        (
            _worker("prefill", "p0", known=("a",)),
            _worker("prefill", "p1", ("a",)),
            _worker("decode", "d0", ("a",)),
            _worker("decode", "d1", known=("a",)),
            _worker("decode", "d2"),
        )
    )
    cfg = RouterConfig(model_dir="/m", disagg_threshold=1)
    plan = plan_route(snap, RouteRequest(64, lora="a"), cfg, random.Random(seed))
    assert plan.prefill[0].worker_id == "p1" and plan.decode[0].worker_id == "d0"
    assert plan.decode[-1].worker_id == "d2"


def test_affinity_yields_to_a_much_lighter_worker() -> None:
    """Affinity is one weighted score among the load scores: a resident worker that is far
    busier loses to an idle one that knows the adapter."""
    snap = Snapshot(
        (
            _worker("decode", "d0", ("a",), running=20),
            _worker("decode", "d1", known=("a",)),
        )
    )
    cfg = RouterConfig(model_dir="/m")
    plan = plan_route(snap, RouteRequest(64, lora="a"), cfg, random.Random(0))
    assert plan.decode[0].worker_id == "d1"


def test_a_short_prompt_does_not_score_the_prefill_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the disaggregation threshold the plan is the decode worker's alone: the prefill
    pool is not ranked (its scoring was ~4% of the router's CPU on decode-direct)."""
    from pdserve.router.scheduling import routing

    calls: list[int] = []
    real = routing.rank_prefill

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(routing, "rank_prefill", counted)
    snap = Snapshot((_worker("prefill", "p0"), _worker("decode", "d0")))
    cfg = RouterConfig(model_dir="/m", disagg_threshold=512)
    assert plan_route(snap, RouteRequest(64), cfg, random.Random(0)).kind == "local_prefill"
    assert calls == []
    assert plan_route(snap, RouteRequest(600), cfg, random.Random(0)).kind == "remote_prefill"
    assert calls == [1]
