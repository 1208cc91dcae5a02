"""The autoscaler reads every router replica (operator/autoscale_inputs.py): one URL per
ready endpoint of the router's admin Service, and their pages summed, where a scrape of
the Service would have counted one replica's requests."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.operator import autoscale_inputs as inputs
from pdserve.operator import naming
from tests.aio_site import start_site

pytestmark = pytest.mark.unit


class Slices:
    """The operator's KubeClient, as far as the URL lookup uses it."""

    def __init__(self, slices: list[dict[str, Any]]) -> None:
        self.slices = slices
        self.asked: list[tuple[str, str, str, dict[str, str]]] = []

    async def list(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str]
    ) -> list[dict[str, Any]]:
        self.asked.append((api_version, kind, namespace, labels))
        return self.slices


def _ep(addr: str, ready: bool | None = True, terminating: bool = False) -> dict[str, Any]:
    return {"addresses": [addr], "conditions": {"ready": ready, "terminating": terminating}}


async def test_one_url_per_ready_replica() -> None:
    slices: list[dict[str, Any]] = [
        {
            "ports": [{"name": "admin", "port": 8083}],
            "endpoints": [
                _ep("10.0.0.2"),
                _ep("10.0.0.1", None),
                _ep("10.0.0.3", False),
                _ep("10.0.0.4", True, True),
            ],
        },
        {"addressType": "IPv6", "endpoints": [_ep("fd00::5")]},
    ]
    client = Slices(slices)
    urls = await inputs.router_metrics_urls(client, "", "demo", "ns")  # type: ignore[arg-type]
    assert urls == [
        "http://10.0.0.1:8083/metrics",
        "http://10.0.0.2:8083/metrics",
        f"http://[fd00::5]:{naming.ADMIN_PORT}/metrics",
    ]
    label = {inputs.SERVICE_NAME_LABEL: naming.router_admin_service_name("demo")}
    assert client.asked == [("discovery.k8s.io/v1", "EndpointSlice", "ns", label)]
    # No endpoint listed yet: the Service; a template (the tests' stand-in): that URL.
    assert await inputs.router_metrics_urls(Slices([]), "", "demo", "ns") == [  # type: ignore[arg-type]
        inputs.router_metrics_url("", "demo", "ns")
    ]
    assert await inputs.router_metrics_urls(client, "http://x/{name}", "demo", "ns") == [  # type: ignore[arg-type]
        "http://x/demo"
    ]


PAGE = """# TYPE pdserve_router_requests_total counter
pdserve_router_requests_total{{code="200"}} {n}
# TYPE pdserve_router_prefill_queue_depth gauge
pdserve_router_prefill_queue_depth {q}
"""


async def test_the_replicas_pages_are_summed() -> None:
    runners, urls = [], []
    for n, q in ((10, 1), (32, 4)):
        app = web.Application()
        text = PAGE.format(n=n, q=q)

        async def metrics(_: web.Request, text: str = text) -> web.Response:
            return web.Response(text=text)

        app.router.add_get("/metrics", metrics)
        runner, url = await start_site(app)
        runners.append(runner)
        urls.append(url + "/metrics")
    try:
        async with aiohttp.ClientSession() as session:
            scrape = await inputs.scrape_routers(session, urls, 5.0, 2.0)
            assert scrape.total("pdserve_router_requests_total") == 42
            assert scrape.total("pdserve_router_prefill_queue_depth") == 5
            bad = [*urls, "http://127.0.0.1:1/metrics"]  # a replica that does not answer
            try:
                await inputs.scrape_routers(session, bad, 6.0, 2.0)
                raise AssertionError("a silent replica must not be read as zero")
            except inputs.InputError as exc:
                assert "127.0.0.1:1" in str(exc)
    finally:
        for r in runners:
            await r.cleanup()
