"""The router's LoRA admin endpoints, vLLM's names and bodies: ``POST /v1/load_lora_adapter``
{"lora_name", "lora_path"} and ``POST /v1/unload_lora_adapter`` {"lora_name"}.

Admin only (an admin key, or the ``--admin-port``; 403 with a tenant's key), as /metrics
and /workers. Each fans out to every healthy worker of both pools
(router/transport/lora_fanout.py) and then updates the router's adapter table, which
/v1/models lists and requests name as their ``model``. The path is the workers' (and,
with ``--lora``, the router's) view of the adapter directory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdserve.protocol.contract import valid_lora_name
from pdserve.router import edge
from pdserve.router.api import adapters
from pdserve.router.api.errors import APIError, invalid
from pdserve.router.runtime import Runtime
from pdserve.router.transport import lora_fanout

MAX_BODY_BYTES = 64 << 10
MAX_PATH_CHARS = 4096


def parse_body(raw: bytes, fields: tuple[str, ...]) -> dict[str, str]:
    """The checked body: a JSON object of exactly ``fields`` (400 naming a bad one)."""
    body: Any = edge.parse_json(raw)
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    for key in body:
        if key not in fields:
            raise invalid(f"unknown field {key!r} (expected {', '.join(fields)})", key)
    if not valid_lora_name(body.get("lora_name")):
        raise invalid("lora_name must be a printable string of 1 to 256 characters", "lora_name")
    if "lora_path" in fields:
        path = body.get("lora_path")
        if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH_CHARS:
            raise invalid(f"lora_path must be a path of 1 to {MAX_PATH_CHARS} characters",
                          "lora_path")  # fmt: skip
    return body


def _worker_urls(rt: Runtime) -> list[str]:
    return [w.url for w in rt.discovery.snapshot().workers if w.healthy]


def add_lora_admin_routes(app: FastAPI, runtime: Callable[[], Runtime]) -> None:
    lock = asyncio.Lock()  # one change at a time: a load racing an unload of one name

    async def body_of(request: Request, fields: tuple[str, ...]) -> dict[str, str]:
        runtime().require_admin(request)
        raw = await edge.read_body(request, MAX_BODY_BYTES, runtime().cfg.body_timeout_s)
        return parse_body(raw, fields)

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> JSONResponse:
        rt = runtime()
        body = await body_of(request, ("lora_name", "lora_path"))
        name, path = body["lora_name"], body["lora_path"]
        async with lock:
            if name in rt.base_names:
                raise invalid(f"lora_name {name!r} is the base model's name", "lora_name")
            if rt.loras.get(name) is not None:
                raise invalid(f"LoRA adapter {name!r} is already loaded; unload it first",
                              "lora_name", "lora_exists")  # fmt: skip
            digest = await lora_fanout.load(rt.client, _worker_urls(rt), name, path)
            rt.loras.add(adapters.Adapter(name, digest, path))
        return JSONResponse({"name": name, "hash": digest})

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> JSONResponse:
        rt = runtime()
        name = (await body_of(request, ("lora_name",)))["lora_name"]
        async with lock:
            known = rt.loras.get(name) is not None
            had = await lora_fanout.unload(rt.client, _worker_urls(rt), name)
            if not known and not had:
                raise APIError(404, f"LoRA adapter {name!r} is not loaded", "lora_name",
                               "lora_not_found")  # fmt: skip
            rt.loras.remove(name)
        return JSONResponse({"name": name})
