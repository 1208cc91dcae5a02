"""One abuse battery against both router modes (issue 44 item 2): the built-in router
(HTTP) and the endpoint picker (ext_proc, spec.router.mode endpointPicker). Before the
fix the picker checked the API key only: rpm, tpm, per-key concurrency and admission
were gone in picker mode. Each case here is what one tenant key tries; the expected
status is the same in both modes. Fake workers; real sockets and gRPC."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from pdserve.testing.abuse import LIMITS, auth, battery, picker_mode, request_body
from pdserve.testing.picker import start_picker

pytestmark = [pytest.mark.unit, pytest.mark.timeout(90)]


@pytest.fixture
def pickers(router_tokenizer: Any, tiny_model_dir: Any) -> Any:
    def make(**kw: Any) -> Any:
        return start_picker(router_tokenizer, tiny_model_dir, **kw)

    return make


async def router_mode(cluster_factory: Any) -> list[tuple[str, int, int]]:
    async with cluster_factory(**LIMITS) as c, httpx.AsyncClient(base_url=c.url) as h:

        async def send(key: str, body: bytes) -> int:
            headers = {**auth(key), "content-type": "application/json"}
            return (await h.post("/v1/completions", content=body, headers=headers)).status_code

        async def hold(key: str) -> Callable[[], Awaitable[None]]:
            c.decode[0].token_delay_s = 0.2
            body = json.loads(request_body(8))
            task = asyncio.create_task(h.post("/v1/completions", json=body, headers=auth(key)))
            while c.runtime.active == 0:
                await asyncio.sleep(0.01)

            async def release() -> None:
                c.decode[0].token_delay_s = 0.0
                await task

            return release

        result = await battery(send, hold)
        await c.settle()
        return result


async def test_the_same_abuse_is_refused_in_both_modes(cluster_factory, pickers) -> None:
    for mode in (router_mode(cluster_factory), picker_mode(pickers)):
        got = await mode
        assert [(case, exp) for case, exp, _ in got] == [(case, g) for case, _, g in got], got
