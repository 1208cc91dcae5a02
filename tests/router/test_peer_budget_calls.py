"""The replicas' budget calls (router/peer_budgets.py; issue 44 item 6), in this process:
only a call signed with the service's ``router-peer`` key, sent to this replica's own
address and not replayed, touches a key's counters; an owner that does not answer
refuses (503), never admits; when a key's owner changes, the requests still in flight
are counted at the new owner and its buckets start empty, so the move admits nothing
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
        body = b'{"op": "enter", "id": "%s", "n": 1}' % cid.encode()
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


def test_a_key_that_moved_admits_nothing_new_until_its_in_flight_count_can_arrive() -> None:
    """A new owner does not know the old owner's count: for ADOPT_WAIT_S it refuses new
    requests of a key that moved to it (503, retry) unless the others' in-flight counts
    (adopt) came, and its buckets for such a key start empty; keys it owned before are
    neither held nor emptied."""
    from pdserve.router import peer_budgets as pb
    from pdserve.router.ratelimit import RateLimiter

    now = [100.0]
    a, b, c = "http://10.0.0.1:8083", "http://10.0.0.2:8083", "http://10.0.0.3:8083"
    ring = keys.KeyRing(keys.ROUTER_PEER, "peers")
    me = pb.PeerBudgets(a, (a, b, c), RateLimiter(0, 0), 1, ring, clock=lambda: now[0])
    moved = next(  # a key of c's that moves to this replica when c leaves
        k
        for i in range(1000)
        if owner_of(budget_id(k := f"key:{i}"), sorted([a, b, c])) == c
        and owner_of(budget_id(k), [a, b]) == a
    )
    mine = _owned_by([a, b, c], a)
    me.set_peers((a, b))  # c left
    assert me.apply(pb.ENTER, budget_id(mine), 1) is None  # owned before: no wait
    err = me.apply(pb.ENTER, budget_id(moved), 1)
    assert err is not None and err.code == "budget_moving" and err.status == 503
    now[0] += pb.ADOPT_WAIT_S
    assert me.apply(pb.ENTER, budget_id(moved), 1) is None
    # Buckets: a key that moved here starts empty for SETTLE_S, one owned before full.
    rated = pb.PeerBudgets(a, (a, b, c), RateLimiter(2, 0), 0, ring, clock=lambda: now[0])
    rated.set_peers((a, b))
    assert rated.apply(pb.REQUEST, budget_id(mine), 1) is None
    err = rated.apply(pb.REQUEST, budget_id(moved), 1)
    assert err is not None and err.status == 429
