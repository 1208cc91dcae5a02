"""The workers' LoRA endpoints (signed like every internal route; the router's admin
endpoints fan out to them): ``POST /v1/load_lora_adapter`` {"lora_name", "lora_path"} →
{"name", "hash"}, ``POST /v1/unload_lora_adapter`` {"lora_name"} → {"name"}. vLLM's
names and bodies. Errors: 400 naming the field (a bad name, a missing directory, an
adapter the engine does not implement), 404 ``lora_not_found`` for an unknown name."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdserve.jsonguard import BadJSON, loads_checked
from pdserve.protocol.contract import valid_lora_name
from pdserve.worker.core.client import EngineClient
from pdserve.worker.http import BadRequest

MAX_BODY_BYTES = 64 << 10
MAX_PATH_CHARS = 4096


async def _body(request: Request, fields: tuple[str, ...]) -> dict[str, str]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    try:
        body: Any = loads_checked(raw)
    except BadJSON as exc:
        raise BadRequest(str(exc), exc.field) from exc
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    for key in body:
        if key not in fields:
            raise BadRequest(f"unknown field {key!r} (expected {', '.join(fields)})", key)
    name = body.get("lora_name")
    if not valid_lora_name(name):
        raise BadRequest("lora_name must be a printable string of 1 to 256 characters", "lora_name")
    if "lora_path" in fields:
        path = body.get("lora_path")
        if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH_CHARS:
            raise BadRequest("lora_path must be a non-empty path", "lora_path")
    return body


def add_lora_routes(app: FastAPI, engine: EngineClient) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> JSONResponse:
        body = await _body(request, ("lora_name", "lora_path"))
        got = await engine.query("lora_load", body["lora_name"], body["lora_path"])
        if "error" in got:
            raise BadRequest(got["error"], got["field"])
        return JSONResponse({"name": got["name"], "hash": got["hash"]})

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> JSONResponse:
        name = (await _body(request, ("lora_name",)))["lora_name"]
        if not await engine.query("lora_unload", name):
            raise BadRequest(
                f"LoRA adapter {name!r} is not loaded", "lora_name", 404, "lora_not_found"
            )
        return JSONResponse({"name": name})
