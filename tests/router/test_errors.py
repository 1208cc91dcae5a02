"""Every error case over raw HTTP (httpx), with OpenAI's error body.

The fake workers (pdserve/testing/router_fakes.py) stand in for the real workers.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

OK = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


def err(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    if param is not None:
        assert body["param"] == param, body
    return body


BAD_PARAMS = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"n": 0}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"response_format": {"type": "some_unknown_kind"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"store": True}, "store"),
    ({"some_unknown_field": 1}, "some_unknown_field"),
    ({"echo": "yes"}, "echo"),  # echo is honoured; a non-boolean is refused by name
    ({"user": 5}, "user"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"model": None}, "model"),
]


async def test_bad_parameters_name_the_field(cluster_factory) -> None:
    async with cluster_factory() as c, httpx.AsyncClient(base_url=c.url) as h:
        for patch, field in BAD_PARAMS:
            err(await h.post("/v1/completions", json={**OK, **patch}), 400, field)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        for patch, field in [
            ({"messages": []}, "messages"),
            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
            ({"max_completion_tokens": -1}, "max_completion_tokens"),
            ({"top_p": 2}, "top_p"),
        ]:
            err(await h.post("/v1/chat/completions", json={**chat, **patch}), 400, field)
        assert all(st.requests == [] for st in c.prefill + c.decode)


async def test_malformed_json_and_non_object(cluster_factory) -> None:
    async with cluster_factory() as c, httpx.AsyncClient(base_url=c.url) as h:
        headers = {"content-type": "application/json"}
        err(await h.post("/v1/completions", content=b"{not json", headers=headers), 400)
        err(await h.post("/v1/chat/completions", content=b"[1, 2]", headers=headers), 400)
        err(await h.post("/v1/completions", content=b"\xff\xfe", headers=headers), 400)


async def test_prompt_longer_than_context(cluster_factory) -> None:
    async with cluster_factory() as c, httpx.AsyncClient(base_url=c.url) as h:
        # the fake workers report max_model_len 2048 in /stats
        body = err(await h.post("/v1/completions", json={**OK, "prompt": list(range(3000))}), 400)
        assert body["param"] == "prompt" and body["code"] == "context_length_exceeded"
        fits = {**OK, "prompt": list(range(2000)), "max_tokens": 100}
        err(await h.post("/v1/completions", json=fits), 400, "max_tokens")
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 3000}]}
        err(await h.post("/v1/chat/completions", json=chat), 400, "messages")


async def test_unknown_model_is_404(cluster_factory) -> None:
    async with cluster_factory() as c, httpx.AsyncClient(base_url=c.url) as h:
        body = err(await h.post("/v1/completions", json={**OK, "model": "gpt-9"}), 404, "model")
        assert body["code"] == "model_not_found"


async def test_api_key(cluster_factory, tmp_path) -> None:
    async with (
        cluster_factory(api_keys=("sekrit", "other")) as c,
        httpx.AsyncClient(base_url=c.url) as h,
    ):
        err(await h.post("/v1/completions", json=OK), 401)
        bad = {"Authorization": "Bearer nope"}
        err(await h.post("/v1/completions", json=OK, headers=bad), 401)
        err(await h.get("/v1/models", headers=bad), 401)
        err(await h.get("/workers"), 401)
        good = {"Authorization": "Bearer other"}
        assert (await h.post("/v1/completions", json=OK, headers=good)).status_code == 200
        # a tenant's key opens neither (an admin key does: tests/router/test_tenants.py)
        assert (await h.get("/workers", headers=good)).status_code == 403
        assert (await h.get("/health")).status_code == 200  # probes need no key
        assert (await h.get("/metrics")).status_code == 401
        await c.settle()


async def test_queue_full_is_429_with_retry_after(cluster_factory) -> None:
    async with cluster_factory(max_queue=2, max_waiting=0, disagg_threshold=10_000) as c:
        c.decode[0].token_delay_s = 0.2
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
            slow = {**OK, "max_tokens": 5}
            busy = [asyncio.create_task(h.post("/v1/completions", json=slow)) for _ in range(2)]
            while c.runtime.active < 2:
                await asyncio.sleep(0.01)
            resp = await h.post("/v1/completions", json=OK)
            err(resp, 429)
            assert resp.headers["retry-after"] == "1"
            assert all(r.status_code == 200 for r in await asyncio.gather(*busy))
            assert (await h.post("/v1/completions", json=OK)).status_code == 200
        await c.settle()


async def test_no_ready_worker_is_503(cluster_factory) -> None:
    async with (
        cluster_factory(n_prefill=1, n_decode=0) as c,
        httpx.AsyncClient(base_url=c.url) as h,
    ):
        body = err(await h.post("/v1/completions", json=OK), 503)
        assert body["type"] == "service_unavailable"
        assert (await h.get("/health")).status_code == 503
        assert (await h.get("/livez")).status_code == 200  # not ready, but alive: no restart
