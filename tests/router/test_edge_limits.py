"""Limits at the router's edge (router/edge.py, ratelimit.py, serving.prepare) over raw
HTTP against fake workers: body size, prompt length, rate limits, admission before
tokenizing, tokenizing off the event loop, and request faults never retried."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.router.raw_http import exchange

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

OK = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
LONG = "The quick brown fox jumps over the lazy dog. " * 4


async def test_body_over_the_limit_is_413_without_reading_it(cluster_factory) -> None:
    async with cluster_factory(max_body_bytes=1 << 20) as c:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 60000000\r\n\r\n"
        )
        t0 = time.monotonic()
        reply = await asyncio.to_thread(exchange, c.url, head, b'{"model": "tiny"')
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"request_too_large" in reply and time.monotonic() - t0 < 5
        # chunked, no Content-Length: refused once the bytes read pass the limit
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 65536
        body = (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 20  # 1.3 MB, never terminated
        reply = await asyncio.to_thread(exchange, c.url, head, body)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        async with httpx.AsyncClient(base_url=c.url) as h:  # the router serves on
            assert (await h.post("/v1/completions", json=OK)).status_code == 200
        assert c.runtime.active == 0
        await c.settle()


async def test_a_whole_body_over_the_limit_is_413(cluster_factory) -> None:
    """A body that is all in when the request starts (chunked: no Content-Length to refuse
    it by) is read at once, without a wait (router/edge.py's ``_whole_body``), and still
    bounded."""
    async with cluster_factory(max_body_bytes=1000) as c:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for size, status in ((1001, b"413"), (1000, b"400")):  # 1000 bytes of "y": no JSON
            data = b"y" * size
            body = b"%x\r\n" % len(data) + data + b"\r\n0\r\n\r\n"
            reply = await asyncio.to_thread(exchange, c.url, head, body)
            assert reply.startswith(b"HTTP/1.1 " + status), reply[:200]
        async with httpx.AsyncClient(base_url=c.url) as h:
            assert (await h.post("/v1/completions", json=OK)).status_code == 200
        await c.settle()


async def test_prompt_text_is_bounded_before_tokenizing(cluster_factory) -> None:
    async with cluster_factory(max_prompt_chars=1000) as c, httpx.AsyncClient(base_url=c.url) as h:
        calls = _count_tokenizer_calls(c)
        r = await h.post("/v1/completions", json={**OK, "prompt": "y" * 1001})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        msgs = [{"role": "user", "content": "z" * 600}, {"role": "user", "content": "z" * 600}]
        r = await h.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert calls == []
        assert (
            await h.post("/v1/completions", json={**OK, "prompt": "y" * 900})
        ).status_code == 200


def _count_tokenizer_calls(c: Any) -> list[str]:
    calls: list[str] = []
    tok = c.runtime.tokenizer
    encode = tok.encode

    def counted(text: str, add_special_tokens: bool = True) -> list[int]:
        calls.append(text[:20])
        return encode(text, add_special_tokens)

    tok.encode = counted
    return calls


async def test_admission_comes_before_parsing_and_tokenizing(cluster_factory) -> None:
    async with cluster_factory(max_queue=1, max_waiting=0, disagg_threshold=10_000) as c:
        c.decode[0].token_delay_s = 0.05
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
            busy = asyncio.create_task(h.post("/v1/completions", json={**OK, "max_tokens": 20}))
            while c.runtime.active == 0:
                await asyncio.sleep(0.01)
            calls = _count_tokenizer_calls(c)
            r = await h.post("/v1/completions", json={**OK, "prompt": "w " * 50_000})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert calls == []  # refused before its text was tokenized
            assert (await busy).status_code == 200
        await c.settle()


async def test_tokenize_passes_the_same_gates_as_a_completion(cluster_factory) -> None:
    """/tokenize and /detokenize run on the tokenizer threads the completions share: they
    are admitted under --max-queue and the request rate limit before their body is read,
    and their text is bounded by --max-prompt-chars before it is tokenized."""
    async with cluster_factory(
        max_queue=1,
        max_waiting=0,
        disagg_threshold=10_000,
        max_prompt_chars=1000,
        api_keys=("ka",),
        rate_limit_rpm=5,
    ) as c:
        c.decode[0].token_delay_s = 0.05
        auth = {"Authorization": "Bearer ka"}
        async with httpx.AsyncClient(base_url=c.url, timeout=30, headers=auth) as h:
            assert (await h.post("/tokenize", json={"prompt": "hello"})).status_code == 200
            calls = _count_tokenizer_calls(c)
            long_chat = {"messages": [{"role": "user", "content": "z" * 1001}]}
            for body in ({"prompt": "y" * 1001}, long_chat):
                r = await h.post("/tokenize", json=body)
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == next(iter(body)), r.text
            assert calls == []  # refused before its text was tokenized
            busy = asyncio.create_task(h.post("/v1/completions", json={**OK, "max_tokens": 20}))
            while c.runtime.active == 0:
                await asyncio.sleep(0.01)
            r = await h.post("/tokenize", json={"prompt": "w " * 400})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            assert (await busy).status_code == 200
            # the key's 5 requests per minute are spent: /detokenize counts too
            r = await h.post("/detokenize", json={"tokens": [1, 2]})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            assert calls == ["hello"] and c.runtime.active == 0  # the completion's prompt only
        async with httpx.AsyncClient(base_url=c.url) as h:
            assert (await h.post("/tokenize", json={"prompt": "hi"})).status_code == 401
        await c.settle()


async def test_rate_limits_per_api_key(cluster_factory) -> None:
    async with cluster_factory(api_keys=("ka", "kb"), rate_limit_rpm=3) as c:
        async with httpx.AsyncClient(base_url=c.url) as h:
            a, b = ({"Authorization": f"Bearer {k}"} for k in ("ka", "kb"))
            for _ in range(3):
                assert (await h.post("/v1/completions", json=OK, headers=a)).status_code == 200
            r = await h.post("/v1/completions", json=OK, headers=a)
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            assert 1 <= int(r.headers["retry-after"]) <= 20  # one request refills in 20 s
            assert (await h.post("/v1/completions", json=OK, headers=b)).status_code == 200
        await c.settle()
    async with cluster_factory(api_keys=("ka",), rate_limit_tpm=100) as c:
        async with httpx.AsyncClient(base_url=c.url, headers={"Authorization": "Bearer ka"}) as h:
            body = {**OK, "max_tokens": 40}  # ~2 prompt tokens + 40
            assert (await h.post("/v1/completions", json=body)).status_code == 200
            assert (await h.post("/v1/completions", json=body)).status_code == 200
            r = await h.post("/v1/completions", json=body)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
            r = await h.post("/v1/completions", json={**OK, "max_tokens": 200})
            assert r.status_code == 429 and int(r.headers["retry-after"]) <= 60, r.text
        await c.settle()


async def test_huge_request_does_not_stall_other_streams(cluster_factory) -> None:
    """An 880,000-character prompt (under --max-prompt-chars) is parsed and tokenized
    (one to a few seconds, by the machine) while four streams go on: their inter-token
    gaps stay small, the loop never stalls."""
    cfg = {"max_prompt_chars": 1 << 20, "disagg_threshold": 10_000}
    async with cluster_factory(**cfg) as c, httpx.AsyncClient(base_url=c.url, timeout=60) as h:
        c.decode[0].token_delay_s = 0.02
        gaps: list[float] = []

        async def stream() -> None:
            body = {**OK, "max_tokens": 120, "stream": True}
            async with h.stream("POST", "/v1/completions", json=body) as r:
                last = None
                async for _ in r.aiter_lines():
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

        streams = [asyncio.create_task(stream()) for _ in range(4)]
        await asyncio.sleep(0.3)
        t0 = time.perf_counter()
        big = await h.post("/v1/completions", json={**OK, "prompt": "fox jumps. " * 80_000})
        heavy = time.perf_counter() - t0
        await asyncio.gather(*streams)
    assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded"
    assert heavy > 0.5, f"the big request took {heavy:.2f}s: not heavy enough to show a stall"
    assert max(gaps) < min(0.4, heavy / 2), (max(gaps), heavy)


async def test_request_faults_are_never_retried(cluster_factory) -> None:
    async with cluster_factory(n_prefill=2, n_decode=2, disagg_threshold=16) as c:
        for st in c.prefill:
            st.fail = "request-fault"
        async with httpx.AsyncClient(base_url=c.url) as h:
            r = await h.post("/v1/completions", json={**OK, "prompt": LONG})
            assert r.status_code == 422 and r.json()["error"]["code"] == "request_failed"
            assert sum(len(st.requests) for st in c.prefill) == 1
            assert sum(len(st.requests) for st in c.decode) == 0
            for st in c.prefill:
                st.fail = ""
            for st in c.decode:
                st.fail = "request-fault"
            r = await h.post("/v1/completions", json={**OK, "prompt": LONG, "max_tokens": 5})
            assert r.status_code == 422 and r.json()["error"]["code"] == "request_failed"
            assert sum(len(st.requests) for st in c.decode) == 1
        await c.settle()


def test_token_buckets_refill_and_say_when() -> None:
    from pdserve.router.errors import APIError
    from pdserve.router.ratelimit import RateLimiter

    now = [0.0]
    rl = RateLimiter(rpm=60, tpm=600, clock=lambda: now[0])  # 1 request, 10 tokens a second
    for _ in range(60):
        rl.take_request("a")
    with pytest.raises(APIError) as err:
        rl.take_request("a")
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "1"
    rl.take_request("b")  # another client has its own bucket
    now[0] = 1.0
    rl.take_request("a")  # one second refilled one request
    rl.take_tokens("a", 600)
    with pytest.raises(APIError) as err:
        rl.take_tokens("a", 55)
    assert err.value.headers["Retry-After"] == "6"  # 55 tokens at 10 a second
    now[0] = 7.0
    rl.take_tokens("a", 55)
    with pytest.raises(APIError) as err:  # larger than a minute's budget: once it is full
        rl.take_tokens("a", 601)
    assert err.value.headers["Retry-After"] == "60"  # 595 tokens to refill, then it fits
    now[0] = 67.0
    rl.take_tokens("a", 601)  # issue 44: before, refused forever
    with pytest.raises(APIError) as err:
        rl.take_tokens("a", 9)  # the debt of 1 refills first: the rate holds
    assert err.value.headers["Retry-After"] == "1"
