"""The whole endpoint-picker path: Envoy's side of ext_proc, the picker, then the request
dialled to the picked decode pod's front (``RouterConfig.prefill_from_header``), which runs
the prefill on the worker the picker named and streams the answer back through ext_proc.

Each fake decode worker has its own front (a router app over that worker alone), as a
decode pod has in a cluster; the gateway here is the test: it tries the endpoints in the
order the picker gave, as Envoy's retries do.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve import keys
from pdserve.protocol.contract import GenerateRequest, PrefillRequest
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.discovery.workers import StaticSource
from pdserve.router.picker import prefill_header
from pdserve.router.picker.prefill_header import PREFILL_HEADER, SIGNATURE_HEADER, endpoint_of
from pdserve.router.scheduling import disagg
from pdserve.router.scheduling.routing import RoutePlan
from pdserve.router.scheduling.snapshot import Snapshot, WorkerView
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.testing.loopback import free_port
from pdserve.testing.picker import Envoy, PickerCluster, completion, start_picker
from pdserve.testing.router_fakes import serve

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@contextlib.asynccontextmanager
async def fronts(
    tokenizer: PromptTokenizer, model_dir: Path, decode_urls: list[str]
) -> AsyncIterator[dict[str, str]]:
    """decode worker URL -> its front's ip:port."""
    out = {}
    async with contextlib.AsyncExitStack() as stack:
        for url in decode_urls:
            cfg = RouterConfig(
                model_dir=str(model_dir),
                served_model_name="tiny",
                health_interval_s=0.2,
                prefill_from_header=True,
            )
            app = create_app(cfg, StaticSource([], [url]), tokenizer)
            out[url] = endpoint_of(await stack.enter_async_context(serve(app)))
        yield out


async def gateway(env: Envoy, pc: PickerCluster, body: bytes) -> tuple[str, list[bytes], str]:
    """One request through the picker and to the endpoints it named, in order; the
    response's chunks pass back through ext_proc. Returns (served, chunks, text)."""
    routed = await env.request("/v1/completions", body, chunks=3)
    assert routed.status == 0, routed.error
    headers = {k: v for k, v in routed.set_headers.items() if not k.startswith("x-gateway")}
    headers.pop("content-length", None)
    async with httpx.AsyncClient(timeout=10) as client:
        for endpoint in routed.endpoints:
            try:
                url = f"http://{endpoint}/v1/completions"
                async with client.stream(
                    "POST", url, content=routed.body_back, headers=headers
                ) as r:
                    assert r.status_code == 200, await r.aread()
                    chunks = [c async for c in r.aiter_bytes() if c]
            except httpx.ConnectError:
                continue  # Envoy's retry: the next endpoint of the list
            passed = await env.response(endpoint, chunks)
            env.close()
            return endpoint, passed, b"".join(passed).decode()
    raise AssertionError(f"no endpoint answered: {routed.endpoints}")


@pytest.fixture
def make(router_tokenizer: PromptTokenizer, tiny_model_dir: Path):
    @contextlib.asynccontextmanager
    async def go(**kw: Any) -> AsyncIterator[PickerCluster]:
        async with contextlib.AsyncExitStack() as stack:
            pc = await stack.enter_async_context(
                start_picker(router_tokenizer, tiny_model_dir, **kw)
            )
            front = await stack.enter_async_context(
                fronts(router_tokenizer, tiny_model_dir, pc.decode_urls)
            )
            pc.target.update(front)
            yield pc

    return go


async def test_streamed_completion_through_the_picked_pod(make) -> None:
    async with make(disagg_threshold=32) as pc:
        env = pc.envoy()
        served, chunks, text = await gateway(env, pc, completion(list(range(10, 90)), 5))
        assert served in pc.target.values()
        assert len(chunks) >= 2 and text.rstrip().endswith("data: [DONE]")
        # The prefill ran on the worker the picker named; the decode worker pulled its KV.
        named = [
            st
            for st, url in zip(pc.prefill, pc.prefill_urls, strict=True)
            if any(isinstance(r, PrefillRequest) for r in st.requests)
        ]
        assert len(named) == 1
        d = [st for st in pc.decode if st.requests]
        assert len(d) == 1 and isinstance(d[0].requests[0], GenerateRequest)
        assert d[0].requests[0].kv_handle is not None
        await pc.settle()


async def test_failed_primary_then_the_next_pick_excludes_it(make) -> None:
    """d0 ranks first, but its pod does not answer: the gateway walks to d1, the picker
    hears d1 served, and the next request is not sent to d0 at all."""
    async with make(busy=[1], health_interval_s=30.0) as pc:
        pc.target[pc.decode_urls[0]] = f"127.0.0.1:{free_port()}"  # nothing listens there
        env = pc.envoy()
        served, _, text = await gateway(env, pc, completion("hello there", 3))
        assert served == pc.endpoint(1) and "[DONE]" in text
        env = pc.envoy()
        served, _, _ = await gateway(env, pc, completion("hello again", 3))
        assert served == pc.endpoint(1)
        assert pc.service.rt.discovery.failed_check(pc.decode_urls[0])
        pc.decode[1].active.pop("busy")
        await pc.settle()


def _plan() -> tuple[RoutePlan, Snapshot]:
    decode = WorkerView("http://10.0.0.9:8200", "decode")
    prefill = WorkerView("http://10.0.0.7:8100", "prefill")
    return RoutePlan(disagg.LOCAL_PREFILL, (), (decode,), 0), Snapshot((decode, prefill))


def test_front_takes_only_a_signed_prefill_endpoint() -> None:
    plan, snap = _plan()
    endpoint, body = "10.0.0.7:8100", b'{"prompt": "hello"}'
    signed = {PREFILL_HEADER: endpoint, SIGNATURE_HEADER: prefill_header.sign(endpoint, body)}
    pinned = prefill_header.pinned(signed, plan, snap, body)
    assert pinned.kind == disagg.REMOTE_PREFILL and pinned.prefill == (snap.workers[1],)
    forged = {PREFILL_HEADER: "evil.example:80", SIGNATURE_HEADER: signed[SIGNATURE_HEADER]}
    for headers in ({PREFILL_HEADER: endpoint}, forged, {**signed, SIGNATURE_HEADER: "zz"}, {}):
        assert prefill_header.pinned(headers, plan, snap, body).kind == disagg.LOCAL_PREFILL
    unknown = "10.0.0.8:8100"  # signed but not (yet) in the front's discovery: taken
    headers = {PREFILL_HEADER: unknown, SIGNATURE_HEADER: prefill_header.sign(unknown, body)}
    assert prefill_header.pinned(headers, plan, snap, body).prefill[0].url == "http://" + unknown


def test_a_captured_prefill_pin_expires_and_pins_only_its_own_request() -> None:
    """Issue 44 item 10: before, the signature covered the endpoint alone under the HTTP
    key: a captured pair pinned any prompt to that host, forever."""
    plan, snap = _plan()
    endpoint, body = "10.0.0.7:8100", b'{"prompt": "hello"}'
    stale = prefill_header.sign(endpoint, body, now=time.time() - 2 * prefill_header.WINDOW_S)
    tag = keys.KeyRing.from_env(keys.HTTP).sign(b"pdserve/prefill-endpoint", endpoint.encode())
    refused = {
        "expired": (stale, body),
        "another request's body": (prefill_header.sign(endpoint, body), b'{"prompt": "x"}'),
        "the HTTP key's tag (another purpose)": (f"{time.time():.3f} {tag.hex()}", body),
    }
    for case, (signature, sent) in refused.items():
        headers = {PREFILL_HEADER: endpoint, SIGNATURE_HEADER: signature}
        assert prefill_header.pinned(headers, plan, snap, sent).kind == disagg.LOCAL_PREFILL, case
