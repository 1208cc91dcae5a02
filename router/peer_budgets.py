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
request in flight together before the body is read (``tokens`` is a second call, under a
tpm limit only); its give-back (``release``) rides the next call to that owner when one
leaves first, else goes at once, or with the others when one is already on its way. The
calls go over the workers' keep-alive HTTP/1.1 pool (pdserve/worker_calls/http1.py) and
are answered on the router's bare-ASGI lane (``asgi``); a call is ~190 CPU-µs for both
ends where aiohttp and a FastAPI route cost ~500–830 (docs/router.md).

When the owner does not answer (down, partitioned, slow past ``CALL_TIMEOUT_S``) the
request is refused with a 503 and ``Retry-After``, never admitted on a local guess: the
budget is never exceeded, at the price of the owned keys' availability until the owner
answers again or leaves the peer list (kubernetes: its endpoint leaves the router
Service's EndpointSlices and its keys move to the next peer by the same hash).

When a key's owner changes (a peer joins or leaves), the requests the replicas still hold
for it are counted at the new owner (``adopt``: each replica sends its own in-flight
counts for the keys it holds whose owner changed, once it sees the change); the new owner
admits nothing new for a key that moved to it until one arrives or ``ADOPT_WAIT_S`` has
passed (a 503 with ``Retry-After``); and its buckets for keys it did not hold start empty
for one refill period after a change of the peer list (``SETTLE_S``): what the old
owner's buckets already let through plus what the new one admits stays within one
bucket's bound. What is left: a replica that sees the change later than ``ADOPT_WAIT_S``
(a slow watch) sends its adopt late, and meanwhile the key can be over its cap by that
replica's requests in flight.

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
from pdserve.router.errors import APIError
from pdserve.router.ratelimit import RateLimiter
from pdserve.router.shared_limits import SharedLimits
from pdserve.worker_calls.http1 import CallFailed, WorkerPool

log = logging.getLogger(__name__)
PATH = "/internal/budget"
CALL_TIMEOUT_S = 1.0  # an owner slower than this is unreachable: 503
SETTLE_S = 60.0  # after a peer-list change, new buckets start empty this long
ADOPT_WAIT_S = 2.0  # a key that just moved here admits nothing new this long (adopts arrive)
REQUEST, TOKENS, ENTER, LEAVE, ADOPT = "request", "tokens", "enter", "leave", "adopt"
ACQUIRE, RELEASE = "acquire", "release"  # request + enter in one call; leaves in a batch
OPS = (REQUEST, TOKENS, ENTER, LEAVE, ADOPT, ACQUIRE, RELEASE)
MAX_BODY = 4096
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
    return APIError(
        503,
        "this API key's budget is moving between router replicas; retry in a second",
        code="budget_moving",
        headers={"Retry-After": "1"},
    )


def owner_unreachable(owner: str) -> APIError:
    return APIError(
        503,
        "this API key's budget is kept by another router replica that does not answer; retry later",
        code="budget_owner_unreachable",
        headers={"Retry-After": "1"},
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
        self.previous: tuple[str, ...] = ()  # the list before the last change
        self.adopted: set[str] = set()  # ids whose in-flight counts came since the change
        self.changed_at = -math.inf
        self.held: dict[str, int] = {}  # id -> this replica's requests in flight
        self.owners: dict[str, str] = {}  # id -> the owner it was counted at
        self._pool: WorkerPool | None = None  # keep-alive HTTP/1.1 to the peers, signed
        self._releases: dict[str, dict[str, int]] = {}  # owner -> id -> give-backs waiting
        self._releasing: set[str] = set()  # owners a give-back call is on the way to
        self._gave_back: dict[str, asyncio.Event] = {}  # id -> set at its next give-back
        self._tasks: set[asyncio.Task[None]] = set()
        self.set_peers(peers)
        self.changed_at = -math.inf  # the first list is no change

    # -- the peer list ------------------------------------------------------------------
    def set_peers(self, peers: Sequence[str]) -> None:
        """A new peer list (kubernetes: the ready replicas, this one only once it is
        ready, as the others see it); in-flight counts move to the new owners of their
        keys (``adopt``). An empty list refuses every call (503) until one comes."""
        new = tuple(sorted({base_url(p) for p in peers}))
        if new == self.peers:
            return
        log.info("budget peers: %s", ", ".join(new))
        self.previous, self.peers, self.changed_at = self.peers, new, self.clock()
        self.adopted.clear()
        for cid, n in list(self.held.items()) if new else ():
            owner = owner_of(cid, new)
            if owner != self.owners.get(cid):
                self.owners[cid] = owner
                if owner == self.self_url:
                    self.apply(ADOPT, cid, n)
                else:
                    self._background(self._send(owner, ADOPT, cid, n))

    def listen_endpoints(self, port: int) -> Callable[[list[str]], None]:
        """A listener for the router Service's ready addresses (kubernetes peers)."""
        return lambda addresses: self.set_peers([http_url(a, port) for a in addresses])

    # -- a request's calls --------------------------------------------------------------
    async def take_request(self, client: str) -> None:
        await self._call(REQUEST, budget_id(client), 1)

    async def take_tokens(self, client: str, n: int) -> None:
        await self._call(TOKENS, budget_id(client), n)

    async def enter(self, client: str) -> None:
        """Count one more request of ``client`` in flight (429 at the cap, 503 when its
        owner does not answer)."""
        cid = budget_id(client)
        owner = await self._call(ENTER, cid, 1)
        self.held[cid] = self.held.get(cid, 0) + 1
        self.owners[cid] = owner

    async def acquire(self, client: str) -> None:
        """``take_request`` then ``enter`` in one call to the key's owner: its requests
        bucket, then one more request in flight (the same refusals in the same order:
        a request refused at the cap has taken its request as before)."""
        cid = budget_id(client)
        owner = await self._call(ACQUIRE, cid, 1)
        self.held[cid] = self.held.get(cid, 0) + 1
        self.owners[cid] = owner

    def leave(self, client: str) -> None:
        """One of ``client``'s requests ended: given back at its owner (in the background
        for a remote one; a lost call leaves the owner's count high, never low)."""
        cid = budget_id(client)
        n = self.held.get(cid, 0) - 1
        owner = self.owners.get(cid, "")
        if n > 0:
            self.held[cid] = n
        else:
            self.held.pop(cid, None)
            self.owners.pop(cid, None)
        if owner == self.self_url:
            self.apply(LEAVE, cid, 1)
        elif owner:
            self._release_later(owner, cid)

    def _release_later(self, owner: str, cid: str) -> None:
        """A give-back to ``owner``: sent at once when no give-back to it is on the way,
        else with every other that comes meanwhile in the next call (at most
        RELEASE_BATCH keys a call). No timer and no wait when calls are rare; one call for
        many when they are not. Late only keeps the owner's count high a moment: it
        refuses early, never admits over the cap."""
        waiting = self._releases.setdefault(owner, {})
        waiting[cid] = waiting.get(cid, 0) + 1
        if owner not in self._releasing:
            self._releasing.add(owner)
            self._background(self._release_all(owner))

    async def _release_all(self, owner: str) -> None:
        try:
            while waiting := self._releases.pop(owner, None):
                batch = self._batch(owner, waiting)
                await self._send_body(owner, {"op": RELEASE, "ids": batch})
        finally:
            self._releasing.discard(owner)

    def _batch(self, owner: str, waiting: dict[str, int]) -> dict[str, int]:
        """At most RELEASE_BATCH of ``waiting``; the rest wait again for ``owner``."""
        if len(waiting) <= RELEASE_BATCH:
            return waiting
        items = list(waiting.items())
        rest = dict(items[RELEASE_BATCH:])
        for c, k in self._releases.get(owner, {}).items():
            rest[c] = rest.get(c, 0) + k
        self._releases[owner] = rest
        return dict(items[:RELEASE_BATCH])

    async def _call(self, op: str, cid: str, n: int) -> str:
        if not self.peers:
            raise owner_unreachable("")
        owner = owner_of(cid, self.peers)
        if owner == self.self_url:
            err = await self.apply_waiting(op, cid, n)
            if err is not None:
                raise err
            return owner
        call: dict[str, Any] = {"op": op, "id": cid, "n": n}
        waiting = self._releases.pop(owner, None) if op == ACQUIRE else None
        if waiting:  # give-backs queued behind one on its way: they ride this call
            call["release"] = self._batch(owner, waiting)
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
        return owner

    # -- the owner's side ---------------------------------------------------------------
    def apply(self, op: str, cid: str, n: int) -> APIError | None:
        """``op`` on this replica's counters of ``cid``: None, or the refusal."""
        try:
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
                if self._moving(cid):
                    return budget_moving()
                if self.cap and not self.counts.enter(cid, self.cap):
                    return concurrency_limit(self.cap)
            elif op in (LEAVE, RELEASE):
                for _ in range(max(min(n, 1 << 16), 1)):
                    self.counts.leave(cid)
                waiting = self._gave_back.pop(cid, None)
                if waiting is not None:
                    waiting.set()
            elif op == ADOPT:  # requests already in flight: counted, never refused
                self.adopted.add(cid)
                for _ in range(max(min(n, 1 << 16), 0)):
                    self.counts.enter(cid, 0)
        except APIError as err:
            return err
        return None

    async def apply_waiting(self, op: str, cid: str, n: int) -> APIError | None:
        """``apply``; a key at its cap (``acquire``, ``enter``) waits up to
        GIVE_BACK_WAIT_S for a give-back first: a request of it that just ended on another
        replica is given back in one call of its own, which can come after a new request
        sent at once (the client saw its answer end). The count is checked again then:
        never over the cap; the refusal is the same, a moment later."""
        err = self.apply(op, cid, n)
        if err is None or op not in (ACQUIRE, ENTER) or err.code != "concurrency_limit_exceeded":
            return err
        event = self._gave_back.setdefault(cid, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), GIVE_BACK_WAIT_S)
        if self._gave_back.get(cid) is event and not event.is_set():
            del self._gave_back[cid]  # nobody gave back (a sibling --procs may have)
        again = self.apply(ENTER, cid, 1)  # the requests bucket was taken already
        return err if again is not None else None

    def _moving(self, cid: str) -> bool:
        """Whether ``cid`` came to this replica from another owner within ADOPT_WAIT_S:
        the other replicas' requests still in flight for it may not be counted here yet
        (each sends its ``adopt`` once it sees the change), so nothing new is admitted."""
        if not self.previous or self.clock() - self.changed_at >= ADOPT_WAIT_S:
            return False
        return cid not in self.adopted and owner_of(cid, self.previous) != self.self_url

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
            if op == RELEASE:  # a batch of give-backs: {"ids": {id: n}}
                calls = [(op, str(c), int(k)) for c, k in dict(body["ids"]).items()]
            else:  # give-backs that rode an acquire go first (those requests ended)
                ridden = dict(body.get("release") or {}) if op == ACQUIRE else {}
                calls = [(RELEASE, str(c), int(k)) for c, k in ridden.items()]
                calls.append((op, str(body["id"]), int(body.get("n", 1))))
        except (ValueError, KeyError, TypeError, AttributeError):
            return 400, {"error": "bad budget call"}, {}
        if op not in OPS or not calls or any(len(cid) != 32 for _, cid, _ in calls):
            return 400, {"error": f"bad budget op {op!r}"}, {}
        err = None
        for what, cid, n in calls:
            err = await self.apply_waiting(what, cid, n)
        out: dict[str, Any] = {"error": None}
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
    async def _send(self, owner: str, op: str, cid: str, n: int) -> dict[str, Any] | None:
        """The owner's answer, or None when it does not answer or cannot prove the key."""
        return await self._send_body(owner, {"op": op, "id": cid, "n": n})

    async def _send_body(self, owner: str, call: dict[str, Any]) -> dict[str, Any] | None:
        """One signed POST on a kept-alive connection to ``owner`` (the workers' HTTP/1.1
        pool, pdserve/worker_calls/http1.py: signed for the owner's address, its reply
        believed only with the proof), within CALL_TIMEOUT_S in all."""
        if self._pool is None:
            self._pool = WorkerPool(self.ring)
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                resp = await self._pool.post(owner, PATH, json.dumps(call).encode(), CALL_TIMEOUT_S)
                async with resp:
                    reply = await resp.read()
            if resp.status != 200:
                log.warning("budget owner %s refused a call (%d)", owner, resp.status)
                return None
            out = json.loads(reply)
            return out if isinstance(out, dict) else None
        except (CallFailed, TimeoutError, ValueError, OSError) as exc:
            log.warning("budget owner %s unreachable: %s", owner, exc)
            return None

    def _background(self, call: Any) -> None:
        async def run() -> None:
            await call

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._tasks:  # the give-backs on the way (and those waiting behind them)
            await asyncio.wait(set(self._tasks), timeout=CALL_TIMEOUT_S)
        if self._pool is not None:
            await self._pool.close()
