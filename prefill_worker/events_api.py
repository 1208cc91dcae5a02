"""``GET /kv_blocks``: every block hash the prefill worker's prefix cache holds, as of a
KV event ``seq`` (``KVSnapshot``). A router replica that starts late, or that lost events
(a ``seq`` gap), loads it and follows the event stream from that ``seq`` on; signed like
every other internal call (worker/http.py's ``SecretCheck``)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pdserve.protocol.kv_events import KVSnapshot
from pdserve.worker.core.client import EngineClient
from pdserve.worker.http import error_response, reply


def add_event_routes(app: FastAPI, engine: EngineClient) -> None:
    @app.get("/kv_blocks")
    async def kv_blocks() -> JSONResponse:
        if not engine.alive:
            return error_response(503, "engine is not running")
        snap = await engine.query("kv_snapshot")
        assert isinstance(snap, KVSnapshot), type(snap)
        return reply(snap)
