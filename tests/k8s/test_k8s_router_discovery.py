"""The router's Kubernetes discovery: a watch on EndpointSlices, against the API emulator.

The emulator (pdserve/testing/k8s_emulator.py + k8s_history.py) serves EndpointSlices with
a real API server's resourceVersion semantics: LIST at a version, WATCH from one, 410 Gone
once the history is compacted, ``timeoutSeconds``, label selectors. Requests are counted by
User-Agent (``pdserve-router``). No EndpointSlice controller runs here: the tests write the
slices it would write (one per pool Service, conditions per pod).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from k8s_helpers import NS, eventually
from k8s_slices import Slices, endpoint_slice, ep

from pdserve.router.discovery.k8s import KubernetesSource
from pdserve.router.discovery.kube_api import ApiAccess
from pdserve.testing.k8s_emulator import ApiServer

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def source(server: ApiServer, **kw: Any) -> AsyncIterator[KubernetesSource]:
    src = KubernetesSource("chat", NS, access=lambda: ApiAccess(str(server.url).rstrip("/")), **kw)
    try:
        yield src
    finally:
        await src.close()


def router_requests(server: ApiServer, watch: bool) -> int:
    return sum(
        c
        for (agent, method, w), c in server.by_agent.items()
        if agent == "pdserve-router" and method == "GET" and w == watch
    )


async def urls(src: KubernetesSource) -> list[tuple[str, str]]:
    return [(e.role, e.url) for e in await src.list()]


async def until(src: KubernetesSource, want: list[tuple[str, str]], what: str) -> None:
    async def check() -> bool:
        return await urls(src) == want

    await eventually(check, timeout=10, what=what)


async def test_slices_over_time_add_remove_not_ready_terminating(
    api_server: ApiServer, slices: Slices
) -> None:
    await slices.put(endpoint_slice("chat-decode-a", "chat-decode", ep("10.0.0.1")))
    await slices.put(endpoint_slice("other-decode-a", "other-decode", ep("10.9.9.9")))
    async with source(api_server) as src:
        assert await urls(src) == [("decode", "http://10.0.0.1:8080")]  # after the first LIST
        await slices.put(
            endpoint_slice("chat-prefill-a", "chat-prefill", ep("10.0.1.1", None), port=9000)
        )
        await until(
            src,
            [("decode", "http://10.0.0.1:8080"), ("prefill", "http://10.0.1.1:9000")],
            "a new prefill slice (ready unset counts as ready; its http port)",
        )
        await slices.put(
            endpoint_slice(
                "chat-decode-a", "chat-decode", ep("10.0.0.1"), ep("10.0.0.2", ready=False)
            )
        )
        await asyncio.sleep(0.3)
        assert ("decode", "http://10.0.0.2:8080") not in await urls(src)  # not ready: not routed
        await slices.put(
            endpoint_slice(
                "chat-decode-a",
                "chat-decode",
                ep("10.0.0.1", ready=False, serving=True, terminating=True),
                ep("10.0.0.2"),
            )
        )
        await until(
            src,
            [("decode", "http://10.0.0.2:8080"), ("prefill", "http://10.0.1.1:9000")],
            "the terminating decode endpoint out, the ready one in",
        )
        await slices.delete("chat-prefill-a")
        await until(src, [("decode", "http://10.0.0.2:8080")], "the deleted slice gone")
        assert router_requests(api_server, watch=False) == 1  # one LIST, the rest by watch


async def test_steady_state_sends_no_requests(api_server: ApiServer, slices: Slices) -> None:
    await slices.put(endpoint_slice("chat-decode-a", "chat-decode", ep("10.0.0.1")))
    async with source(api_server) as src:
        for _ in range(20):  # the router's health loop asks every round: no API request each
            assert await urls(src) == [("decode", "http://10.0.0.1:8080")]
        await asyncio.sleep(2.0)
        assert router_requests(api_server, watch=False) == 1
        assert router_requests(api_server, watch=True) == 1  # one watch, held open


async def test_watch_timeout_resumes_from_version_without_listing(
    api_server: ApiServer, slices: Slices
) -> None:
    await slices.put(endpoint_slice("chat-decode-a", "chat-decode", ep("10.0.0.1")))
    async with source(api_server, watch_timeout_s=1.0) as src:
        assert len(await src.list()) == 1
        await asyncio.sleep(1.5)  # the server ended the first watch; the second one is open
        await slices.put(
            endpoint_slice("chat-decode-a", "chat-decode", ep("10.0.0.1"), ep("10.0.0.3"))
        )
        await until(
            src,
            [("decode", "http://10.0.0.1:8080"), ("decode", "http://10.0.0.3:8080")],
            "an event after a watch timeout",
        )
        assert router_requests(api_server, watch=False) == 1  # resumed, never re-listed
        assert router_requests(api_server, watch=True) >= 2


async def test_410_gone_relists_and_misses_nothing(api_server: ApiServer, slices: Slices) -> None:
    await slices.put(endpoint_slice("chat-decode-a", "chat-decode", ep("10.0.0.1")))
    async with source(api_server, watch_timeout_s=1.0) as src:
        assert len(await src.list()) == 1
        await src.close()  # the router loses its watch (say, a network partition) ...
        await slices.put(endpoint_slice("chat-decode-a", "chat-decode", ep("10.0.0.4")))
        await slices.put(endpoint_slice("chat-prefill-a", "chat-prefill", ep("10.0.1.4")))
        history = api_server.history("endpointslices")
        history.compact(history.last)  # ... and the API server compacts what it missed
        await until(
            src,
            [("decode", "http://10.0.0.4:8080"), ("prefill", "http://10.0.1.4:8080")],
            "the state after 410 Gone and a new LIST",
        )
        assert router_requests(api_server, watch=False) == 2  # the first LIST and one after 410


async def test_backs_off_while_the_api_server_is_down(
    api_server: ApiServer, slices: Slices
) -> None:
    await slices.put(endpoint_slice("chat-decode-a", "chat-decode", ep("10.0.0.1")))
    api_server.outage = 503
    async with source(api_server, backoff_s=(0.1, 1.0), first_sync_s=0.1) as src:
        assert await src.list() == []
        await asyncio.sleep(2.5)
        failed = router_requests(api_server, watch=False)
        # 0.1 + 0.2 + 0.4 + 0.8 + 1.0 ... (±20%): about 5 tries in 2.5 s, not a tight loop
        assert 3 <= failed <= 7, failed
        api_server.outage = 0
        await until(src, [("decode", "http://10.0.0.1:8080")], "recovery after the outage")


async def test_discovery_drops_a_terminating_decode_worker_at_the_watch_event(
    api_server: ApiServer, slices: Slices
) -> None:
    """The router's health loop (interval 30 s here) runs a round as soon as the watch sees a
    change: a terminating decode worker leaves rotation at once, while the router's count of
    the streams it still serves there runs on (they end normally)."""
    from pdserve.router.discovery.workers import Discovery
    from pdserve.testing.router_fakes import SECRET, FakeState, decode_app, serve
    from pdserve.worker_calls.worker_client import new_session

    async with (
        serve(decode_app(FakeState("decode", "d-a"))) as url_a,
        serve(decode_app(FakeState("decode", "d-b"))) as url_b,
    ):
        port_a, port_b = (int(u.rsplit(":", 1)[1]) for u in (url_a, url_b))
        await slices.put(
            endpoint_slice("chat-decode-a", "chat-decode", ep("127.0.0.1"), port=port_a)
        )
        await slices.put(
            endpoint_slice("chat-decode-b", "chat-decode", ep("127.0.0.1"), port=port_b)
        )
        async with new_session(SECRET) as http, source(api_server) as src:  # signed calls
            disc = Discovery(src, http, interval_s=30.0)
            disc.start()
            try:
                await asyncio.wait_for(disc.ready.wait(), 10)
                healthy = {w.url for w in disc.snapshot().decode}
                assert healthy == {url_a, url_b}
                disc.begin(url_a)  # a stream in flight on a
                await slices.put(
                    endpoint_slice(
                        "chat-decode-a",
                        "chat-decode",
                        ep("127.0.0.1", False, True, serving=True),
                        port=port_a,
                    )
                )

                async def only_b() -> bool:
                    return {w.url for w in disc.snapshot().decode} == {url_b}

                await eventually(only_b, timeout=3, what="a out of rotation at the event")
                disc.end(url_a)  # its stream finished normally
            finally:
                await disc.stop()


async def test_source_reaches_the_api_through_the_kubeconfig(
    api_server: ApiServer, slices: Slices, kubeconfig: str
) -> None:
    """Outside a pod the router reads $KUBECONFIG (its server and bearer token)."""
    from pdserve.router.discovery.kube_api import load_access

    access = load_access()
    assert access.base_url == str(api_server.url).rstrip("/")
    assert access.headers()["Authorization"] == "Bearer test-token"
    await slices.put(endpoint_slice("chat-decode-a", "chat-decode", ep("10.0.0.1")))
    src = KubernetesSource("chat", NS)  # the default access: load_access()
    try:
        assert await urls(src) == [("decode", "http://10.0.0.1:8080")]
    finally:
        await src.close()
