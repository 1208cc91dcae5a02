"""Worker discovery and health: publishes immutable snapshots for routing.

A source lists endpoints (a static list in local mode, watched EndpointSlices in
a cluster); a background loop checks each one's ``/health`` and ``/stats``,
drops dead workers from routing and re-admits them when they answer again,
and keeps this replica subscribed to every healthy worker's event stream (KV events into
the prefix index, load reports; router/discovery/events.py). ``snapshot()`` merges each
worker's last load report (else its last poll) with this replica's in-flight counts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import aiohttp

from pdserve.protocol.contract import CONTRACT_VERSION, EngineStats
from pdserve.protocol.kv_events import KVSnapshot, LoadReport
from pdserve.router.discovery.events import EventSubscriber
from pdserve.router.discovery.tasks import stop_task
from pdserve.router.scheduling.snapshot import Snapshot, WorkerStats, WorkerView
from pdserve.worker_calls.worker_client import TRANSPORT_ERRORS, get_json, get_message

log = logging.getLogger(__name__)
# A load report older than this is stale (the stream broke or the worker hangs): routing
# falls back to the polled /stats bounded by this replica's own in-flight counts.
REPORT_FRESH_S = 0.5
# A worker listed but never healthy yet (starting: loading its model) is asked for its
# /health this often between the health rounds, for this long after it was first listed:
# it takes traffic as soon as it is up, not up to a round later (``pdserve up`` waits
# for the router to route to every worker before it says "up"). Only those workers are
# asked in between, so a pool's healthy workers see one round per interval as before.
STARTING_POLL_S = 0.1
STARTING_WINDOW_S = 300.0
LOAD_FIELDS = tuple(f.name for f in dataclasses.fields(EngineStats))


@dataclass(frozen=True)
class Endpoint:
    url: str
    role: str  # "prefill" | "decode"


class EndpointSource(ABC):
    @abstractmethod
    async def list(self) -> list[Endpoint]:
        """Current endpoints; called once per health round."""

    async def changed(self) -> None:
        """Returns when the endpoints may have changed (a watch event): the health loop
        then runs a round at once instead of at its next tick. Default: never."""
        await asyncio.Event().wait()

    async def close(self) -> None:  # noqa: B027 (optional hook: most sources run nothing)
        """Stop whatever the source runs in the background (a watch)."""


class StaticSource(EndpointSource):
    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self._endpoints = [Endpoint(normalize_url(u), "prefill") for u in prefill] + [
            Endpoint(normalize_url(u), "decode") for u in decode
        ]

    async def list(self) -> list[Endpoint]:
        return list(self._endpoints)


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if not parts.hostname or parts.scheme not in ("http", "https"):
        raise ValueError(f"bad worker URL {url!r}; expected http://host:port")
    return url


def events_address(worker_url: str, advertised: str) -> str:
    """The KV events address to connect to; a wildcard host means the worker's own host."""
    if not advertised:
        return ""
    scheme, _, rest = advertised.partition("://")
    host, _, port = rest.rpartition(":")
    if host in ("0.0.0.0", "*", "", "[::]", "::"):
        host = urlsplit(worker_url).hostname or "127.0.0.1"
    return f"{scheme}://{host}:{port}"


class Discovery:
    def __init__(
        self,
        source: EndpointSource,
        client: aiohttp.ClientSession,
        interval_s: float = 1.0,
        subscriber: EventSubscriber | None = None,
    ) -> None:
        self.source = source
        self.client = client
        self.interval_s = interval_s
        self.subscriber = subscriber
        if subscriber is not None and subscriber.fetch is None:
            subscriber.fetch = self.fetch_kv_snapshot
        self._views: dict[str, WorkerView] = {}  # url -> last polled view (inflight unset)
        self._inflight: dict[str, tuple[int, int]] = {}  # url -> (requests, prompt tokens)
        # url -> (report, its stats merged into the polled ones, in-flight when it came)
        self._reported: dict[str, tuple[LoadReport, WorkerStats, tuple[int, int]]] = {}
        self._version = 0
        # url -> (polled view, in-flight counts, report or None, the view routing saw): a
        # worker whose state did not move since the last request is not built again.
        self._shown: dict[str, tuple[WorkerView, tuple[int, int], object, WorkerView]] = {}
        self._task: asyncio.Task[None] | None = None
        self._listed_at: dict[str, float] = {}  # url -> when first listed (monotonic)
        self._ever_healthy: set[str] = set()
        self.ready = asyncio.Event()
        self.after_refresh: list[Callable[[], None]] = []  # run after each health round

    # -- published state ---------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Taken per request: the subscriber's reports read here with one clock reading for
        all workers (``EventSubscriber.report`` read the clock once per worker, eight times
        a request with 4 + 4 workers), and a worker's view built again only when its
        in-flight counts, report or polled view moved (at concurrency 64 a few of them do
        between two requests: ``_view`` builds each without the frozen dataclass's
        ``__init__``)."""
        sub = self.subscriber
        loads = sub.loads if sub is not None else None
        now = sub.clock() if sub is not None else 0.0
        inflight, shown_all = self._inflight, self._shown
        views: list[WorkerView] = []
        pools: dict[str, list[WorkerView]] = {"prefill": [], "decode": []}
        for url, view in self._views.items():
            counts = inflight.get(url, _IDLE)
            report = None
            if loads:
                got = loads.get(view.stats.worker_id or url)
                if got is not None and now - got[1] <= REPORT_FRESH_S:
                    report = got[0]
            shown = shown_all.get(url)
            if (
                shown is None
                or shown[0] is not view
                or shown[1] != counts
                or shown[2] is not report
            ):
                shown = shown_all[url] = (
                    view,
                    counts,
                    report,
                    self._with_report(view, *counts, report),
                )
            views.append(shown[3])
            if view.healthy:
                pools[view.role].append(shown[3])
        snap = Snapshot(tuple(views), self._version)
        # its pools (``Snapshot.prefill``/``decode``, kept in its __dict__ by ``once``)
        # gathered on this pass instead of two more over the workers
        snap.__dict__.update(prefill=tuple(pools["prefill"]), decode=tuple(pools["decode"]))
        return snap

    def _with_report(
        self, view: WorkerView, n: int, tokens: int, report: LoadReport | None
    ) -> WorkerView:
        if report is None:  # no fresh report
            return _view(view, view.stats, n, tokens, False, 0, 0)
        seen = self._reported.get(view.url)
        if seen is None or seen[0] is not report:
            # A new report counts every request that reached the worker: from here on only
            # what this replica adds is missing from it.
            merged = replace(view.stats, **{f: getattr(report, f) for f in LOAD_FIELDS})
            seen = self._reported[view.url] = (report, merged, (n, tokens))
        _, stats, (n0, tokens0) = seen
        return _view(view, stats, n, tokens, True, max(n - n0, 0), max(tokens - tokens0, 0))

    def synced(self) -> bool:
        """Whether this replica holds every healthy worker's state: its KV index caught up
        (snapshot + events) and its load reported. Readiness waits for it."""
        if self.subscriber is None:
            return True
        return all(
            self.subscriber.synced(events_address(v.url, v.stats.kv_events))
            for v in self._views.values()
            if v.healthy and v.stats.kv_events
        )

    async def fetch_kv_snapshot(self, url: str) -> KVSnapshot:
        """A prefill worker's ``GET /kv_blocks`` (signed)."""
        status, snap = await get_message(self.client, url + "/kv_blocks", KVSnapshot, 10.0)
        if snap is None:
            raise ValueError(f"GET {url}/kv_blocks answered {status}")
        return snap

    def begin(self, url: str, prompt_tokens: int = 0) -> None:
        n, tokens = self._inflight.get(url, (0, 0))
        self._inflight[url] = (n + 1, tokens + prompt_tokens)

    def end(self, url: str, prompt_tokens: int = 0) -> None:
        n, tokens = self._inflight.get(url, (0, 0))
        assert n > 0, f"in-flight underflow for {url}"
        self._inflight[url] = (n - 1, max(tokens - prompt_tokens, 0))

    def shift(self, url: str, requests: int, prompt_tokens: int) -> None:
        """``begin``/``end`` of several calls at once, net (the compiled lane's batch of
        tracks: router/fast_lane.py)."""
        n, tokens = self._inflight.get(url, (0, 0))
        assert n + requests >= 0, f"in-flight underflow for {url}"
        self._inflight[url] = (n + requests, max(tokens + prompt_tokens, 0))

    def mark_failed(self, url: str) -> None:
        """A request to ``url`` failed: stop routing there until a health check passes."""
        view = self._views.get(url)
        if view is not None and view.healthy:
            log.warning("worker %s failed a request; out of rotation until healthy", url)
            self._views[url] = replace(view, healthy=False)
            self._version += 1

    def failed_check(self, url: str) -> bool:
        """Whether ``url`` is known and out of rotation (its last check, or a request,
        failed)."""
        view = self._views.get(url)
        return view is not None and not view.healthy

    # -- health loop -------------------------------------------------------------------
    async def refresh(self) -> Snapshot:
        try:
            endpoints = await self.source.list()
        except Exception as exc:  # a flaky API server must not kill the loop
            log.warning("listing workers failed: %s", exc)
            endpoints = [Endpoint(u, v.role) for u, v in self._views.items()]
        views = await asyncio.gather(*(self._check(ep) for ep in endpoints))
        old = self._views
        self._views = {v.url: v for v in views}
        for url, view in old.items():
            if url not in self._views or not self._views[url].healthy:
                self._unsubscribe(view)
                self._reported.pop(url, None)
                self._shown.pop(url, None)
        now = time.monotonic()
        self._listed_at = {v.url: self._listed_at.get(v.url, now) for v in views}
        self._ever_healthy = {v.url for v in views if v.healthy or v.url in self._ever_healthy}
        for view in views:
            self._subscribe(view)
        self._version += 1
        if any(v.healthy for v in views):
            self.ready.set()
        for listener in self.after_refresh:
            listener()
        return self.snapshot()

    async def _check(self, ep: Endpoint) -> WorkerView:
        try:
            health, _ = await get_json(self.client, ep.url + "/health", 2.0)
            _, stats = await get_message(self.client, ep.url + "/stats", WorkerStats, 2.0)
            ok = health == 200 and stats is not None and _same_contract(ep.url, stats)
            ws = stats if ok and stats is not None else WorkerStats()
        except (*TRANSPORT_ERRORS, ValueError) as exc:
            log.debug("health check of %s failed: %s", ep.url, exc)
            ok, ws = False, self._views.get(ep.url, WorkerView(ep.url, ep.role)).stats
        return WorkerView(ep.url, ep.role, healthy=ok, stats=ws)

    def _subscribe(self, view: WorkerView) -> None:
        if self.subscriber is None or not view.healthy or not view.stats.kv_events:
            return
        address = events_address(view.url, view.stats.kv_events)
        self.subscriber.subscribe(address, view.worker_id, view.url, kv=view.role == "prefill")

    def _unsubscribe(self, view: WorkerView) -> None:
        if self.subscriber is not None and view.stats.kv_events:
            self.subscriber.unsubscribe(events_address(view.url, view.stats.kv_events))

    def starting(self) -> list[str]:
        """Workers listed within STARTING_WINDOW_S that have never been healthy."""
        now = time.monotonic()
        return [
            url
            for url, at in self._listed_at.items()
            if url not in self._ever_healthy and now - at < STARTING_WINDOW_S
        ]

    async def _any_up(self, urls: list[str]) -> bool:
        async def up(url: str) -> bool:
            try:
                return (await get_json(self.client, url + "/health", 1.0))[0] == 200
            except (*TRANSPORT_ERRORS, ValueError):
                return False

        return any(await asyncio.gather(*(up(u) for u in urls)))

    async def _pause(self) -> None:
        """Until the next round: ``interval_s``, the source's change, or a starting worker
        that answers healthy (asked every STARTING_POLL_S)."""
        deadline = time.monotonic() + self.interval_s
        while (left := deadline - time.monotonic()) > 0:
            starting = self.starting()
            try:
                await asyncio.wait_for(
                    self.source.changed(), min(left, STARTING_POLL_S) if starting else left
                )
                return
            except TimeoutError:
                pass
            if starting and await self._any_up(starting):
                return

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("discovery round failed")
            await self._pause()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
        await self.source.close()
        if self.subscriber is not None:
            await self.subscriber.close()


def _same_contract(url: str, stats: WorkerStats) -> bool:
    """The router's half of the contract's version handshake: a worker that speaks another
    version stays out of rotation (rolling upgrades bump the version on purpose)."""
    if stats.version != CONTRACT_VERSION:
        log.warning(
            "worker %s speaks contract v%s, this router v%s: not routing there",
            url,
            stats.version,
            CONTRACT_VERSION,
        )
        return False
    return True


_IDLE = (0, 0)  # a worker's in-flight counts (requests, prompt tokens) with none in flight
_new = object.__new__


def _view(
    polled: WorkerView,
    stats: WorkerStats,
    n: int,
    tokens: int,
    reported: bool,
    since: int,
    since_tokens: int,
) -> WorkerView:
    """``WorkerView(polled.url, polled.role, polled.healthy, stats, n, tokens, reported,
    since, since_tokens)``, its fields set in its ``__dict__``: the frozen dataclass's
    ``__init__`` (a guarded ``object.__setattr__`` per field, and the role's check, which
    ``polled`` passed) cost ~1.6 µs a view against ~0.6 (tests/router/test_routing.py
    checks the two equal)."""
    w = _new(WorkerView)
    w.__dict__.update(
        url=polled.url,
        role=polled.role,
        healthy=polled.healthy,
        stats=stats,
        inflight=n,
        inflight_prompt_tokens=tokens,
        reported=reported,
        since_report=since,
        since_report_tokens=since_tokens,
    )
    return w
