"""Per-client budgets across router replicas (router/discovery/replicas.py): each replica
enforces ceil(budget / replicas), so a client spread over the replicas gets the budget
once, not once per replica; the count from --router-replicas or the router Service's
ready endpoints, re-split when it changes."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from pdserve.router.admission import Admission
from pdserve.router.discovery.replicas import (
    ReplicaCount,
    ServiceReplicaCount,
    ready_endpoints,
    replica_count,
    share,
)
from pdserve.router.errors import APIError
from pdserve.router.main import add_arguments, build_config
from pdserve.router.ratelimit import RateLimiter

pytestmark = pytest.mark.unit


def test_share_rounds_up_and_keeps_off_off() -> None:
    assert [share(60, n) for n in (1, 2, 3, 7)] == [60, 30, 20, 9]
    assert share(1, 3) == 1  # a budget below the count still admits one per replica
    assert share(0, 3) == 0  # no limit stays no limit
    assert share(10, 0) == 10


def test_three_replicas_together_admit_the_budget_once() -> None:
    now = [0.0]
    replicas = [RateLimiter(rpm=30, tpm=0, clock=lambda: now[0]) for _ in range(3)]
    count = ReplicaCount(3)
    for r in replicas:
        count.listen(r.split)
    admitted = 0
    for i in range(45):  # a round-robin client: request i to replica i % 3
        try:
            replicas[i % 3].take_request("key:a")
            admitted += 1
        except APIError as exc:
            assert exc.status == 429 and exc.code == "rate_limit_exceeded"
    assert admitted == 30
    # One replica (not three) would have admitted 30 from a third of the requests: 45.
    alone = RateLimiter(rpm=30, tpm=0, clock=lambda: now[0])
    assert sum(_takes(alone, 45)) == 30


def _takes(limiter: RateLimiter, n: int) -> list[int]:
    out = []
    for _ in range(n):
        try:
            limiter.take_request("key:a")
            out.append(1)
        except APIError:
            out.append(0)
    return out


def test_a_changed_count_resizes_the_buckets_in_place() -> None:
    now = [0.0]
    lim = RateLimiter(rpm=60, tpm=600, clock=lambda: now[0])
    count = ReplicaCount(1)
    count.listen(lim.split)
    assert sum(_takes(lim, 10)) == 10  # 50 left of 60
    count.set(3)  # two more replicas: 20 each, the bucket clipped to it
    assert (lim.rpm, lim.tpm) == (20, 200)
    assert sum(_takes(lim, 25)) == 20
    count.set(0)  # never below one replica: the whole budget again
    assert count.replicas == 1 and (lim.rpm, lim.tpm) == (60, 600)
    now[0] += 60.0  # refilled to the new capacity
    assert sum(_takes(lim, 70)) == 60
    lim.take_tokens("key:a", 601)  # more than a minute's budget: once, from a full bucket
    with pytest.raises(APIError):
        lim.take_tokens("key:a", 1)  # then the debt refills first


async def test_per_key_concurrency_is_split_too() -> None:
    adm = Admission(slots=100, per_client=4)
    ReplicaCount(2).listen(adm.split)
    tickets = [await adm.acquire("key:a") for _ in range(2)]
    with pytest.raises(APIError) as err:
        await adm.acquire("key:a")
    assert err.value.status == 429 and err.value.code == "concurrency_limit_exceeded"
    adm.split(1)
    tickets += [await adm.acquire("key:a") for _ in range(2)]
    for t in tickets:
        t.release()
    assert adm.active == 0


def _slice(*endpoints: tuple[str, bool | None, bool]) -> dict:  # type: ignore[type-arg]
    return {
        "endpoints": [
            {"addresses": [a], "conditions": {"ready": r, "terminating": t}}
            for a, r, t in endpoints
        ]
    }


def test_service_count_is_its_ready_endpoints() -> None:
    slices = {
        "a": _slice(("10.0.0.1", True, False), ("10.0.0.2", None, False)),
        "b": _slice(
            ("10.0.0.2", True, False), ("10.0.0.3", False, False), ("10.0.0.4", True, True)
        ),
    }
    assert ready_endpoints(slices.values()) == 2  # .2 counted once; not ready, terminating out
    count = ServiceReplicaCount("llm", "ns", access=lambda: None)  # type: ignore[arg-type, return-value]
    seen: list[int] = []
    count.listen(seen.append)
    count.watch.slices = slices
    count._changed()
    count.watch.slices = {}
    count._changed()  # no ready endpoint (this one not ready yet): still 1
    assert seen == [1, 2, 1]


def _config(*argv: str) -> object:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return build_config(p.parse_args(["--model", "/m", "--decode", "http://d:1", *argv]))


@pytest.mark.parametrize(
    ("argv", "replicas", "service"),
    [
        ((), 1, ""),
        (("--router-replicas", "3"), 3, ""),
        (("--discovery", "kubernetes", "--service", "llm"), 1, "llm"),
        (
            (
                "--discovery",
                "kubernetes",
                "--service",
                "llm",
                "--router-service",
                "none",
                "--router-replicas",
                "2",
            ),
            2,
            "",
        ),
    ],
)
def test_flags(argv: tuple[str, ...], replicas: int, service: str) -> None:
    cfg = _config(*argv)
    assert cfg.router_replicas == replicas and cfg.router_service == service  # type: ignore[attr-defined]
    count = replica_count(cfg)  # type: ignore[arg-type]
    assert isinstance(count, ServiceReplicaCount) == bool(service)
    assert count.replicas == replicas


def test_bad_replica_count_is_refused() -> None:
    with pytest.raises(ValueError, match="router-replicas"):
        _config("--router-replicas", "0")


async def test_service_count_watch_starts_and_stops() -> None:
    count = ServiceReplicaCount(
        "llm", "ns", access=lambda: (_ for _ in ()).throw(OSError("no api"))
    )  # type: ignore[arg-type, return-value]
    await count.start()
    await asyncio.sleep(0.05)  # the watch fails and backs off; the count stays
    await count.close()
    assert count.replicas == 1
