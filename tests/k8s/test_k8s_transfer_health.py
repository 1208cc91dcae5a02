"""A silent KV-transfer fallback (decode recomputes) becomes a Warning Event.

Decode pods cannot run here: a small aiohttp server stands in for their ``/metrics``
(the worker's real counter names), behind the operator's URL template. The operator is
the real one, against the emulator.
"""

from __future__ import annotations

from typing import Any

import aiohttp.web
import kmock
import pytest
from aiohttp.test_utils import TestServer
from conftest import running_operator
from k8s_helpers import NS, eventually, minimal_llmservice

from pdserve.operator import transfer_health as th
from pdserve.operator.handlers import OperatorConfig
from pdserve.operator.kube import KubeClient

pytestmark = pytest.mark.timeout(60)


def page(failures: int, completed: int) -> str:
    return (
        "# TYPE pdserve_kv_transfer_failures counter\n"
        f'pdserve_kv_transfer_failures_total{{role="decode",transport="nixl"}} {failures}.0\n'
        f'pdserve_kv_transfer_seconds_count{{role="decode",transport="nixl"}} {completed}.0\n'
        'pdserve_kv_transfer_seconds_bucket{role="decode",transport="nixl",le="0.1"} 3.0\n'
    )


def test_parse_and_assess() -> None:
    c = th.parse(page(7, 100) + page(1, 10))  # two label sets (pods) sum
    assert c == th.Counts(8.0, 110.0)
    assert th.assess(th.Counts(2, 10), 0.05, 5) == ""  # too few failures to call it
    assert th.assess(th.Counts(4, 500), 0.05, 1) == ""  # under the share
    message = th.assess(th.Counts(30, 70), 0.05, 5)
    assert message.startswith("30% of KV transfers failed") and "ucxTcpPortRange" in message


async def test_fallback_share_posts_a_warning_event(
    kubeconfig: str, client: KubeClient, api_server: Any
) -> None:
    # kopf posts Events only once it has discovered the events resource.
    api_server.resources["v1/events"] = kmock.ResourceInfo(
        kind="Event", namespaced=True, verbs={"get", "list", "create", "patch"}
    )
    counts = {"failures": 0, "completed": 50, "scrapes": 0}

    async def metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
        counts["scrapes"] += 1
        return aiohttp.web.Response(text=page(counts["failures"], counts["completed"]))

    app = aiohttp.web.Application()
    app.router.add_get("/{service}/metrics", metrics)
    async with TestServer(app) as stand_in:
        config = OperatorConfig(
            status_interval=3600,
            retry_delay=0.5,
            debounce=0.05,
            transfer_check_interval=0.5,
            decode_metrics_url=str(stand_in.make_url("")).rstrip("/") + "/{service}/metrics",
        )
        async with running_operator(config):
            await client.create(minimal_llmservice("demo"))
            await eventually(lambda: client.get("apps/v1", "Deployment", NS, "demo-decode"))
            await eventually(lambda: _scrapes(counts, 1), 10, "a first scrape")
            counts["completed"] += 40  # healthy traffic: no event
            target = counts["scrapes"] + 2
            await eventually(lambda: _scrapes(counts, target), 10, "two more scrapes")
            assert await _warned(api_server, absent=True)
            counts["failures"] += 20  # a blocked UCX port range: reads time out, decode recomputes
            event = await eventually(lambda: _warned(api_server), 15, "KVTransferFallback")
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "demo"
    assert "of KV transfers failed" in event["message"]


async def _scrapes(counts: dict[str, int], n: int) -> bool:
    return counts["scrapes"] >= n


async def _warned(api_server: Any, absent: bool = False) -> Any:
    events = [
        o
        for (_r, _ns, _n), o in api_server.objects.items()
        if not o.deleted and o.get("reason") == "KVTransferFallback"
    ]
    if absent:
        return not events
    return dict(events[0]) if events else None
