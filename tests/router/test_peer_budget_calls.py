"""The replicas' budget calls (router/peer_budgets.py; issue 44 item 6), in this process:
only a call signed with the service's ``router-peer`` key, sent to this replica's own
address and not replayed, touches a key's counters; an owner that does not answer
refuses (503), never admits; when a key's owner changes, calls under another peer list are
refused, the old owner hands its counts over once it sees the new list (a gone one's
requests in flight are counted from the replicas that hold them), the new owner admits
nothing for the key before that, and its buckets start empty: the move admits nothing
beyond the budget. tests/router/test_peer_budgets.py runs three whole routers."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve import keys, signing
from pdserve.router.errors import APIError
from pdserve.router.peer_budgets import PATH, budget_id, owner_of
from pdserve.testing.peer_replicas import replicas

pytestmark = pytest.mark.unit


def _owned_by(urls: list[str], which: str, peers: list[str] | None = None) -> str:
    """A client whose owner over ``peers`` (default ``urls``) is ``which``."""
    peers = sorted(peers or urls)
    return next(c for i in range(1000) if owner_of(budget_id(c := f"key:{i}"), peers) == which)


async def _enter_all(reps, client: str, times: int) -> tuple[int, list[int]]:  # type: ignore[no-untyped-def]
    admitted, refused = 0, []
    for i in range(times):
        try:
            await reps[i % len(reps)].budgets.enter(client)
            admitted += 1
        except APIError as err:
            refused.append(err.status)
    return admitted, refused


async def test_a_cap_holds_across_replicas_and_an_unreachable_owner_refuses() -> None:
    async with replicas(3, cap=1) as reps:
        urls = [r.url for r in reps]
        admitted, refused = await _enter_all(reps, "key:a", 9)
        assert admitted == 1 and set(refused) == {429}
        owner = next(r for r in reps if r.url == owner_of(budget_id("key:b"), sorted(urls)))
        others = [r for r in reps if r is not owner]
        await owner.stop()
        admitted, refused = await _enter_all(others, "key:b", 6)
        assert admitted == 0 and refused == [503] * 6


async def test_only_signed_calls_for_this_address_count() -> None:
    async with replicas(2, cap=1) as reps:
        target = reps[0]
        cid = budget_id("key:x")
        view = target.budgets.view.encode()  # the caller's peer list: the owner's
        body = b'{"op": "enter", "id": "%s", "n": 1, "v": "%s"}' % (cid.encode(), view)
        host = target.url.removeprefix("http://")
        ring = keys.KeyRing(keys.ROUTER_PEER, "peers")
        other = keys.KeyRing(keys.ROUTER_PEER, "another service")
        async with httpx.AsyncClient() as h:

            async def post(auth: str | None, to: str = host) -> httpx.Response:
                headers = {"Host": to, **({signing.HEADER: auth} if auth else {})}
                return await h.post(target.url + PATH, content=body, headers=headers)

            assert (await post(None)).status_code == 401
            assert (
                await post(signing.sign(other, "POST", PATH, body, host=host))
            ).status_code == 401
            wrong = reps[1].url.removeprefix("http://")  # signed for the other replica
            assert (
                await post(signing.sign(ring, "POST", PATH, body, host=wrong), wrong)
            ).status_code == 401
            assert target.budgets.counts.count(cid) == 0
            auth = signing.sign(ring, "POST", PATH, body, host=host)
            ok = await post(auth)
            assert ok.status_code == 200 and ok.json() == {"error": None}
            assert signing.proof_ok(ring, auth, ok.headers.get(signing.PROOF_HEADER))
            assert (await post(auth)).status_code == 401  # the same call again: a replay
            assert target.budgets.counts.count(cid) == 1


async def test_a_new_owner_counts_what_is_in_flight_and_starts_its_buckets_empty() -> None:
    async with replicas(3, cap=1, rpm=3) as reps:
        urls = [r.url for r in reps]
        gone = reps[2]
        client = _owned_by(urls, gone.url)
        await reps[0].budgets.enter(client)  # counted at its owner, reps[2]
        new_owner = owner_of(budget_id(client), sorted(urls[:2]))
        await gone.stop()
        for r in reps[:2]:  # kubernetes: its endpoint leaves the Service
            r.budgets.set_peers(urls[:2])
        for _ in range(100):  # the in-flight request is adopted by the new owner
            await asyncio.sleep(0.01)
            owner = next(r for r in reps if r.url == new_owner)
            if owner.budgets.counts.count(budget_id(client)):
                break
        admitted, refused = await _enter_all(reps[:2], client, 4)
        assert admitted == 0 and refused == [429] * 4  # the old owner's count moved
        reps[0].budgets.leave(client)  # it ends: given back at the new owner
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not owner.budgets.counts.count(budget_id(client)):
                break
        assert (await _enter_all(reps[:2], client, 2))[0] == 1
        with pytest.raises(APIError) as err:  # the moved key's bucket starts empty
            await reps[1].budgets.take_request(client)
        assert err.value.status == 429


async def test_a_picker_replica_answers_the_budget_calls_on_its_admin_port() -> None:
    """endpointPicker mode: the picker's admin server (aiohttp, not the router's app)
    serves ``/internal/budget`` too, so picker replicas keep one budget per key."""
    from types import SimpleNamespace

    from pdserve.router.peer_budgets import PeerBudgets
    from pdserve.router.picker.service import PickerService
    from pdserve.router.ratelimit import RateLimiter
    from pdserve.testing.loopback import free_port

    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    ring = keys.KeyRing(keys.ROUTER_PEER, "peers")
    owner = PeerBudgets(urls[0], urls, RateLimiter(0, 0), 1, ring)
    caller = PeerBudgets(urls[1], urls, RateLimiter(0, 0), 1, ring)
    picker = PickerService.__new__(PickerService)  # its admin server alone
    picker.rt = SimpleNamespace(peers=owner, metrics=None)  # type: ignore[assignment]
    picker._ready = True
    await picker._serve_metrics("127.0.0.1", ports[0])
    try:
        client = _owned_by(urls, urls[0])
        await caller.enter(client)  # counted at the picker replica that owns it
        with pytest.raises(APIError) as err:
            await caller.enter(client)
        assert err.value.status == 429 and owner.counts.count(budget_id(client)) == 1
    finally:
        await caller.close()
        assert picker._metrics is not None
        await picker._metrics.cleanup()


def test_kubernetes_peers_are_the_services_ready_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--budget-peers kubernetes``: this replica is ``$POD_IP`` at the admin port, the
    peers the router Service's ready addresses (IPv6 in brackets), none until the watch
    says (every call a 503 meanwhile, never a lone replica owning every key)."""
    from pdserve.router.peer_budgets import PeerBudgets, own_url
    from pdserve.router.ratelimit import RateLimiter

    monkeypatch.setenv("POD_IP", "fd00::5")
    me = own_url("", 8083)
    assert me == "http://[fd00::5]:8083"
    monkeypatch.delenv("POD_IP")
    with pytest.raises(ValueError, match="POD_IP"):
        own_url("", 8083)
    ring = keys.KeyRing(keys.ROUTER_PEER, "peers")
    budgets = PeerBudgets(me, (), RateLimiter(0, 0), 1, ring)
    with pytest.raises(APIError) as err:
        asyncio.run(budgets.enter("key:a"))
    assert err.value.status == 503
    budgets.listen_endpoints(8083)(["fd00::5", "fd00::6"])
    assert budgets.peers == ("http://[fd00::5]:8083", "http://[fd00::6]:8083")


async def test_a_key_that_moved_admits_nothing_until_every_peer_hands_over() -> None:
    """A new owner admits nothing for a key that moved to it (503 budget_moving) until
    every peer of its old and new lists has answered on the new list, handing over its
    counts, or is gone (here: nothing listens); keys it owned all along are not held up;
    its buckets for a moved key start empty (SETTLE_S) while a key it owned before keeps
    its own."""
    from pdserve.router import peer_budgets as pb
    from pdserve.router.ratelimit import RateLimiter
    from pdserve.testing.loopback import free_port

    a, b, c = (f"http://127.0.0.1:{free_port()}" for _ in range(3))
    ring = keys.KeyRing(keys.ROUTER_PEER, "peers")
    me = pb.PeerBudgets(a, (a, b, c), RateLimiter(2, 0), 1, ring)
    moved = next(  # a key of c's that moves to this replica when c leaves
        k
        for i in range(1000)
        if owner_of(budget_id(k := f"key:{i}"), sorted([a, b, c])) == c
        and owner_of(budget_id(k), sorted([a, b])) == a
    )
    mine = _owned_by([a, b, c], a)
    me.pending.clear()  # as if its first list's counts had all come
    me._settle_view()
    me.set_peers((a, b))  # c left; b and c are not listening: each is asked first
    assert me.pending == {b, c}
    assert me.apply(pb.ENTER, budget_id(mine), 1) is None  # owned all along: no wait
    err = me.apply(pb.ENTER, budget_id(moved), 1)
    assert err is not None and err.code == "budget_moving" and err.status == 503
    assert await me.settled(2.0)  # both refuse the connection: gone, nothing to hand over
    assert me.apply(pb.ENTER, budget_id(moved), 1) is None
    err = me.apply(pb.REQUEST, budget_id(moved), 1)  # its bucket starts empty
    assert err is not None and err.status == 429
    assert me.apply(pb.REQUEST, budget_id(mine), 1) is None
    await me.close()


async def test_the_old_owner_hands_over_only_on_the_new_list_and_admits_no_more() -> None:
    """A joins A+B's budgets as a third replica C is added: the key moves from B to C.
    While B still sees the old list, C's hand-over request is refused (not yet) and C
    admits nothing for the key; calls under another list are refused by every owner;
    once B sees the new list it hands over its in-flight count (C refuses at the cap),
    admits nothing more for the key, and forwards the give-back of the request it
    counted to C."""
    from pdserve.router import peer_budgets as pb

    async with replicas(3, cap=1) as reps:
        urls = sorted(r.url for r in reps)
        by_url = {r.url: r for r in reps}
        old = list(urls)
        # Pick the one that joins and a key that moves to it from another.
        for joiner in urls:
            rest = [u for u in urls if u != joiner]
            key = next(
                (
                    k
                    for i in range(2000)
                    if owner_of(budget_id(k := f"key:{i}"), rest) != joiner
                    and owner_of(budget_id(k), old) == joiner
                ),
                None,
            )
            if key is not None:
                break
        assert key is not None
        cid = budget_id(key)
        new = by_url[joiner]
        prev = by_url[owner_of(cid, rest)]
        third = next(r for r in reps if r not in (new, prev))
        for r in reps:  # start from the list without the joiner, settled
            r.budgets.set_peers(rest)
        for r in reps:
            assert await r.budgets.settled(3.0)
        await third.budgets.acquire(key)  # counted at prev
        assert prev.budgets.counts.count(cid) == 1
        new.budgets.set_peers(old)  # the joiner sees the full list first
        with pytest.raises(APIError) as err:  # its local call: the count is still at prev
            await new.budgets.acquire(key)
        assert err.value.code == "budget_moving"
        with pytest.raises(APIError) as err:  # a call under the old list: refused by it
            await new.budgets._remote(
                prev.url, {"op": pb.ENTER, "id": budget_id("key:zz"), "n": 1, "v": "x"}
            )
        assert err.value.code == "budget_moving"
        prev.budgets.set_peers(old)  # now prev agrees: it hands over, admits no more
        for _ in range(200):
            await asyncio.sleep(0.01)
            if new.budgets.counts.count(cid):
                break
        assert new.budgets.counts.count(cid) == 1 and prev.budgets.counts.count(cid) == 0
        with pytest.raises(APIError) as err:  # under the old list, at prev: refused
            await third.budgets.acquire(key)
        assert err.value.code == "budget_moving"
        with pytest.raises(APIError) as err:  # the third replica has not answered yet
            await prev.budgets.acquire(key)
        assert err.value.code == "budget_moving"
        third.budgets.leave(key)  # counted at prev: forwarded to the joiner
        third.budgets.set_peers(old)  # all agree now
        assert await new.budgets.settled(3.0)
        assert new.budgets.counts.count(cid) == 0
        await prev.budgets.acquire(key)
        with pytest.raises(APIError) as err:
            await third.budgets.acquire(key)
        assert err.value.status == 429
        assert new.budgets.counts.count(cid) == 1


def test_a_peer_file_is_read_again_when_it_changes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--budget-peers @FILE``: URLs separated by commas, spaces or lines, ``#``
    comments; a changed file is handed on, one that does not parse is logged and the last
    good list kept; the router refuses a bad file at start."""
    import argparse
    import os

    from pdserve.router.from_args import budget_peers
    from pdserve.router.peer_list import PeerFile, read_peers

    path = tmp_path / "peers"
    path.write_text("http://10.0.0.1:8083, http://10.0.0.2:8083/  # two\nhttp://10.0.0.3:8083\n")
    assert read_peers(path) == tuple(f"http://10.0.0.{i}:8083" for i in (1, 2, 3))
    seen: list[tuple[str, ...]] = []
    watch = PeerFile(str(path), seen.append)
    watch.check()
    watch.check()  # unchanged: nothing new
    assert len(seen) == 1
    path.write_text("http://10.0.0.1:8083\nnot a url\n")
    os.utime(path, ns=(1, 1))
    watch.check()
    assert len(seen) == 1  # kept the last good list
    path.write_text("http://10.0.0.1:8083\n")
    os.utime(path, ns=(2, 2))
    watch.check()
    assert seen[-1] == ("http://10.0.0.1:8083",)
    args = argparse.Namespace(
        budget_peers=f"@{path}", budget_self="http://10.0.0.9:8083", discovery="static"
    )
    assert budget_peers(args) == (f"@{path}",)  # this replica need not be listed yet
    path.write_text("ftp://nope\n")
    with pytest.raises(SystemExit, match="budget-peers"):
        budget_peers(args)
    with pytest.raises(SystemExit, match="budget-self"):
        budget_peers(argparse.Namespace(budget_peers=f"@{path}", budget_self="", discovery=""))


async def test_a_call_waiting_at_the_cap_is_refused_once_the_list_changes() -> None:
    """A call at the cap waits a moment at the owner for a give-back; if the peer list
    changes meanwhile and the owner hands the key's count over, the wait ends in a 503
    (budget_moving), never an admit against the emptied count (found racing three real
    routers: two in flight at a cap of 1)."""
    from pdserve.router import peer_budgets as pb
    from pdserve.router.ratelimit import RateLimiter
    from pdserve.testing.loopback import free_port

    a, b, c = (f"http://127.0.0.1:{free_port()}" for _ in range(3))
    ring = keys.KeyRing(keys.ROUTER_PEER, "peers")
    me = pb.PeerBudgets(a, (a, b), RateLimiter(0, 0), 1, ring)
    me.pending.clear()
    me._settle_view()
    key = next(
        k
        for i in range(1000)
        if owner_of(budget_id(k := f"key:{i}"), sorted([a, b])) == a
        and owner_of(budget_id(k), sorted([a, b, c])) == c
    )
    cid = budget_id(key)
    assert me.apply(pb.ACQUIRE, cid, 1) is None
    waiting = asyncio.create_task(me.apply_waiting(pb.ACQUIRE, cid, 1))
    await asyncio.sleep(0.01)  # at the cap: it waits for a give-back
    me.set_peers((a, b, c))  # c joined: the key is c's
    assert me.hand_over(c) == {cid: 1} and me.counts.count(cid) == 0
    err = await waiting
    assert err is not None and err.code == "budget_moving"
    assert me.counts.count(cid) == 0
    await me.close()
