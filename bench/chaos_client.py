"""Client side of bench/chaos.py: one request, streamed or not, checked, maybe cancelled.

A request is *ok* when it returns 200 and, streamed, ends with ``[DONE]`` and no
error event; when ``expect_tokens`` is set, the usage must count exactly that
many completion tokens (so a stream cut short, or one that repeats tokens after
a migration, is not ok). A cancelled request is not judged, except that a 5xx
before the cancel still counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Result:
    status: int = 0  # HTTP status; 0: no answer (connection failed)
    done: bool = False
    error: str = ""
    tokens: int = -1  # usage.completion_tokens, -1 when not reported
    cancelled: bool = False
    retry_after: str = ""

    def ok(self, expect_tokens: int | None = None) -> bool:
        if self.status != 200 or self.error or not self.done:
            return False
        return expect_tokens is None or self.tokens == expect_tokens

    @property
    def server_error(self) -> bool:
        return self.status >= 500 or (self.status == 0 and not self.cancelled)


async def stream(
    h: httpx.AsyncClient, path: str, body: dict[str, Any], cancel_after: int | None = None
) -> Result:
    """A streamed request; closes the connection after ``cancel_after`` data chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    res, chunks = Result(), 0
    try:
        async with h.stream("POST", path, json=body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                res.error = resp.text[:200]
                return res
            async for line in resp.aiter_lines():
                if cancel_after is not None and chunks >= cancel_after:
                    res.cancelled = True
                    return res  # leaving the block closes the connection: a disconnect
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    res.done = True
                    continue
                chunks += 1
                _read_chunk(res, json.loads(line[6:]))
    except httpx.HTTPError as exc:
        res.error = res.error or f"{type(exc).__name__}: {exc}"
    return res


def _read_chunk(res: Result, chunk: dict[str, Any]) -> None:
    if "error" in chunk:
        res.error = json.dumps(chunk["error"])[:200]
    if chunk.get("usage"):
        res.tokens = int(chunk["usage"]["completion_tokens"])


async def post(
    h: httpx.AsyncClient, path: str, body: dict[str, Any], cancel_after_s: float | None = None
) -> Result:
    """A non-streamed request; cancelled (connection closed) after ``cancel_after_s``."""
    res = Result()
    task = asyncio.ensure_future(h.post(path, json=body))
    try:
        resp = await asyncio.wait_for(asyncio.shield(task), cancel_after_s)
    except TimeoutError:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        res.cancelled = True
        return res
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.status, res.retry_after = resp.status_code, resp.headers.get("retry-after", "")
    try:
        data = resp.json()
    except ValueError:
        res.error = "not JSON: " + resp.text[:100]
        return res
    if resp.status_code == 200:
        res.done = bool(data.get("choices"))
        res.tokens = int(data.get("usage", {}).get("completion_tokens", -1))
    else:
        res.error = json.dumps(data.get("error", data))[:200]
    return res


async def raw(h: httpx.AsyncClient, path: str, content: bytes) -> Result:
    """A request with a raw body (the bad-input battery)."""
    res = Result()
    try:
        resp = await h.post(path, content=content, headers={"Content-Type": "application/json"})
        res.status = resp.status_code
        res.error = resp.text[:200] if resp.status_code != 200 else ""
        res.done = True
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res
