"""The router's LoRA admin calls, fanned out to every worker of both pools (signed, on the
router's worker session): ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

A load counts only when every healthy worker loaded the same files (one hash); otherwise
the workers that did load it unload it again, so no pool serves an adapter another pool
lacks, and the caller hears the first refusal (the worker's 400/404 with its field) or
which worker failed (502).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import aiohttp

from pdserve.protocol.contract import valid_lora_hash
from pdserve.router.errors import APIError, from_worker_body
from pdserve.worker_calls.worker_client import JSON, TRANSPORT_ERRORS, _decode_json, _timeout

LOAD_TIMEOUT_S = 120.0  # a worker reads and checks the files, then copies them to its device


async def _post(
    client: aiohttp.ClientSession, url: str, path: str, body: dict[str, str]
) -> tuple[int, Any]:
    """(status, JSON body); status 0 with the reason when the worker did not answer."""
    try:
        async with client.post(
            url + path,
            data=json.dumps(body).encode(),
            headers=JSON,
            timeout=_timeout(LOAD_TIMEOUT_S),
        ) as resp:
            return resp.status, _decode_json(await resp.read())
    except TRANSPORT_ERRORS as exc:
        return 0, repr(exc)


def _failure(url: str, status: int, body: Any) -> APIError:
    if 400 <= status < 500:
        return from_worker_body(status, body, f"worker {url} refused the adapter")
    what = f"HTTP {status}" if status else str(body)
    return APIError(502, f"worker {url} failed: {what}", code="worker_failed")


async def load(client: aiohttp.ClientSession, urls: Sequence[str], name: str, path: str) -> str:
    """Load ``name`` from ``path`` on every worker; its hash, or APIError (loads undone)."""
    if not urls:
        raise APIError(503, "no worker is ready to load the adapter", code="no_worker")
    body = {"lora_name": name, "lora_path": path}
    got = await asyncio.gather(*(_post(client, u, "/v1/load_lora_adapter", body) for u in urls))
    hashes = {
        u: b.get("hash")
        for u, (s, b) in zip(urls, got, strict=True)
        if s == 200 and isinstance(b, dict)
    }
    bad = [(u, s, b) for u, (s, b) in zip(urls, got, strict=True) if u not in hashes]
    err: APIError | None = _failure(*bad[0]) if bad else None
    if err is None and (
        len(set(hashes.values())) != 1 or not valid_lora_hash(next(iter(hashes.values())))
    ):
        err = APIError(
            400,
            f"the workers read different files at lora_path {path!r} (one "
            "path must hold one adapter on every worker)",
            "lora_path",
        )
    if err is not None:
        await unload(client, list(hashes), name, quiet=True)
        raise err
    return str(next(iter(hashes.values())))


async def unload(
    client: aiohttp.ClientSession, urls: Sequence[str], name: str, quiet: bool = False
) -> int:
    """Unload ``name`` on every worker; how many had it. A worker's 404 (it did not have
    it) is not a failure; another refusal or failure raises unless ``quiet``."""
    body = {"lora_name": name}
    got = await asyncio.gather(*(_post(client, u, "/v1/unload_lora_adapter", body) for u in urls))
    for url, (status, reply) in zip(urls, got, strict=True):
        if status not in (200, 404) and not quiet:
            raise _failure(url, status, reply)
    return sum(1 for status, _ in got if status == 200)
