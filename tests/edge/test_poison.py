"""Issue 9's findings, on real workers: one client's bad values fail that client alone.

A poison request (a seed past 64 bits, a top_k past 63 bits, stop ids past the
vocabulary) is refused with a 400 naming the field, by the router and by the
workers' own API, while twelve other clients keep streaming to the end.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from pdserve.testing.loopback import all_kv_free, secret_auth

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
JSON = {"content-type": "application/json"}
TYPES = {"/prefill": "prefill_request", "/generate": "generate_request"}  # protocol/contract.py

POISONS: list[tuple[dict[str, Any], str]] = [
    ({"seed": 2**64 + 1}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"top_k": 2**63, "top_p": 0.5}, "top_k"),
    ({"temperature": 1e400}, "temperature"),  # json: Infinity
    ({"stop": ["x" * 5000]}, "stop"),
    ({"stop": ["s"] * 200}, "stop"),
    ({"min_tokens": 40, "max_tokens": 4}, "min_tokens"),
    ({"max_tokens": 2**70}, "max_tokens"),
]


def _error(resp: httpx.Response, status: int, param: str | None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err


async def _stream(h: httpx.AsyncClient, dep: Any, i: int) -> tuple[int, str | None, int]:
    body = {
        "model": dep.model,
        "prompt": f"client {i} says " + "hello " * (i * 4),
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    finish, tokens = None, 0
    async with h.stream("POST", "/v1/completions", json=body, headers=dep.headers()) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                finish = c["finish_reason"] or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        return r.status_code, finish, tokens


async def test_poison_fails_alone_while_twelve_streams_go_on(deployment) -> None:
    dep = deployment
    async with httpx.AsyncClient(base_url=dep.url, timeout=120) as h:
        others = [asyncio.create_task(_stream(h, dep, i)) for i in range(12)]
        await asyncio.sleep(0.3)  # the others are in the batch now
        for patch, field in POISONS:
            body = {
                "model": dep.model,
                "prompt": "poison " * 50,
                "max_tokens": 8,
                "temperature": 1.0,
                **patch,
            }
            raw = json.dumps(body)  # 1e400 -> Infinity, as a hostile client may send
            r = await h.post(
                "/v1/completions",
                content=raw,
                headers={**dep.headers(), "content-type": "application/json"},
            )
            _error(r, 400, field)
        results = await asyncio.gather(*others)
    assert results == [(200, "length", 24)] * 12
    all_kv_free(list(dep.workers))


async def test_workers_refuse_poison_themselves(deployment) -> None:
    """The worker API is reachable directly: it range-checks the same values."""
    prefill, decode = deployment.workers
    prompt = list(range(100, 140))
    async with httpx.AsyncClient(timeout=60) as h:
        for patch, field in [
            *POISONS,
            ({"stop_token_ids": [10**6], "min_tokens": 2}, "stop_token_ids"),
        ]:
            sampling = {"max_tokens": 8, **patch}
            # Infinity is refused as not JSON before any field is read (pdserve/jsonguard.py),
            # named by its top-level field, as a lone surrogate is
            where = "sampling" if patch == {"temperature": 1e400} else field
            for url, path in ((prefill, "/prefill"), (decode, "/generate")):
                body = json.dumps(
                    {
                        "type": TYPES[path],
                        "request_id": f"poison-{field}",
                        "prompt_token_ids": prompt,
                        "sampling": sampling,
                    }
                )
                r = await h.post(url + path, content=body, headers=JSON, auth=secret_auth())
                _error(r, 400, where)
        for url, path in ((prefill, "/prefill"), (decode, "/generate")):
            deep = b'{"request_id": "x", "sampling": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            r = await h.post(url + path, content=deep, headers=JSON, auth=secret_auth())
            _error(r, 400, None)
    all_kv_free(list(deployment.workers))


async def test_bad_unicode_and_deep_json_are_400(deployment) -> None:
    dep = deployment
    headers = {**dep.headers(), "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=dep.url, timeout=60) as h:
        # json.dumps cannot write a lone surrogate escape; a hostile client can
        lone = json.dumps({"model": dep.model, "prompt": "aSURb", "max_tokens": 2})
        lone = lone.replace("SUR", "\\ud800")
        _error(await h.post("/v1/completions", content=lone, headers=headers), 400, "prompt")
        msgs = [{"role": "user", "content": "xSURy"}]
        chat = json.dumps({"model": dep.model, "max_tokens": 2, "messages": msgs})
        chat = chat.replace("SUR", "\\udfff")
        _error(await h.post("/v1/chat/completions", content=chat, headers=headers), 400, "messages")
        deep = b"[" * 100_000 + b"]" * 100_000
        _error(await h.post("/v1/completions", content=deep, headers=headers), 400, None)
        nested = {"model": dep.model, "prompt": "hi", "user": "u", "stop": None}
        body = json.dumps(nested)[:-1] + ', "metadata": ' + "[" * 200 + "]" * 200 + "}"
        _error(await h.post("/v1/completions", content=body, headers=headers), 400, "metadata")
        ok = {"model": dep.model, "prompt": "héllo ✓ 😀", "max_tokens": 2}
        assert (await h.post("/v1/completions", json=ok, headers=dep.headers())).status_code == 200


@pytest.mark.unit
def test_decode_worker_marks_request_faults_in_its_stream() -> None:
    """The error line the router reads to tell a request fault from a worker fault."""
    from pdserve.decode_worker.server import DecodeWorker
    from pdserve.protocol.codec import decode
    from pdserve.protocol.contract import TokenDelta, WorkerError
    from pdserve.protocol.outputs import REQUEST_FAILED, RequestOutput
    from pdserve.router.errors import APIError
    from pdserve.worker_calls.worker_client import WorkerFailed, stream_error

    def line(code: str) -> WorkerError:
        out = RequestOutput("r", [], "", "error", 3, 1, 0, error="boom", error_code=code)
        error = decode(DecodeWorker._line(out), TokenDelta).error
        assert error is not None
        return error

    fault, worker = line(REQUEST_FAILED), line("")
    assert fault.code == REQUEST_FAILED and worker.code == "kv_transfer_failed"
    err = stream_error("http://w", fault)
    assert isinstance(err, APIError) and err.status == 422 and err.code == REQUEST_FAILED
    assert isinstance(stream_error("http://w", worker), WorkerFailed)


async def test_n_choices_at_the_edge_of_the_seed_range(deployment) -> None:
    """n > 1 gives choice i the seed + i: it wraps inside the 64-bit range."""
    dep = deployment
    async with httpx.AsyncClient(base_url=dep.url, timeout=60) as h:
        for seed in (2**64 - 1, -(2**63)):
            body = {
                "model": dep.model,
                "prompt": "edge of the range",
                "max_tokens": 3,
                "n": 3,
                "seed": seed,
                "temperature": 1.0,
            }
            r = await h.post("/v1/completions", json=body, headers=dep.headers())
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 3
    all_kv_free(list(dep.workers))
