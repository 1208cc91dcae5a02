"""The router's LoRA admin endpoints, vLLM's names and bodies: ``POST /v1/load_lora_adapter``
{"lora_name", "lora_path"} and ``POST /v1/unload_lora_adapter`` {"lora_name"}.

Admin only: an admin key on every port (403 with a tenant's key); unlike /metrics and
/workers, the ``--admin-port`` opens nothing here without the key. Each fans out to every
healthy worker of both pools (router/transport/lora_fanout.py) and then updates the
router's adapter table, which /v1/models lists and requests name as their ``model``. The
path is the workers' (and, with ``--lora``, the router's) view of the adapter directory.

A router of several processes (``--procs``): the process that took the call tells its
siblings the new table entry on their loopback ports (``/internal/lora_table``, answered
only there), so every process serves the adapter.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdserve.protocol.contract import valid_lora_name
from pdserve.router import adapters, edge
from pdserve.router.errors import APIError, invalid
from pdserve.router.runtime import Runtime
from pdserve.router.transport import lora_fanout

MAX_BODY_BYTES = 64 << 10
MAX_PATH_CHARS = 4096
SIBLING_TIMEOUT_S = 5.0


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
            raise invalid(
                f"lora_path must be a path of 1 to {MAX_PATH_CHARS} characters", "lora_path"
            )
    return body


def _worker_urls(rt: Runtime) -> list[str]:
    return [w.url for w in rt.discovery.snapshot().workers if w.healthy]


async def _tell_siblings(rt: Runtime, change: dict[str, str]) -> None:
    """The other router processes' tables take ``change`` (each on its loopback port)."""
    ports = [p for i, p in enumerate(rt.cfg.proc_metrics_ports) if i != rt.cfg.proc_index]
    if not ports:
        return
    timeout = aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def tell(port: int) -> None:
            url = f"http://127.0.0.1:{port}/internal/lora_table"
            async with session.post(url, data=json.dumps(change)) as resp:
                if resp.status != 200:
                    raise APIError(
                        500,
                        f"router process on port {port} refused the "
                        f"adapter table change (HTTP {resp.status})",
                    )

        try:
            await asyncio.gather(*(tell(p) for p in ports))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise APIError(500, f"a router process did not take the change: {exc!r}") from exc


def _apply(rt: Runtime, change: dict[str, str]) -> None:
    if change.get("op") == "add":
        rt.loras.add(adapters.Adapter(change["name"], change["hash"], change["path"]))
    else:
        rt.loras.remove(change["name"])


def add_lora_admin_routes(app: FastAPI, runtime: Callable[[], Runtime]) -> None:
    lock = asyncio.Lock()  # one change at a time: a load racing an unload of one name

    async def body_of(request: Request, fields: tuple[str, ...]) -> dict[str, str]:
        runtime().require_admin(request, change=True)
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
                raise invalid(
                    f"LoRA adapter {name!r} is already loaded; unload it first",
                    "lora_name",
                    "lora_exists",
                )
            digest = await lora_fanout.load(rt.client, _worker_urls(rt), name, path)
            change = {"op": "add", "name": name, "hash": digest, "path": path}
            _apply(rt, change)
            await _tell_siblings(rt, change)
        return JSONResponse({"name": name, "hash": digest})

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> JSONResponse:
        rt = runtime()
        name = (await body_of(request, ("lora_name",)))["lora_name"]
        async with lock:
            known = rt.loras.get(name)
            rt.loras.remove(name)  # first: no late worker is told to load it meanwhile
            try:
                had = await lora_fanout.unload(rt.client, _worker_urls(rt), name)
            except APIError:
                if known is not None:  # some workers may still serve it: keep listing it
                    rt.loras.add(known)
                raise
            if known is None and not had:
                raise APIError(
                    404, f"LoRA adapter {name!r} is not loaded", "lora_name", "lora_not_found"
                )
            change = {"op": "remove", "name": name}
            _apply(rt, change)
            await _tell_siblings(rt, change)
        return JSONResponse({"name": name})

    @app.post("/internal/lora_table", include_in_schema=False)
    async def sibling_change(request: Request) -> JSONResponse:
        rt = runtime()
        server = request.scope.get("server") or ("", 0)
        if server[1] not in rt.cfg.proc_metrics_ports:  # only a sibling, on loopback
            raise APIError(404, "not found")
        change = edge.parse_json(await edge.read_body(request, MAX_BODY_BYTES))
        if not isinstance(change, dict) or not valid_lora_name(change.get("name")):
            raise invalid("a table change needs a name", "name")
        try:
            _apply(rt, change)
        except (KeyError, ValueError) as exc:
            raise invalid(f"bad table change: {exc}") from exc
        return JSONResponse({"name": change["name"]})
