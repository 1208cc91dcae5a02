"""Calls from the router to the workers' internal HTTP API (docs/architecture.md).

The hop runs on aiohttp, on connections kept alive: together with reading every
stream to its end (so connections go back to the pool) this took about 4 ms off
the router's per-request overhead here (``bench/routing.py`` measures it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.engine.request import REQUEST_FAILED
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
    logprobs: list[Any] | None = None  # the first token's, when asked for


# Connection failures, timeouts and broken bodies: the worker did not answer usefully.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def new_session() -> aiohttp.ClientSession:
    """The router's one connection pool to its workers (unbounded, kept alive)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, raise_for_status=False)


def _timeout(seconds: float) -> aiohttp.ClientTimeout:
    """Connect within ``seconds`` (10 s at most) and never wait ``seconds`` for the next
    bytes; no limit on the whole exchange, so a long generation is not cut off."""
    return aiohttp.ClientTimeout(total=None, sock_connect=min(seconds, 10.0), sock_read=seconds)


def _decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _raise_for(url: str, status: int, body: Any) -> None:
    if status >= 500 or status == 429:
        raise WorkerFailed(url, f"HTTP {status}")
    if status >= 400:  # the request itself is wrong: the client hears why
        raise from_worker_body(status, body, f"worker refused the request ({url})")


async def get_json(session: aiohttp.ClientSession, url: str, timeout: float) -> tuple[int, Any]:
    """(status, decoded body or None) of a GET; transport errors propagate."""
    async with session.get(url, timeout=_timeout(timeout)) as resp:
        return resp.status, _decode_json(await resp.read())


async def prefill(
    client: aiohttp.ClientSession,
    url: str,
    request_id: str,
    ids: list[int],
    sampling: SamplingParams,
    timeout: float,
    cache_salt: str | None = None,
) -> PrefillResult:
    payload: dict[str, Any] = {
        "request_id": request_id,
        "prompt_token_ids": ids,
        "sampling": sampling.to_dict(),
    }
    if cache_salt is not None:
        payload["cache_salt"] = cache_salt
    try:
        async with client.post(url + "/prefill", json=payload, timeout=_timeout(timeout)) as resp:
            status, raw = resp.status, await resp.read()
    except TRANSPORT_ERRORS as exc:
        raise WorkerFailed(url, f"prefill failed: {exc!r}") from exc
    body = _decode_json(raw)
    if status == 200 and not isinstance(body, dict):
        raise WorkerFailed(url, f"bad prefill reply: {raw[:80]!r}")
    _raise_for(url, status, body)
    try:
        return PrefillResult(
            first_token_id=int(body["first_token_id"]),
            text=str(body.get("text") or ""),
            finish_reason=body.get("finish_reason"),
            kv_handle=body.get("kv_handle"),
            num_cached_tokens=int(body.get("num_cached_tokens") or 0),
            prompt_tokens=int(body.get("prompt_tokens") or len(ids)),
            logprobs=_list_or_none(body.get("logprobs")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise WorkerFailed(url, f"bad prefill reply: {exc!r}") from exc


def _list_or_none(value: Any) -> list[Any] | None:
    if value is None or isinstance(value, list):
        return value
    raise TypeError(f"logprobs must be a list, got {type(value).__name__}")


MAX_LINE_BYTES = 1 << 20  # one NDJSON line from a worker; more is a broken stream


async def generate(
    client: aiohttp.ClientSession, url: str, payload: dict[str, Any], timeout: float
) -> AsyncIterator[dict[str, Any]]:
    """Messages of the decode worker's NDJSON stream. Raises :class:`WorkerFailed` when the
    stream cannot start or breaks; an ``{"error": ...}`` line is yielded as is.

    Lines that arrived together are merged into one message (see :func:`merge_lines`),
    so a router that falls behind its workers catches up instead of paying per token.
    """
    try:
        async with client.post(url + "/generate", json=payload, timeout=_timeout(timeout)) as resp:
            if resp.status != 200:
                _raise_for(url, resp.status, _decode_json(await resp.read()))
                raise WorkerFailed(url, f"HTTP {resp.status}")
            rest = b""
            async for data in resp.content.iter_any():
                *lines, rest = (rest + data).split(b"\n")
                if len(rest) > MAX_LINE_BYTES:
                    raise WorkerFailed(url, f"stream line over {MAX_LINE_BYTES} bytes")
                for msg in merge_lines([_message(url, line) for line in lines if line.strip()]):
                    yield msg
            if rest.strip():
                yield _message(url, rest)
    except TRANSPORT_ERRORS as exc:
        raise WorkerFailed(url, f"generate failed: {exc!r}") from exc


def stream_error(url: str, error: Any) -> Exception:
    """An ``{"error": ...}`` line of a decode stream: a request fault (code
    ``request_failed``) goes to the client as is and is never retried elsewhere; any
    other error is the worker's (``WorkerFailed``: the dispatcher may try another)."""
    if isinstance(error, dict) and error.get("code") == REQUEST_FAILED:
        return from_worker_body(422, {"error": error}, "the request failed on the worker")
    return WorkerFailed(url, f"worker error: {error}", down=False)


def _message(url: str, line: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(line)
    except ValueError as exc:
        raise WorkerFailed(url, f"bad stream line {line[:80]!r}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("token_ids", []), list):
        raise WorkerFailed(url, f"bad stream line {line[:80]!r}")
    return msg


def merge_lines(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive token messages as one: ids and text joined, the last one's other fields.

    A message that finishes the stream, or carries an error, ends a run.
    """
    out: list[dict[str, Any]] = []
    for msg in msgs:
        prev = out[-1] if out else None
        if prev is None or "error" in prev or "error" in msg or prev.get("finish_reason"):
            out.append(msg)
            continue
        out[-1] = {
            **msg,
            "token_ids": (prev.get("token_ids") or []) + (msg.get("token_ids") or []),
            "text": str(prev.get("text") or "") + str(msg.get("text") or ""),
        }
        if "logprobs" in prev or "logprobs" in msg:
            out[-1]["logprobs"] = (prev.get("logprobs") or []) + (msg.get("logprobs") or [])
    return out


async def abort(client: aiohttp.ClientSession, url: str, request_id: str) -> bool:
    try:
        body = {"request_id": request_id}
        async with client.post(url + "/abort", json=body, timeout=_timeout(5.0)) as resp:
            return bool(_decode_json(await resp.read()).get("aborted"))
    except (*TRANSPORT_ERRORS, AttributeError) as exc:
        log.warning("abort of %s on %s failed: %s", request_id, url, exc)
        return False


def api_error_of(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    return APIError(502, f"worker error: {exc}")
