"""A stand-in for the router pod's ``/metrics`` in the operator autoscaler tests.

No router pod can run under the API emulator, so a small real HTTP server on
127.0.0.1 serves what a router would: the router's own metric registry
(``pdserve.router.metrics.RouterMetrics``, real prometheus_client histograms and
counters) fed with a recorded load. Each scrape first advances the load by the
time since the last scrape, so rates and latency distributions between two
scrapes are those of the load, as from a live router.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from pdserve.router.metrics import RouterMetrics
from tests.aio_site import start_site


@dataclass(frozen=True)
class Load:
    rate_rps: float  # requests finishing per second
    prompt_tokens: int
    output_tokens: int
    ttft_s: float  # mean; samples spread over [0.7, 1.3] x mean
    tpot_s: float
    decode_inflight: int = 0  # requests in decode right now (router gauge)
    queue_depth: int = 0  # requests admitted and not finished (router gauge)


class RecordedRouter:
    def __init__(self, load: Load) -> None:
        self.metrics = RouterMetrics()
        self.load = load
        self._last: float | None = None
        self._carry = 0.0  # fractional requests not yet observed
        self._seq = 0
        self.scrapes = 0

    def advance(self, now: float) -> None:
        dt = 0.0 if self._last is None else max(0.0, now - self._last)
        self._last = now
        self._carry += self.load.rate_rps * dt
        count, self._carry = int(self._carry), self._carry - int(self._carry)
        m, ld = self.metrics, self.load
        for _ in range(count):
            spread = 0.7 + 0.6 * ((self._seq * 7) % 10) / 9  # deterministic spread
            self._seq += 1
            m.ttft.observe(ld.ttft_s * spread)
            m.tpot.observe(ld.tpot_s * spread)
            m.itl.observe(ld.tpot_s * spread)
            m.e2e.observe(ld.ttft_s + ld.tpot_s * (ld.output_tokens - 1))
            m.requests.labels(code="200").inc()
            m.prompt_tokens.inc(ld.prompt_tokens)
            m.generation_tokens.inc(ld.output_tokens)
        m.queue_depth.set(ld.queue_depth)
        # admitted and not yet decoding: before their first token (the planner's prefill queue)
        m.prefill_queue_depth.set(max(0, ld.queue_depth - ld.decode_inflight))
        m.inflight.labels(worker="http://decode-0:8080", role="decode").set(ld.decode_inflight)

    def render(self, now: float | None = None) -> str:
        self.advance(time.time() if now is None else now)
        self.scrapes += 1
        return self.metrics.render().decode()


@asynccontextmanager
async def serve_routers(routers: dict[str, RecordedRouter]) -> AsyncIterator[str]:
    """Serve ``/{namespace}/{name}/metrics`` for each ``"namespace/name"`` key; yields the
    operator's URL template (``router_metrics_url``)."""

    async def metrics(request: web.Request) -> web.Response:
        key = f"{request.match_info['namespace']}/{request.match_info['name']}"
        router = routers.get(key)
        if router is None:
            return web.Response(status=404, text=f"no router {key}")
        return web.Response(text=router.render(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/{namespace}/{name}/metrics", metrics)
    runner, url = await start_site(app)
    try:
        yield url + "/{namespace}/{name}/metrics"
    finally:
        await runner.cleanup()
