"""Retiring a local worker so that no client notices: a planned scale-down.

``LocalCluster.remove_worker`` takes the worker out of the router's workers file and then,
before it stops the process:

1. waits until the router no longer lists the worker (``wait_unrouted``). The router
   re-reads the file on its next health round, a second or more later on a loaded
   machine; a worker stopped before then is still sent requests, which fail over to
   another worker at best (retried, the worker marked failed) and fail the client when
   that one fails too.
2. waits until the worker is idle twice in a row (``wait_idle``): no request running,
   waiting, or loading remote KV, and (prefill) no prompt's KV held under a lease for a
   decode worker that has not read it yet. A worker that does not answer ``/stats`` in
   time is busy, not idle: on a loaded machine the answer is merely late. Only a refused
   connection (nothing listens: still starting, or already stopping) or an exited process
   ends the wait early.

Both waits share one deadline (``drain_timeout_s``); past it the worker is stopped
anyway (its streams then migrate, a held prompt is recomputed by its decode worker).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from pdserve.protocol.codec import from_dict
from pdserve.protocol.contract import WorkerStats

Listed = Callable[[str], bool]  # does the router still list (and so route to) this URL?
POLL_S = 0.25


def busy(stats: WorkerStats) -> int:
    """Requests the worker still owes someone: running, waiting, loading KV, or holding
    KV for a decode worker to read (prefill)."""
    return stats.running + stats.waiting + stats.loading + stats.held


def worker_busy(url: str, auth: httpx.Auth | None, timeout_s: float = 2.0) -> bool:
    """Whether the worker at ``url`` may still owe a request; nothing listening is idle.
    ``auth`` signs the call (pdserve/signed_httpx.py)."""
    try:
        reply = httpx.get(url + "/stats", timeout=timeout_s, auth=auth)
        return busy(from_dict(reply.json(), WorkerStats)) > 0
    except httpx.ConnectError:  # refused: no server, so no request either
        return False
    except (httpx.HTTPError, ValueError):  # late or garbled: assume it still works
        return True


def router_lists(router_url: str, api_key: str = "") -> Listed:
    """A ``Listed`` that asks the router's ``GET /workers``; an unanswered ask counts as
    listed (waiting longer is safe, stopping a worker that is still routed to is not)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def listed(url: str) -> bool:
        try:
            reply = httpx.get(router_url + "/workers", timeout=2.0, headers=headers)
            return any(w.get("url") == url for w in reply.json()["workers"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return True

    return listed


def wait_unrouted(url: str, listed: Listed, deadline: float, alive: Callable[[], bool]) -> bool:
    """Until the router stops listing ``url``; False if the deadline came first."""
    while alive() and time.monotonic() < deadline:
        if not listed(url):
            return True
        time.sleep(POLL_S)
    return not alive()


def wait_idle(
    url: str, auth: httpx.Auth | None, deadline: float, alive: Callable[[], bool]
) -> bool:
    """Until the worker is idle on two polls in a row (a request the router sent just
    before it stopped listing the worker is seen by then); False at the deadline."""
    idle_polls = 0
    while alive() and time.monotonic() < deadline:
        idle_polls = 0 if worker_busy(url, auth) else idle_polls + 1
        if idle_polls >= 2:
            return True
        time.sleep(POLL_S)
    return not alive()
