"""A terminating decode worker, end to end: the real router app, discovering workers through
its EndpointSlice watch on the API emulator, in front of the fake workers of tests/router
(they speak the real worker protocol; no model runs here).

Decode worker a serves a slow stream; its pod starts terminating (the EndpointSlice
controller marks it ready=false, serving=true, terminating=true). New requests must go to b
from the watch event on, while a's stream runs to its last token.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from k8s_helpers import NS, eventually
from k8s_slices import Slices, endpoint_slice, ep

from pdserve.env import SERVICE_SECRET
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.discovery.k8s import KubernetesSource
from pdserve.router.discovery.kube_api import ApiAccess
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.testing.k8s_emulator import ApiServer
from pdserve.testing.router_fakes import SECRET, TOTAL_BLOCKS, FakeState, decode_app, serve

pytestmark = pytest.mark.timeout(60)
OK = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_terminating_decode_gets_no_new_request_and_its_stream_finishes(
    api_server: ApiServer, slices: Slices, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SERVICE_SECRET, SECRET)
    a, b = FakeState("decode", "a", token_delay_s=0.05), FakeState("decode", "b")
    async with serve(decode_app(a)) as url_a, serve(decode_app(b)) as url_b:
        await slices.put(
            endpoint_slice("chat-decode-a", "chat-decode", ep("127.0.0.1"), port=port_of(url_a))
        )
        source = KubernetesSource("chat", NS, access=lambda: ApiAccess(str(api_server.url)))
        # health every 30 s: only the watch event can take a out of rotation in time
        config = RouterConfig(
            model_dir=str(tiny_model_dir),
            served_model_name="tiny",
            health_interval_s=30.0,
            disagg_threshold=10_000,
        )
        app = create_app(config, source, PromptTokenizer(str(tiny_model_dir)))
        async with serve(app) as router, httpx.AsyncClient(base_url=router, timeout=30) as h:
            body = {**OK, "max_tokens": 30, "stream": True}
            async with h.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # a is streaming
                assert len(a.requests) == 1
                await slices.put(
                    endpoint_slice(
                        "chat-decode-b", "chat-decode", ep("127.0.0.1"), port=port_of(url_b)
                    )
                )
                await slices.put(
                    endpoint_slice(
                        "chat-decode-a",
                        "chat-decode",
                        ep("127.0.0.1", ready=False, serving=True, terminating=True),
                        port=port_of(url_a),
                    )
                )

                async def only_b() -> bool:
                    snap = app.state.runtime.discovery.snapshot()
                    return [w.url for w in snap.decode] == [url_b]

                await eventually(only_b, timeout=5, what="a out of rotation, b in")
                for _ in range(3):
                    assert (await h.post("/v1/completions", json=OK)).status_code == 200
                assert (len(a.requests), len(b.requests)) == (1, 3)  # no new request on a
                rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            chunks = [json.loads(line[6:]) for line in rest[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # all 30 tokens
        await asyncio.sleep(0.1)
        assert a.kv_blocks_free == TOTAL_BLOCKS and b.kv_blocks_free == TOTAL_BLOCKS
