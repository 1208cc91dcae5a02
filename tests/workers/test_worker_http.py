"""The workers' shared HTTP layer without a model: the service secret (401 except on the
open routes) and typed bodies (400 naming the field). The real workers mount exactly
this (``add_common_routes``); tests/workers/test_worker_faults.py checks a live one."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from pdserve.env import SECRET_HEADER
from pdserve.protocol.codec import to_dict
from pdserve.protocol.contract import GenerateRequest, RequestRef
from pdserve.signed_httpx import SignedAuth
from pdserve.worker.http import BadRequest, SecretCheck, error_response, read_message, reply

pytestmark = pytest.mark.unit


def app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(SecretCheck, secret="s3cret")

    @app.exception_handler(BadRequest)
    async def bad(_: Request, exc: BadRequest):  # type: ignore[no-untyped-def]
        return error_response(exc.status, str(exc), exc.param)

    for path in ("/livez", "/health", "/metrics", "/stats"):
        app.get(path)(lambda: {"ok": True})

    @app.post("/generate")
    async def generate(request: Request):  # type: ignore[no-untyped-def]
        return reply(RequestRef((await read_message(request, GenerateRequest)).request_id))

    return app


def test_secret_is_required_except_on_open_routes() -> None:
    client = TestClient(app())
    for path in ("/livez", "/health", "/metrics"):
        assert client.get(path).status_code == 200, path
    # The secret itself as a bearer header no longer opens anything: calls are signed.
    for headers in ({}, {SECRET_HEADER: "wrong"}, {SECRET_HEADER: "s3cret"}):
        resp = client.get("/stats", headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "unauthorized"
    assert client.get("/stats", auth=SignedAuth("s3cret")).status_code == 200
    body = to_dict(GenerateRequest("r", [1, 2]))
    assert client.post("/generate", json=body).status_code == 401


def test_typed_bodies_refuse_bad_fields_by_name() -> None:
    client = TestClient(app())
    client.auth = SignedAuth("s3cret")
    good = to_dict(GenerateRequest("r", [1, 2]))
    assert client.post("/generate", json=good).json() == to_dict(RequestRef("r"))
    for body, param in [
        ({**good, "prompt_token_ids": [1, "x"]}, "prompt_token_ids"),
        ({**good, "sampling": {"temperature": -1}}, "temperature"),
        ({**good, "sampling": {"bogus": 1}}, "bogus"),
        ({**good, "kv_handle": {"request_id": "r"}}, "kv_handle"),
        ({**good, "extra": 1}, "extra"),
    ]:
        resp = client.post("/generate", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.json()
    resp = client.post("/generate", json={**good, "type": "prefill_request"})
    assert resp.status_code == 400 and "expected a GenerateRequest" in resp.text
