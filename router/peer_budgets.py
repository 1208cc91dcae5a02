"""Per-key budgets exact across router replicas: each key's counters live on one replica.

Without this, every replica enforced ``ceil(budget / replicas)`` of a key's rate limits and
``--max-concurrency-per-key`` (a cap of 1 over 3 replicas admitted 3). With
``--budget-peers`` the replicas route the counters instead: the owner of a key is the
peer with the highest rendezvous score (BLAKE2b of the peer and the key's id) over the
peer list, the same on every replica. The owner counts the key's requests in flight, its
requests and tokens buckets in its own table (the one its ``--procs`` processes share,
router/shared_limits.py), against the whole budget; every other replica asks the owner
to take or give back over ``POST /internal/budget``, signed as the calls to the workers
are (pdserve/signing.py) under a key of its own purpose (``router-peer``), the call bound
to the owner's address, and the reply believed only with the owner's proof of the key.
The key itself never travels: its id is a BLAKE2b of it.

A request costs one call (issue 47): ``acquire`` takes the requests bucket and one more
request in flight together before the body is read (under a tpm limit it also leases the
key's tokens: below); its give-back (``release``) rides the next call to that owner when one
leaves first, else goes at once, or with the others when one is already on its way. The
calls go over the workers' keep-alive HTTP/1.1 pool (pdserve/worker_calls/http1.py) and
are answered on the router's bare-ASGI lane (``asgi``); a call is ~190 CPU-µs for both
ends where aiohttp and a FastAPI route cost ~500–830 (docs/router.md).

When the owner does not answer (down, partitioned, slow past ``CALL_TIMEOUT_S``) the
request is refused with a 503 and ``Retry-After``, never admitted on a local guess: the
budget is never exceeded, at the price of the owned keys' availability until the owner
answers again or leaves the peer list (kubernetes: its endpoint leaves the router
Service's EndpointSlices and its keys move to the next peer by the same hash).

When a key's owner changes (a peer joins or leaves) the replicas see the new peer list
at different moments (a watch, a file re-read), and for that while two of them can each
believe they own a key. The cap holds through it, failing closed (issue 44):

- every call carries its caller's view (``v``: a digest of its sorted peer list), and an
  owner refuses a call whose view is not its own (503 ``budget_moving``, Retry-After): a
  caller and an owner that admit together agree on who owns the key;
- the counts move with the keys (``handover``): a replica that owns keys it did not own
  under its last settled view asks every peer of its old and new lists for them; a peer
  answers only once its own view is the asker's, and then hands over its in-flight counts
  for the asker's keys (it owns none of them any more under that view, so it admits none:
  a call for one carries a view it refuses, or it is its own local call, which goes to
  the new owner); its give-backs that arrive later for them are forwarded
  (``moved``);
- until every peer has answered, a key that was not this replica's all along admits
  nothing (503 ``budget_moving``; a local call waits up to ``READY_WAIT_S`` first). A peer
  that refuses the connection is gone (nothing listens there, nothing is admitted there);
  one that does not answer at all counts as gone ``ADOPT_WAIT_S`` after the change;
  one that answers on another view is waited for, however long (fail closed).

Buckets do not move: a key that came from another owner starts with empty buckets for
one refill period after the change (``SETTLE_S``), so what the old owner's buckets let
through plus what the new one admits stays within one bucket's bound. Left: a peer that
is alive, silent to the new owner for ``ADOPT_WAIT_S`` and still admitting on its old
view (a partition while the list changes) can be over the cap by its own admissions;
with ``--procs N`` the hand-over carries the counts of the keys the answering process
has counted (its siblings share the table, not the list of keys).

A key's tokens bucket (``--rate-limit-tpm``) costs no second call once the key has been
seen: the acquire asks for a lease of tokens (``t``: the key's last cost here, for each
request of it not yet costed), the owner takes it from the bucket when it has as much
(all or nothing), the request's cost is taken from that lease, and what is left rides the
give-back (``refund``). Only a request that costs more than its lease calls for the rest
(``tokens``). Never over the limit: every token a request uses was taken at the owner
before it went on; a lease held a moment only refuses early.

Peers: ``--budget-peers URL,...`` (each replica's base URL, this one's included, named by
``--budget-self``), or ``kubernetes``: the ready endpoints of the router's own Service
(router/discovery/replicas.py) at ``--admin-port``, this replica ``$POD_IP``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve import keys, signing
from pdserve.router.admission import LocalCounts, concurrency_limit
from pdserve.router.errors import APIError, retry_later
from pdserve.router.ratelimit import RateLimiter
from pdserve.router.shared_limits import SharedLimits
from pdserve.worker_calls.http1 import CallFailed, WorkerPool

log = logging.getLogger(__name__)
PATH = "/internal/budget"
CALL_TIMEOUT_S = 1.0  # an owner slower than this is unreachable: 503
SETTLE_S = 60.0  # after a peer-list change, new buckets start empty this long
ADOPT_WAIT_S = 2.0  # a peer that does not answer at all is gone this long after a change
READY_WAIT_S = 0.5  # a call for a key whose counts are on their way waits this long
PULL_EVERY_S = 0.05  # asking the peers for the counts again (their view is not ours yet)
REQUEST, TOKENS, ENTER, LEAVE = "request", "tokens", "enter", "leave"
ACQUIRE, RELEASE = "acquire", "release"  # request + enter in one call; leaves in a batch
HANDOVER = "handover"  # a new owner asks a peer for its counts of the new owner's keys
OPS = (REQUEST, TOKENS, ENTER, LEAVE, ACQUIRE, RELEASE, HANDOVER)
UNVIEWED = (LEAVE, RELEASE, HANDOVER)  # calls answered whatever the caller's view
MAX_COSTS = 10_000  # keys whose last token cost a replica remembers
MAX_BODY = 8192
GIVE_BACK_WAIT_S = 0.1  # a key at its cap waits this long for a give-back on its way
RELEASE_BATCH = 64  # keys given back in one call at most (64 ids fit in MAX_BODY)
KUBERNETES = "kubernetes"  # --budget-peers: the router Service's ready endpoints


def budget_id(client: str) -> str:
    """The key's id on the wire and in the counters (the key itself never travels)."""
    return hashlib.blake2b(client.encode(), digest_size=16).hexdigest()


def owner_of(cid: str, peers: Sequence[str]) -> str:
    """The peer that owns ``cid``'s counters: the highest rendezvous score (a peer that
    leaves moves only its own keys)."""
    return max(peers, key=lambda p: hashlib.blake2b(f"{p}\0{cid}".encode()).digest())


def base_url(url: str) -> str:
    """``url`` as the peers compare it: scheme://host:port, no trailing slash."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
        raise ValueError(f"budget peer {url!r}: expected http://HOST:PORT")
    return f"{parts.scheme}://{parts.netloc}"


def http_url(address: str, port: int) -> str:
    """``http://address:port``, an IPv6 address in brackets."""
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def own_url(given: str, admin_port: int) -> str:
    """This replica's URL among the peers: ``--budget-self``, else (kubernetes) the pod's
    address from the downward API (``POD_IP``, operator/render_deployments.py) at
    ``--admin-port``."""
    if given:
        return given
    pod_ip = os.environ.get("POD_IP", "")
    if not pod_ip or not admin_port:
        raise ValueError(
            "--budget-peers kubernetes needs POD_IP and --admin-port, or --budget-self"
        )
    return http_url(pod_ip, admin_port)


def budget_moving() -> APIError:
    return retry_later(
        503,
        "this API key's budget is moving between router replicas; retry in a second",
        "budget_moving",
    )


def view_of(peers: Sequence[str]) -> str:
    """A peer list's digest (sorted, as ``set_peers`` keeps it): sent with every call."""
    return hashlib.blake2b("\n".join(peers).encode(), digest_size=8).hexdigest()


def owner_unreachable(owner: str) -> APIError:
    return retry_later(
        503,
        "this API key's budget is kept by another router replica that does not answer; retry later",
        "budget_owner_unreachable",
    )


class PeerBudgets:
    """This replica's side: the owner's counters for its keys, the calls for the others."""

    def __init__(
        self,
        self_url: str,
        peers: Sequence[str],
        limiter: RateLimiter,
        cap: int,
        ring: keys.KeyRing,
        shared: SharedLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ring:
            raise ValueError("--budget-peers needs the service secret (the calls are signed)")
        self.self_url = base_url(self_url)
        self.limiter, self.cap, self.ring, self.clock = limiter, cap, ring, clock
        self.counts: LocalCounts | SharedLimits = shared if shared is not None else LocalCounts()
        self.verifier = signing.Verifier(ring)
        self.peers: tuple[str, ...] = ()
        self.view = view_of(())
        self.previous: tuple[str, ...] = ()  # the list before the last change
        self.changed_at = -math.inf
        # The hand-over (a change of the peer list): the peers whose counts of this
        # replica's keys have not come yet, the last list under which none were missing,
        # and the lists since (a key admits while pending only if owned here in them all).
        self.pending: set[str] = set()
        self.stable: tuple[str, ...] | None = None
        self.since: list[tuple[str, ...]] = []
        self._view_at = -math.inf  # when the pending peers were last reset
        self._settled: asyncio.Event | None = None
        self._pulling: asyncio.Task[None] | None = None
        self.seen: set[str] = set()  # ids counted here as owner: candidates to hand over
        self.moved: dict[str, list[Any]] = {}  # id -> [its new owner, give-backs to forward]
        self.owed: dict[str, int] = {}  # id -> forwarded give-backs that came before its count
        self._handed: dict[str, dict[str, int]] = {}  # asker -> counts handed under this view
        self._answered: set[str] = set()  # peers whose counts came since the last settle
        self._reports: list[tuple[str, str, int]] = []  # (id, counted at, n) held by peers
        # The caller's side.
        self.held: dict[str, int] = {}  # id -> this replica's requests in flight
        self.owners: dict[str, str] = {}  # id -> the owner it was counted at
        self.epoch = 0  # peer lists seen; a count's give-back checks its owner after one
        self.counted_in: dict[str, int] = {}  # id -> the epoch its owner was last asked in
        self.costs: dict[str, int] = {}  # id -> its last request's tokens (the lease asked)
        self.lease: dict[str, int] = {}  # id -> tokens taken at its owner, not yet used
        self.uncosted: dict[str, int] = {}  # id -> requests acquired, not yet costed
        self._pool: WorkerPool | None = None  # keep-alive HTTP/1.1 to the peers, signed
        self._releases: dict[str, dict[str, list[int]]] = {}  # owner -> id -> [n, refund]
        self._releasing: set[str] = set()  # owners a give-back call is on the way to
        self._gave_back: dict[str, asyncio.Event] = {}  # id -> set at its next give-back
        self._tasks: set[asyncio.Task[None]] = set()
        self.set_peers(peers)
        self.changed_at = -math.inf  # the first list is no change

    # -- the peer list ------------------------------------------------------------------
    def set_peers(self, peers: Sequence[str]) -> None:
        """A new peer list (kubernetes: the ready replicas, this one only once it is
        ready, as the others see it; a file: its URLs). From now on calls carry its digest
        and only calls under it are admitted here; the counts of the keys this replica now
        owns are asked for from every peer of the old and new lists (``handover``). An
        empty list refuses every call (503) until one comes."""
        new = tuple(sorted({base_url(p) for p in peers}))
        if new == self.peers:
            return
        log.info("budget peers: %s", ", ".join(new))
        self.previous, self.peers, self.changed_at = self.peers, new, self.clock()
        self.view = view_of(new)
        self.epoch += 1
        self._handed.clear()
        self._view_at = self.clock()
        if self.self_url not in new:  # it owns nothing: no counts to wait for
            self.pending, self.stable, self.since = set(), None, []
        else:
            self.pending |= (set(new) | set(self.previous)) - {self.self_url}
            self.since.append(new)
        if self.pending:
            if self._settled is not None and self._settled.is_set():
                self._settled = asyncio.Event()
            self._pull_soon()
        else:
            self._settle_view()

    def listen_endpoints(self, port: int) -> Callable[[list[str]], None]:
        """A listener for the router Service's ready addresses (kubernetes peers)."""
        return lambda addresses: self.set_peers([http_url(a, port) for a in addresses])

    def ready(self, cid: str) -> bool:
        """Whether this replica may admit for ``cid`` (it owns it under its list): no
        peer's counts are still to come, or it owned ``cid`` under every list since the
        last one whose counts all came (then nobody else held it meanwhile)."""
        if not self.pending:
            return True
        me = self.self_url
        return self.stable is not None and all(
            owner_of(cid, v) == me for v in (self.stable, *self.since)
        )

    def start(self) -> None:
        """Ask the peers for the counts of this replica's keys (on the running loop)."""
        self._pull_soon()

    async def settled(self, timeout: float = READY_WAIT_S) -> bool:
        """Wait (up to ``timeout``) until no peer's counts are still to come."""
        if not self.pending:
            return True
        if self._settled is None or self._settled.is_set():
            self._settled = asyncio.Event()
        self._pull_soon()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), timeout)
        return not self.pending

    def _owns(self, cid: str) -> bool:
        """Whether ``cid``'s count is this replica's to keep now."""
        return bool(self.peers) and owner_of(cid, self.peers) == self.self_url and self.ready(cid)

    def _settle_view(self) -> None:
        """Every peer answered or is gone: the requests the peers hold that were counted
        at a gone one are counted here (its counts went with it; their give-backs come
        here, the key's owner under their list)."""
        own = [(cid, at, n) for cid, (at, n) in self.held_for(self.self_url).items()]
        for cid, at, n in self._reports + own:
            if at != self.self_url and at not in self._answered:
                self._take_over(cid, n)
        self._reports, self._answered = [], set()
        self.stable, self.since = self.peers, []
        if self._settled is not None:
            self._settled.set()

    def _pull_soon(self) -> None:
        """Ask the pending peers for their counts (needs the running loop: else the first
        call starts it)."""
        if self._pulling is not None and not self._pulling.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._pulling = loop.create_task(self._pull_all())

    async def _pull_all(self) -> None:
        while self.pending:
            view = self.view
            asked = sorted(self.pending)
            done = await asyncio.gather(*(self._pull(p, view) for p in asked))
            if self.view != view:  # the list changed again: ask under the new one
                continue
            self.pending.difference_update(p for p, ok in zip(asked, done, strict=True) if ok)
            if not self.pending:
                log.info("budget peers: every count of this replica's keys is in")
                self._settle_view()
                return
            await asyncio.sleep(PULL_EVERY_S)

    async def _pull(self, peer: str, view: str) -> bool:
        """Whether ``peer`` is done handing over under ``view``: it answered under it
        (its counts of this replica's keys taken over), or it is gone."""
        reply, refused = await self._post(peer, {"op": HANDOVER, "v": view, "to": self.self_url})
        if reply is None:
            return refused or self.clock() - self._view_at >= ADOPT_WAIT_S
        if reply.get("error"):  # its list is not ours yet: ask again
            return False
        for cid, n in dict(reply.get("ids") or {}).items():  # counted here, whatever came since
            self._take_over(str(cid), int(n))
        self._answered.add(peer)
        for cid, (at, n) in dict(reply.get("held") or {}).items():
            self._reports.append((str(cid), base_url(str(at)), int(n)))
        return self.view == view

    def _take_over(self, cid: str, n: int) -> None:
        owed = self.owed.pop(cid, 0)
        if owed > n:
            self.owed[cid] = owed - n
        self.moved.pop(cid, None)  # its counts are here again: give-backs stay here
        for _ in range(max(min(n - owed, 1 << 16), 0)):
            self.counts.enter(cid, 0)
        self.seen.add(cid)

    def hand_over(self, to: str) -> dict[str, int]:
        """The counts of the keys ``to`` owns under this replica's list (it asked under
        the same list), taken off here: this replica owns none of them, so it admits none;
        their give-backs that come here later go on to ``to``. Asked again (its answer
        lost), the same counts again."""
        handed = self._handed.setdefault(to, {})
        for cid in list(self.seen):
            n = self.counts.count(cid)
            if n <= 0:
                self.seen.discard(cid)
            elif to != self.self_url and owner_of(cid, self.peers) == to:
                for _ in range(n):
                    self.counts.leave(cid)
                self.seen.discard(cid)
                handed[cid] = handed.get(cid, 0) + n
                moved = self.moved.get(cid)
                self.moved[cid] = [to, n + (moved[1] if moved and moved[0] == to else 0)]
        return handed

    def held_for(self, to: str) -> dict[str, list[Any]]:
        """This replica's requests in flight of ``to``'s keys that were counted at
        another replica: {id: [where, n]} (``to`` counts them if that one is gone)."""
        if not self.peers:
            return {}
        return {
            cid: [at, n]
            for cid, n in self.held.items()
            if (at := self.owners.get(cid, "")) and at != to and owner_of(cid, self.peers) == to
        }

    # -- a request's calls --------------------------------------------------------------
    async def take_request(self, client: str) -> None:
        await self._call(REQUEST, budget_id(client), 1)

    async def take_tokens(self, client: str, n: int) -> None:
        """``client``'s request costs ``n`` tokens: taken from its lease when that holds
        as many (no call), else the rest at its owner."""
        cid = budget_id(client)
        if len(self.costs) >= MAX_COSTS and cid not in self.costs:
            self.costs.clear()
        self.costs[cid] = n
        waiting = self.uncosted.get(cid, 0)
        if waiting > 1:
            self.uncosted[cid] = waiting - 1
        else:
            self.uncosted.pop(cid, None)
        have = self.lease.pop(cid, 0)
        if have >= n:
            if have > n:
                self.lease[cid] = have - n
            return
        try:
            await self._call(TOKENS, cid, n - have)
        except BaseException:
            if have:
                self.lease[cid] = self.lease.get(cid, 0) + have
            raise

    async def enter(self, client: str) -> None:
        """Count one more request of ``client`` in flight (429 at the cap, 503 when its
        owner does not answer)."""
        cid, epoch = budget_id(client), self.epoch
        owner = await self._call(ENTER, cid, 1)
        self.held[cid] = self.held.get(cid, 0) + 1
        self.owners[cid] = owner
        self.counted_in[cid] = epoch  # the list it was asked under

    async def acquire(self, client: str) -> None:
        """``take_request`` then ``enter`` in one call to the key's owner: its requests
        bucket, then one more request in flight (the same refusals in the same order:
        a request refused at the cap has taken its request as before); under a tpm limit
        it asks for a lease of the tokens its request will likely cost."""
        cid = budget_id(client)
        ask = 0
        if self.limiter.tpm > 0 and cid in self.costs:
            ask = self.costs[cid] * (self.uncosted.get(cid, 0) + 1) - self.lease.get(cid, 0)
        epoch = self.epoch
        owner, granted = await self._acquire(cid, max(ask, 0))
        self.held[cid] = self.held.get(cid, 0) + 1
        self.owners[cid] = owner
        self.counted_in[cid] = epoch  # the list it was asked under
        if self.limiter.tpm > 0:
            self.uncosted[cid] = self.uncosted.get(cid, 0) + 1
        if granted:
            self.lease[cid] = self.lease.get(cid, 0) + granted

    def leave(self, client: str) -> None:
        """One of ``client``'s requests ended: given back at its owner (in the background
        for a remote one; a lost call leaves the owner's count high, never low), with the
        tokens leased and not used beyond what its other requests here may cost."""
        cid = budget_id(client)
        n = self.held.get(cid, 0) - 1
        owner = self.owners.get(cid, "")
        epoch = self.counted_in.get(cid)
        refund = 0
        if n > 0:
            self.held[cid] = n
            if self.lease:
                spare = self.lease.get(cid, 0) - self.costs.get(cid, 0) * self.uncosted.get(cid, 0)
                if spare > 0:
                    refund = spare
                    self.lease[cid] -= spare
        else:
            self.held.pop(cid, None)
            self.owners.pop(cid, None)
            self.counted_in.pop(cid, None)
            if self.uncosted:
                self.uncosted.pop(cid, None)
            if self.lease:
                refund = self.lease.pop(cid, 0)
        moved = (
            epoch != self.epoch
            and owner not in ("", self.self_url)
            and bool(self.peers)
            and owner_of(cid, self.peers) != owner
        )
        if moved:  # the key moved since; the lease's rest stays spent (the old bucket's)
            self._background(self._release_moved(owner, cid))
        elif owner == self.self_url:  # counted here (or handed over since: forwarded)
            self.apply(LEAVE, cid, 1)
            if refund:
                self.limiter.give_tokens(cid, refund)
        elif owner:
            self._release_later(owner, cid, refund)

    async def _release_moved(self, at: str, cid: str) -> None:
        """A give-back of a request counted at ``at`` before ``cid`` moved: to ``at``
        while it is listed (it still holds the count, or forwards it to the replica it
        handed it to), else, or when it does not answer, to the key's owner now (which
        counted it from the hand-over or from the replicas' reports of a gone owner; one
        that comes before its count is owed)."""
        if at in self.peers and await self._send_body(at, {"op": RELEASE, "ids": {cid: 1}}):
            return
        now = owner_of(cid, self.peers) if self.peers else ""
        if now == self.self_url:
            self._give_back(cid, 1, forwarded=True)
        elif now:
            await self._send_body(now, {"op": RELEASE, "ids": {cid: 1}, "fwd": True})

    def _release_later(self, owner: str, cid: str, refund: int = 0) -> None:
        """A give-back to ``owner``: sent at once when no give-back to it is on the way,
        else with every other that comes meanwhile in the next call (at most
        RELEASE_BATCH keys a call). No timer and no wait when calls are rare; one call for
        many when they are not. Late only keeps the owner's count high a moment: it
        refuses early, never admits over the cap."""
        waiting = self._releases.setdefault(owner, {})
        entry = waiting.setdefault(cid, [0, 0])
        entry[0] += 1
        entry[1] += refund
        if owner not in self._releasing:
            self._releasing.add(owner)
            self._background(self._release_all(owner))

    async def _release_all(self, owner: str) -> None:
        try:
            while waiting := self._releases.pop(owner, None):
                await self._send_body(owner, {"op": RELEASE, **self._batch(owner, waiting)})
        finally:
            self._releasing.discard(owner)

    def _batch(self, owner: str, waiting: dict[str, list[int]]) -> dict[str, Any]:
        """At most RELEASE_BATCH of ``waiting`` as a call's ``ids`` and ``refund``; the
        rest wait again for ``owner``."""
        items = list(waiting.items())
        if len(items) > RELEASE_BATCH:
            rest = self._releases.setdefault(owner, {})
            for c, (k, t) in items[RELEASE_BATCH:]:
                entry = rest.setdefault(c, [0, 0])
                entry[0] += k
                entry[1] += t
            items = items[:RELEASE_BATCH]
        out: dict[str, Any] = {"ids": {c: k for c, (k, _) in items}}
        refund = {c: t for c, (_, t) in items if t}
        if refund:
            out["refund"] = refund
        return out

    async def _acquire(self, cid: str, ask: int) -> tuple[str, int]:
        """ACQUIRE at ``cid``'s owner: (the owner, the tokens it leased)."""
        if not self.peers:
            raise owner_unreachable("")
        owner = owner_of(cid, self.peers)
        if owner == self.self_url:
            err = await self.apply_waiting(ACQUIRE, cid, 1)
            if err is not None:
                raise err
            return owner, self.lease_tokens(cid, ask) if ask else 0
        call: dict[str, Any] = {"op": ACQUIRE, "id": cid, "n": 1, "v": self.view}
        if ask:
            call["t"] = ask
        waiting = self._releases.pop(owner, None)
        if waiting:  # give-backs queued behind one on its way: they ride this call
            ridden = self._batch(owner, waiting)
            call["release"] = ridden["ids"]
            if "refund" in ridden:
                call["refund"] = ridden["refund"]
        reply = await self._remote(owner, call)
        return owner, int(reply.get("t") or 0)

    async def _call(self, op: str, cid: str, n: int) -> str:
        if not self.peers:
            raise owner_unreachable("")
        owner = owner_of(cid, self.peers)
        if owner == self.self_url:
            err = await self.apply_waiting(op, cid, n)
            if err is not None:
                raise err
            return owner
        await self._remote(owner, {"op": op, "id": cid, "n": n, "v": self.view})
        return owner

    async def _remote(self, owner: str, call: dict[str, Any]) -> dict[str, Any]:
        reply = await self._send_body(owner, call)
        if reply is None:  # the give-backs it carried may be lost: counts high, never low
            raise owner_unreachable(owner)
        if reply.get("error"):
            e = reply["error"]
            raise APIError(
                int(e.get("status", 429)),
                str(e.get("message", "")),
                code=str(e.get("code", "")) or None,
                headers={"Retry-After": str(e["retry_after"])} if e.get("retry_after") else None,
            )
        return reply

    # -- the owner's side ---------------------------------------------------------------
    def apply(self, op: str, cid: str, n: int) -> APIError | None:
        """``op`` on this replica's counters of ``cid``: None, or the refusal. Nothing is
        admitted for a key whose counts may still be at another replica (``ready``)."""
        try:
            if op in (LEAVE, RELEASE):
                self._give_back(cid, n)
                return None
            if self.pending and not self.ready(cid):
                self._pull_soon()
                return budget_moving()
            if op == ACQUIRE:
                err = self.apply(REQUEST, cid, 1)
                return err if err is not None else self.apply(ENTER, cid, 1)
            if op in (REQUEST, TOKENS):
                self._settle(cid)
                if op == REQUEST:
                    self.limiter.take_request(cid)
                else:
                    self.limiter.take_tokens(cid, n)
            elif op == ENTER:
                if self.cap and not self.counts.enter(cid, self.cap):
                    return concurrency_limit(self.cap)
                self.seen.add(cid)
        except APIError as err:
            return err
        return None

    def _give_back(self, cid: str, n: int, forwarded: bool = False) -> None:
        """``n`` of ``cid``'s requests ended. Counted here, or handed over (``moved``):
        then they go on to the replica that has the count now. A forwarded give-back
        that comes before the count it belongs to is owed, and taken off that count."""
        n = max(min(n, 1 << 16), 1)
        if self.moved and (moved := self.moved.get(cid)) is not None:
            on = min(n, moved[1])
            moved[1] -= on
            if moved[1] <= 0:
                del self.moved[cid]
            self._background(
                self._send_body(moved[0], {"op": RELEASE, "ids": {cid: on}, "fwd": True})
            )
            n -= on
        if n:
            have = self.counts.count(cid)
            for _ in range(min(n, have)):
                self.counts.leave(cid)
            if n >= have:
                self.seen.discard(cid)  # nothing in flight here to hand over
            if n > have and (forwarded or not self._owns(cid)):
                # Before the count it belongs to (a hand-over still on its way): owed.
                self.owed[cid] = self.owed.get(cid, 0) + n - have
        waiting = self._gave_back.pop(cid, None)
        if waiting is not None:
            waiting.set()

    def lease_tokens(self, cid: str, ask: int) -> int:
        """``ask`` tokens of ``cid``'s bucket taken for a request admitted here, if the
        bucket has as many (else none: the request's cost is then asked for alone)."""
        if ask <= 0 or ask > self.limiter.tpm:
            return 0
        try:
            self.limiter.take_tokens(cid, ask)
        except APIError:
            return 0
        return ask

    async def apply_waiting(self, op: str, cid: str, n: int) -> APIError | None:
        """``apply``; a key whose counts are on their way here waits up to READY_WAIT_S
        for them; a key at its cap (``acquire``, ``enter``) waits up to
        GIVE_BACK_WAIT_S for a give-back first: a request of it that just ended on another
        replica is given back in one call of its own, which can come after a new request
        sent at once (the client saw its answer end). The count is checked again then:
        never over the cap; the refusal is the same, a moment later. A wait across a
        change of the peer list ends in a 503 ``budget_moving``: the key's count may have
        been handed over meanwhile."""
        epoch = self.epoch
        err = self.apply(op, cid, n)
        if err is not None and err.code == "budget_moving":
            await self.settled()
            if self.epoch != epoch:  # the list changed meanwhile: the key may be elsewhere
                return budget_moving()
            err = self.apply(op, cid, n)
        if err is None or op not in (ACQUIRE, ENTER) or err.code != "concurrency_limit_exceeded":
            return err
        event = self._gave_back.setdefault(cid, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), GIVE_BACK_WAIT_S)
        if self._gave_back.get(cid) is event and not event.is_set():
            del self._gave_back[cid]  # nobody gave back (a sibling --procs may have)
        if self.epoch != epoch:  # its count may have been handed over meanwhile
            return budget_moving()
        again = self.apply(ENTER, cid, 1)  # the requests bucket was taken already
        return err if again is not None else None

    def _settle(self, cid: str) -> None:
        """Soon after a change of the peer list a key may have come from another owner
        whose bucket was spent: its first bucket here starts empty, not full (a key this
        replica owned before keeps its own; after a start every key starts empty: this
        replica's buckets before a restart are lost)."""
        if self.clock() - self.changed_at >= SETTLE_S:
            return
        if not self.previous or owner_of(cid, self.previous) != self.self_url:
            self.limiter.start_empty(cid, self.limiter.clock())

    async def handle(self, request: Request) -> Response:
        """``POST /internal/budget`` from another replica (the router's app)."""
        status, body, headers = await self.answer(
            request.headers.get(signing.HEADER),
            request.headers.get("host", ""),
            request.url.path,
            request.stream(),
        )
        return JSONResponse(body, status_code=status, headers=headers)

    async def asgi(self, scope: Any, receive: Any, send: Any) -> None:
        """``POST /internal/budget`` as a bare ASGI call: the router's direct lane
        (router/app.py), past FastAPI's routing and its per-call parameter copies, which
        cost more CPU than the call's own work."""
        auth = host = None
        for name, value in scope["headers"]:
            if name == signing.HEADER_KEY:
                auth = value.decode("latin-1")
            elif name == b"host":
                host = value.decode("latin-1")

        async def chunks() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return
                yield message.get("body", b"")
                if not message.get("more_body"):
                    return

        status, body, headers = await self.answer(auth, host or "", scope["path"], chunks())
        raw = json.dumps(body).encode()
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(raw))]
        head += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": raw})

    async def answer(
        self, auth: str | None, host: str, path: str, chunks: AsyncIterator[bytes]
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """Another replica's call: (status, JSON body, headers). Signed, bound to this
        replica's address; the header is checked before a byte of the (small) body is
        read, and the body must be in within ``CALL_TIMEOUT_S``."""
        why = self.verifier.precheck(auth)
        if not why and host != urlsplit(self.self_url).netloc:
            why = "not this replica's address"
        if why:
            return 401, {"error": why}, {}
        raw = b""
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                async for chunk in chunks:
                    raw += chunk
                    if len(raw) > MAX_BODY:
                        return 413, {"error": "body too large"}, {}
        except TimeoutError:
            return 408, {"error": "body too slow"}, {}
        verdict = self.verifier.check("POST", path, auth, raw, host=host)
        if verdict.key is None:
            return 401, {"error": verdict.reason}, {}
        try:
            body = json.loads(raw)
            op = body["op"]
            if op == RELEASE:  # a batch of give-backs: {"ids": {id: n}, "refund": {id: t}}
                calls = [(op, str(c), int(k)) for c, k in dict(body["ids"]).items()]
            elif op == HANDOVER:
                calls = [(op, "0" * 32, 0)]
                to = base_url(str(body["to"]))
            else:  # give-backs that rode an acquire go first (those requests ended)
                ridden = dict(body.get("release") or {}) if op == ACQUIRE else {}
                calls = [(RELEASE, str(c), int(k)) for c, k in ridden.items()]
                calls.append((op, str(body["id"]), int(body.get("n", 1))))
            refund = {str(c): int(t) for c, t in dict(body.get("refund") or {}).items()}
            ask = int(body.get("t") or 0)
            forwarded = bool(body.get("fwd"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return 400, {"error": "bad budget call"}, {}
        if op not in OPS or not calls or any(len(cid) != 32 for _, cid, _ in calls):
            return 400, {"error": f"bad budget op {op!r}"}, {}
        out: dict[str, Any] = {"error": None}
        err = None
        if op == HANDOVER:
            if body.get("v") != self.view:
                err = budget_moving()
            else:
                out["ids"], out["held"] = self.hand_over(to), self.held_for(to)
        for what, cid, n in calls if op != HANDOVER else ():
            if what == RELEASE:
                if forwarded:
                    self._give_back(cid, n, forwarded)
                else:
                    self.apply(RELEASE, cid, n)
            elif body.get("v") != self.view:  # the caller sees another peer list
                err = budget_moving()
            else:
                err = await self.apply_waiting(what, cid, n)
                if err is None and what == ACQUIRE and ask > 0:
                    out["t"] = self.lease_tokens(cid, ask)
        for cid, t in refund.items():
            if len(cid) == 32 and t > 0:
                self.limiter.give_tokens(cid, t)
        if err is not None:
            retry = (err.headers or {}).get("Retry-After")
            out["error"] = {
                "status": err.status,
                "message": err.message,
                "code": err.code,
                "retry_after": retry,
            }
        return 200, out, {signing.PROOF_HEADER: signing.proof(verdict.key, auth or "")}

    # -- calls to another replica -------------------------------------------------------
    async def _send_body(self, owner: str, call: dict[str, Any]) -> dict[str, Any] | None:
        """The owner's answer, or None when it does not answer or cannot prove the key."""
        return (await self._post(owner, call))[0]

    async def _post(self, owner: str, call: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        """One signed POST on a kept-alive connection to ``owner`` (the workers' HTTP/1.1
        pool, pdserve/worker_calls/http1.py: signed for the owner's address, its reply
        believed only with the proof), within CALL_TIMEOUT_S in all: (its answer or None,
        whether nothing listens at its address: the connection refused)."""
        if self._pool is None:
            self._pool = WorkerPool(self.ring)
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                resp = await self._pool.post(owner, PATH, json.dumps(call).encode(), CALL_TIMEOUT_S)
                async with resp:
                    reply = await resp.read()
            if resp.status != 200:
                log.warning("budget owner %s refused a call (%d)", owner, resp.status)
                return None, False
            out = json.loads(reply)
            return (out if isinstance(out, dict) else None), False
        except (CallFailed, TimeoutError, ValueError, OSError) as exc:
            log.warning("budget owner %s unreachable: %s", owner, exc)
            return None, isinstance(exc.__cause__, ConnectionRefusedError)

    def _background(self, call: Any) -> None:
        async def run() -> None:
            await call

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._pulling is not None:
            self._pulling.cancel()
        if self._tasks:  # the give-backs on the way (and those waiting behind them)
            await asyncio.wait(set(self._tasks), timeout=CALL_TIMEOUT_S)
        if self._pool is not None:
            await self._pool.close()
