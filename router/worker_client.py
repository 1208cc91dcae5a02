"""Calls from the router to the workers' internal HTTP API (docs/architecture.md)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.errors import APIError, from_worker_body

log = logging.getLogger(__name__)


class WorkerFailed(Exception):
    """A worker did not answer usefully (connection, timeout, 5xx, bad body): try another."""

    def __init__(self, url: str, reason: str, down: bool = True) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.down = down  # the worker itself looks broken (not just this request)


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    text: str
    finish_reason: str | None
    kv_handle: dict[str, Any] | None
    num_cached_tokens: int
    prompt_tokens: int


def _raise_for(url: str, resp: httpx.Response, body: Any) -> None:
    if resp.status_code >= 500 or resp.status_code == 429:
        raise WorkerFailed(url, f"HTTP {resp.status_code}")
    if resp.status_code >= 400:  # the request itself is wrong: the client hears why
        raise from_worker_body(resp.status_code, body, f"worker refused the request ({url})")


async def prefill(
    client: httpx.AsyncClient,
    url: str,
    request_id: str,
    ids: list[int],
    sampling: SamplingParams,
    timeout: float,
) -> PrefillResult:
    payload = {"request_id": request_id, "prompt_token_ids": ids, "sampling": sampling.to_dict()}
    try:
        resp = await client.post(url + "/prefill", json=payload, timeout=timeout)
        body = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise WorkerFailed(url, f"prefill failed: {exc!r}") from exc
    _raise_for(url, resp, body)
    try:
        return PrefillResult(
            first_token_id=int(body["first_token_id"]),
            text=str(body.get("text") or ""),
            finish_reason=body.get("finish_reason"),
            kv_handle=body.get("kv_handle"),
            num_cached_tokens=int(body.get("num_cached_tokens") or 0),
            prompt_tokens=int(body.get("prompt_tokens") or len(ids)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise WorkerFailed(url, f"bad prefill reply: {exc!r}") from exc


async def generate(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], timeout: float
) -> AsyncIterator[dict[str, Any]]:
    """Lines of the decode worker's NDJSON stream. Raises :class:`WorkerFailed` when the
    stream cannot start or breaks; an ``{"error": ...}`` line is yielded as is."""
    try:
        async with client.stream("POST", url + "/generate", json=payload, timeout=timeout) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                _raise_for(url, resp, body)
                raise WorkerFailed(url, f"HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                try:
                    msg = json.loads(line)
                except ValueError as exc:
                    raise WorkerFailed(url, f"bad stream line {line[:80]!r}") from exc
                if not isinstance(msg, dict):
                    raise WorkerFailed(url, f"bad stream line {line[:80]!r}")
                yield msg
    except httpx.HTTPError as exc:
        raise WorkerFailed(url, f"generate failed: {exc!r}") from exc


async def abort(client: httpx.AsyncClient, url: str, request_id: str) -> bool:
    try:
        resp = await client.post(url + "/abort", json={"request_id": request_id}, timeout=5.0)
        return bool(resp.json().get("aborted"))
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        log.warning("abort of %s on %s failed: %s", request_id, url, exc)
        return False


def api_error_of(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    return APIError(502, f"worker error: {exc}")
