"""What a request of a key another replica owns costs in budget calls (issue 47; issue 44
item 6; router/peer_budgets.py): one signed ``acquire`` at the owner (the requests bucket
and the count in flight together) and one give-back, through the router's own glue
(``Runtime.take_request`` / ``admit`` / ``take_tokens`` / the ticket's release) with real
HTTP servers on loopback; give-backs that meet on the way to one owner go in one call,
and a give-back still on its way only refuses early, never admits over the cap. The rest
of the router is left out (tests/router/test_peer_budgets.py runs whole routers)."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.router import peer_budgets as pb
from pdserve.router.admission import Admission
from pdserve.router.errors import APIError
from pdserve.router.runtime import Runtime
from pdserve.testing.peer_replicas import Replica, replicas

pytestmark = pytest.mark.unit


def _keys_of(urls: list[str], owner: str, n: int) -> list[str]:
    peers = sorted(urls)
    return [c for i in range(2000) if pb.owner_of(pb.budget_id(c := f"key:{i}"), peers) == owner][
        :n
    ]


def _watch(owner: Replica) -> tuple[list[int], list[tuple[str, str, int]]]:
    """The owner's calls answered (one entry each) and the counter operations they made."""
    calls: list[int] = []
    ops: list[tuple[str, str, int]] = []
    answer, apply = owner.budgets.answer, owner.budgets.apply

    async def counted(*args: Any) -> Any:
        calls.append(1)
        return await answer(*args)

    def applied(op: str, cid: str, n: int) -> APIError | None:
        ops.append((op, cid, n))
        return apply(op, cid, n)

    owner.budgets.answer = counted  # type: ignore[method-assign]
    owner.budgets.apply = applied  # type: ignore[method-assign]
    return calls, ops


def _runtime(budgets: pb.PeerBudgets, tpm: int = 0) -> Runtime:
    """The runtime's budget glue alone: its peers, its admission (deferred, as --budget-peers
    sets it) and the one flag it reads."""
    rt = Runtime.__new__(Runtime)
    rt.peers = budgets
    rt.cfg = SimpleNamespace(rate_limit_tpm=tpm)  # type: ignore[assignment]
    rt.admission = Admission(16)
    rt.admission.counting, rt.admission.deferred = False, True
    return rt


async def _settled(budgets: pb.PeerBudgets) -> None:
    while budgets._tasks:
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("tpm", [0, 1000])
async def test_one_request_makes_one_acquire_call_at_the_owner(tpm: int) -> None:
    async with replicas(2, cap=2, rpm=100, tpm=tpm) as reps:
        owner, me = reps
        client = _keys_of([r.url for r in reps], owner.url, 1)[0]
        calls, ops = _watch(owner)
        rt = _runtime(me.budgets, tpm)
        await rt.take_request(client)  # before the body: requests bucket + count
        ticket = await rt.admit(client)  # the slot: no call
        await rt.take_tokens(client, 10)  # only with a tpm limit
        assert len(calls) == (2 if tpm else 1)
        assert [op for op, _, _ in ops if op in pb.OPS] == [
            pb.ACQUIRE,
            pb.REQUEST,
            pb.ENTER,
            *([pb.TOKENS] if tpm else []),
        ]
        assert owner.budgets.counts.count(pb.budget_id(client)) == 1
        ticket.release()
        await _settled(me.budgets)
        assert len(calls) == (3 if tpm else 2) and ops[-1][0] == pb.RELEASE
        assert owner.budgets.counts.count(pb.budget_id(client)) == 0
        # A request that ends before its slot (its body never came) gives the count back.
        await rt.take_request(client)
        rt.untake(client)
        await _settled(me.budgets)
        assert owner.budgets.counts.count(pb.budget_id(client)) == 0


async def test_give_backs_on_the_way_refuse_early_and_never_admit_over_the_cap() -> None:
    async with replicas(3, cap=1) as reps:
        urls = [r.url for r in reps]
        owner, a, b = reps
        keys = _keys_of(urls, owner.url, 3)
        calls, ops = _watch(owner)
        for k in keys:
            await a.budgets.acquire(k)
        del calls[:], ops[:]
        for k in keys:  # three give-backs in one tick: one call carries them
            a.budgets.leave(k)
        # Not given back yet (nothing ran since): a new request of the key is refused.
        err = owner.budgets.apply(pb.ENTER, pb.budget_id(keys[2]), 1)
        assert err is not None and err.status == 429
        await _settled(a.budgets)
        releases = [(cid, n) for op, cid, n in ops if op == pb.RELEASE]
        assert len(calls) == 1 and sorted(releases) == sorted((pb.budget_id(k), 1) for k in keys)
        # Many requests of three keys at once over the two other replicas: in flight never
        # over the cap of 1, whatever order the give-backs arrive in.
        in_flight = dict.fromkeys(keys, 0)
        most = 0

        async def one(i: int) -> None:
            nonlocal most
            k, via = keys[i % 3], (a, b)[i % 2]
            try:
                await via.budgets.acquire(k)
            except APIError as err:
                assert err.status == 429
                return
            in_flight[k] += 1
            most = max(most, in_flight[k])
            await asyncio.sleep(random.random() * 0.01)
            in_flight[k] -= 1
            via.budgets.leave(k)

        await asyncio.gather(*(one(i) for i in range(90)))
        await _settled(a.budgets)
        await _settled(b.budgets)
        assert most == 1
        assert all(owner.budgets.counts.count(pb.budget_id(k)) == 0 for k in keys)


async def test_give_backs_waiting_behind_one_on_its_way_ride_the_next_acquire() -> None:
    async with replicas(2, cap=1) as reps:
        owner, me = reps
        keys = _keys_of([r.url for r in reps], owner.url, 3)
        for k in keys:
            await me.budgets.acquire(k)
        calls, ops = _watch(owner)
        me.budgets.leave(keys[0])
        await asyncio.sleep(0)  # its give-back is on its way
        me.budgets.leave(keys[1])  # these two wait behind it...
        me.budgets.leave(keys[2])
        await me.budgets.acquire(keys[1])  # ...and go first in this call: admitted at a cap of 1
        await _settled(me.budgets)
        assert len(calls) == 2, ops
        ids = [pb.budget_id(k) for k in keys]
        assert [(op, cid) for op, cid, _ in ops if op in (pb.RELEASE, pb.ACQUIRE)] == [
            (pb.RELEASE, ids[0]),
            (pb.RELEASE, ids[1]),
            (pb.RELEASE, ids[2]),
            (pb.ACQUIRE, ids[1]),
        ]
        assert [owner.budgets.counts.count(i) for i in ids] == [0, 1, 0]


async def test_a_key_at_its_cap_waits_a_moment_for_a_give_back_on_its_way() -> None:
    """A request that ended on one replica is given back in a call of its own; the
    client's next request, sent at once through another replica, can reach the owner
    first. The owner waits up to GIVE_BACK_WAIT_S for it (then admits: the count is
    checked again, never over the cap) instead of refusing at once."""
    async with replicas(3, cap=1) as reps:
        owner, a, b = reps
        client = _keys_of([r.url for r in reps], owner.url, 1)[0]
        await a.budgets.acquire(client)
        second = asyncio.create_task(b.budgets.acquire(client))  # at the cap: it waits
        await asyncio.sleep(0.01)  # it reached the owner, at the cap
        assert not second.done()
        a.budgets.leave(client)  # the first one's give-back, late
        await second  # admitted
        assert owner.budgets.counts.count(pb.budget_id(client)) == 1
        with pytest.raises(APIError) as err:  # nothing given back: refused, a moment later
            await a.budgets.acquire(client)
        assert err.value.status == 429 and err.value.code == "concurrency_limit_exceeded"
        assert owner.budgets.counts.count(pb.budget_id(client)) == 1


async def test_a_tpm_limit_costs_no_second_call_once_the_key_is_known() -> None:
    """Under --rate-limit-tpm the acquire asks for a lease of the key's last cost; the
    request's cost comes out of it (no tokens call) and the rest rides the give-back.
    A request that costs more than its lease calls for the difference only."""
    async with replicas(2, cap=4, rpm=1000, tpm=1000) as reps:
        owner, me = reps
        client = _keys_of([r.url for r in reps], owner.url, 1)[0]
        cid = pb.budget_id(client)
        calls, ops = _watch(owner)
        rt = _runtime(me.budgets, 1000)
        level = lambda: owner.budgets.limiter._buckets[(cid, "tokens")].level  # noqa: E731

        async def one(cost: int) -> None:
            await rt.take_request(client)
            ticket = await rt.admit(client)
            await rt.take_tokens(client, cost)
            ticket.release()
            await _settled(me.budgets)

        await one(100)  # the first: its cost is not known yet, a tokens call
        assert len(calls) == 3  # acquire, tokens, give-back
        before = level()
        del calls[:], ops[:]
        await one(100)  # leased with the acquire: one call and its give-back
        assert len(calls) == 2, ops
        assert before - level() == pytest.approx(100, abs=2)
        del calls[:], ops[:]
        before = level()
        await one(40)  # leased 100, used 40: 60 given back with the release
        assert len(calls) == 2 and before - level() == pytest.approx(40, abs=2)
        del calls[:], ops[:]
        before = level()
        await one(150)  # leased 40: the other 110 asked for alone
        assert [op for op, _, _ in ops if op == pb.TOKENS] == [pb.TOKENS]
        assert ops[[op for op, _, _ in ops].index(pb.TOKENS)][2] == 110
        assert before - level() == pytest.approx(150, abs=2)


async def test_leases_never_let_a_key_past_its_tokens_per_minute() -> None:
    """Requests of one key at once over two replicas, each costing 60 tokens of a 300 a
    minute budget: the tokens used never exceed what the bucket held (300 and its refill
    meanwhile), leases or not; what was leased and not used goes back."""
    async with replicas(3, cap=0, rpm=10_000, tpm=300) as reps:
        owner, a, b = reps
        client = _keys_of([r.url for r in reps], owner.url, 1)[0]
        cid = pb.budget_id(client)
        used = 0
        start = asyncio.get_running_loop().time()

        async def one(i: int) -> None:
            nonlocal used
            via = (a, b)[i % 2].budgets
            try:
                await via.acquire(client)
            except APIError:
                return
            try:
                await via.take_tokens(client, 60 if i % 3 else 20)
                used += 60 if i % 3 else 20
                await asyncio.sleep(random.random() * 0.01)
            except APIError as err:
                assert err.status == 429
            finally:
                via.leave(client)

        for _ in range(4):
            await asyncio.gather(*(one(i) for i in range(12)))
        await _settled(a.budgets)
        await _settled(b.budgets)
        elapsed = asyncio.get_running_loop().time() - start
        assert used <= 300 + 300 * elapsed / 60 + 1, (used, elapsed)
        assert used >= 200  # the budget is used, not lost in leases
        left = owner.budgets.limiter._buckets[(cid, "tokens")].level
        assert left + used == pytest.approx(300 + 300 * elapsed / 60, abs=25)
        assert not a.budgets.lease and not b.budgets.lease
