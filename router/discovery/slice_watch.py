"""One watch on EndpointSlices: LIST once, then WATCH from its resourceVersion, for ever.

The informer pattern, reduced to what the router needs::

    LIST ──rv──▶ WATCH ?resourceVersion=rv ──events──▶ slices{name: slice}, rv = event's
                   │ the server ends it (timeoutSeconds)  ──▶ WATCH again from rv (no LIST)
                   │ 410 Gone (rv compacted away)         ──▶ LIST again
                   └ error / API server down              ──▶ back off (0.5 s … 30 s), retry

At steady state that is one open watch per router and no requests at all, where the pod
LIST it replaced cost one request per second per router replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from pdserve.router.discovery.kube_api import ApiAccess

log = logging.getLogger(__name__)
SLICES = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


class Gone(Exception):
    """The watch's resourceVersion is too old: only a new LIST can continue."""


class KubeApiError(Exception):
    """The API server refused a request or sent an ERROR event."""


class SliceWatch:
    def __init__(
        self,
        access: Callable[[], ApiAccess],
        namespace: str,
        selector: str,
        on_change: Callable[[], None],
        watch_timeout_s: float = 300.0,
        backoff_s: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        self._access_fn = access
        self._access: ApiAccess | None = None
        self.namespace, self.selector = namespace, selector
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.backoff_s = backoff_s
        self.slices: dict[str, dict[str, Any]] = {}
        self.rv: str | None = None  # None: the next round LISTs
        self.synced = asyncio.Event()  # set after the first LIST

    async def run(self) -> None:
        delay = self.backoff_s[0]
        timeout = aiohttp.ClientTimeout(sock_connect=10, sock_read=self.watch_timeout_s + 30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    if self.rv is None:
                        await self._list(session)
                    if await self._watch(session):
                        delay = self.backoff_s[0]
                        continue
                    raise KubeApiError("watch ended at once without an event")
                except Gone as exc:
                    log.info("EndpointSlice watch expired (%s); listing again", exc)
                    self.rv = None
                    continue  # a fresh LIST answers at a current version: no back-off
                except (aiohttp.ClientError, OSError, KubeApiError, ValueError, KeyError) as exc:
                    log.warning("EndpointSlice watch failed: %r; retrying in %.1fs", exc, delay)
                except Exception:  # a bug must not end discovery: the router would go stale
                    log.exception("EndpointSlice watch failed; retrying in %.1fs", delay)
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self.backoff_s[1])

    def _url(self) -> str:
        if self._access is None:
            self._access = self._access_fn()
        return self._access.base_url + SLICES.format(namespace=self.namespace)

    async def _list(self, session: aiohttp.ClientSession) -> None:
        url = self._url()
        assert self._access is not None
        params = {"labelSelector": self.selector}
        async with session.get(
            url,
            params=params,
            headers=self._access.headers(),
            ssl=self._access.ssl_context,
            timeout=aiohttp.ClientTimeout(total=30),
        ) as resp:
            if resp.status != 200:
                raise KubeApiError(f"LIST endpointslices: HTTP {resp.status}: {await resp.text()}")
            body = await resp.json()
        self.slices = {s["metadata"]["name"]: s for s in body.get("items") or []}
        self.rv = str(body["metadata"]["resourceVersion"])
        self.synced.set()
        self.on_change()

    async def _watch(self, session: aiohttp.ClientSession) -> bool:
        """Stream events until the server ends the watch; False if it ended at once, empty."""
        url = self._url()
        assert self._access is not None and self.rv is not None
        params = {
            "labelSelector": self.selector,
            "watch": "true",
            "resourceVersion": self.rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(int(self.watch_timeout_s)),
        }
        started, events = time.monotonic(), 0
        async with session.get(
            url, params=params, headers=self._access.headers(), ssl=self._access.ssl_context
        ) as resp:
            if resp.status == 410:
                raise Gone(f"HTTP 410 at resourceVersion {self.rv}")
            if resp.status != 200:
                raise KubeApiError(f"WATCH endpointslices: HTTP {resp.status}: {await resp.text()}")
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._event(json.loads(line))
                        events += 1
        return events > 0 or time.monotonic() - started >= 1.0

    def _event(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message") or "410 Gone")
            raise KubeApiError(f"watch error: {obj.get('message') or obj}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            self.slices[obj["metadata"]["name"]] = obj
        elif kind == "DELETED":
            self.slices.pop(obj["metadata"]["name"], None)
        elif kind != "BOOKMARK":
            raise KubeApiError(f"unknown watch event type {kind!r}")
        if rv:
            self.rv = str(rv)
        if kind != "BOOKMARK":
            self.on_change()
