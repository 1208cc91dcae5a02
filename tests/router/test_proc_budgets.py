"""Per-client budgets over ``--procs N`` (issue 44 item 6; router/shared_limits.py): the
processes share one table of per-key counts and buckets, so a cap is the replica's, not
``ceil(cap / N)`` per process (a cap of 1 over 4 processes allowed 4). Here the N
processes are N Admissions / RateLimiters over one table in this process (the table's
memory and lock are what a fork shares); tests/router/test_router_process.py runs the
real ``--procs``."""

from __future__ import annotations

import pytest

from pdserve.router import shared_limits
from pdserve.router.admission import Admission
from pdserve.router.errors import APIError
from pdserve.router.main import add_arguments, build_config
from pdserve.router.ratelimit import RateLimiter
from pdserve.router.shared_limits import SharedLimits

pytestmark = pytest.mark.unit
PROCS = 4


def _config(monkeypatch: pytest.MonkeyPatch, table: SharedLimits | None, *argv: str):  # type: ignore[no-untyped-def]
    import argparse

    monkeypatch.setattr(shared_limits, "_TABLE", table)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "/m", *argv])
    return build_config(args, 0, tuple(range(9000, 9000 + PROCS)))


def test_budgets_are_the_replicas_and_never_split_without_the_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ("--max-concurrency-per-key", "1", "--rate-limit-rpm", "10", "--max-queue", "64")
    cfg = _config(monkeypatch, SharedLimits(slots=64), *argv)
    assert (cfg.max_concurrency_per_key, cfg.rate_limit_rpm) == (1, 10)  # not per process
    assert cfg.max_queue == 16  # the slots are each process's own capacity: split
    with pytest.raises(ValueError, match="shared table"):
        _config(monkeypatch, None, *argv)  # no rounding-up fallback
    assert _config(monkeypatch, None).max_concurrency_per_key == 0  # no budgets: nothing shared


@pytest.mark.parametrize("cap", [1, 3])
async def test_a_cap_over_the_processes_admits_exactly_the_cap(cap: int) -> None:
    table = SharedLimits(slots=64)
    procs = [Admission(slots=8, per_client=cap, max_waiting=8, shared=table) for _ in range(PROCS)]
    tickets, refused = [], 0
    for i in range(4 * PROCS):  # one client's connections spread over the processes
        try:
            tickets.append(await procs[i % PROCS].acquire("key:a"))
        except APIError as exc:
            assert exc.code == "concurrency_limit_exceeded"
            refused += 1
    assert len(tickets) == cap and refused == 4 * PROCS - cap
    assert table.count("key:a") == cap
    other = await procs[1].acquire("key:b")  # another key has its own cap
    tickets.pop(0).release()  # one ends: one more is admitted, anywhere
    tickets.append(await procs[3].acquire("key:a"))
    with pytest.raises(APIError):
        await procs[2].acquire("key:a")
    for t in [*tickets, other]:
        t.release()
    assert table.count("key:a") == table.count("key:b") == 0
    assert all(p.active == 0 for p in procs)


async def test_waiters_count_against_the_shared_cap_and_leave_it() -> None:
    """A request waiting for a slot in one process counts; when it times out it leaves."""
    table = SharedLimits(slots=64)
    a = Admission(slots=1, per_client=2, max_waiting=4, wait_s=0.05, shared=table)
    b = Admission(slots=1, per_client=2, max_waiting=4, wait_s=0.05, shared=table)
    held = await a.acquire("key:x")  # a's only slot
    with pytest.raises(APIError) as err:
        await a.acquire("key:x")  # waits (counted: 2), then times out
    assert err.value.code == "queue_full" and table.count("key:x") == 1
    ticket = await b.acquire("key:x")
    with pytest.raises(APIError) as err:
        await b.acquire("key:x")
    assert err.value.code == "concurrency_limit_exceeded"
    held.release()
    ticket.release()
    assert table.count("key:x") == 0


def test_rate_buckets_are_shared_and_hold_one_big_request() -> None:
    now = [100.0]
    table = SharedLimits(slots=64, clock=lambda: now[0])
    procs = [RateLimiter(10, 1000, clock=lambda: now[0], shared=table) for _ in range(PROCS)]
    admitted = 0
    for i in range(40):
        try:
            procs[i % PROCS].take_request("key:a")
            admitted += 1
        except APIError as exc:
            assert exc.code == "rate_limit_exceeded"
    assert admitted == 10  # per process (ceil(10/4) = 3 each) it was 12
    procs[0].take_tokens("key:a", 5000)  # over a minute's budget: once, from a full bucket
    with pytest.raises(APIError):
        procs[1].take_tokens("key:a", 1)  # the debt is the replica's, whichever process
    now[0] += 60.0 * 5
    procs[2].take_tokens("key:a", 1)


def test_a_full_table_refuses_rather_than_lets_through() -> None:
    now = [100.0]
    table = SharedLimits(slots=shared_limits.PROBE, clock=lambda: now[0])
    for i in range(shared_limits.PROBE):
        assert table.enter(f"key:{i}", 1)
    with pytest.raises(APIError) as err:
        table.enter("key:new", 1)
    assert err.value.status == 429
    table.leave("key:0")  # idle (no buckets used): its slot goes to a newcomer
    assert table.enter("key:new", 1) and not table.enter("key:new", 1)
