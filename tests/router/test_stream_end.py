"""A stream's end goes out with its last token (router/api/serving.py ``sse_tail``): the
client has [DONE] before the decode worker's reply has ended, and the router still reads
that reply to its end, so the connection goes back to the pool."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.router.test_api import LONG

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.mark.parametrize("usage", [False, True])
async def test_done_goes_with_the_last_token(cluster_factory, usage: bool) -> None:
    async with cluster_factory(disagg_threshold=16) as c:
        c.decode[0].end_delay_s = 1.5  # the worker's reply ends 1.5 s after its last line
        body = {
            "model": "tiny",
            "prompt": LONG,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": usage},
        }
        lines, t0 = [], time.monotonic()
        async with (
            httpx.AsyncClient(base_url=c.url, timeout=30) as h,
            h.stream("POST", "/v1/completions", json=body) as resp,
        ):
            async for line in resp.aiter_lines():
                if line:
                    lines.append(line)
                if line == "data: [DONE]":
                    took = time.monotonic() - t0
                    break
        assert took < 1.0, f"[DONE] waited for the worker's reply to end: {took:.2f} s"
        chunks = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
        text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
        assert text.endswith(" t0 t1 t2"), text
        assert ("usage" in chunks[-1] and chunks[-1]["usage"] is not None) == usage
        pool = c.runtime.dispatcher.client
        deadline = time.monotonic() + 5
        while sum(map(len, pool._idle.values())) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # the decode connection read to its end, back in the pool (the prefill's too)
        assert sum(map(len, pool._idle.values())) == 2
        assert c.runtime.active == 0
        await c.settle()
