"""Calls from the router to the workers' internal HTTP API: the typed messages of
:mod:`pdserve.protocol.contract`, sent with the service secret.

The per-request calls (prefill, generate, abort) run on :mod:`.http1`'s keep-alive
pool; health checks, KV snapshots and LoRA calls on aiohttp's (``new_session``). Reading
every stream to its end (so connections go back to the pool) took about 4 ms off the
router's per-request overhead here (``bench/routing.py`` measures it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import aiohttp

from pdserve import env, keys, signing
from pdserve.protocol.codec import CodecError, decode, encode, from_dict
from pdserve.protocol.contract import (
    AbortReply,
    GenerateRequest,
    PrefillReply,
    PrefillRequest,
    RequestRef,
    TokenDelta,
    WorkerError,
)
from pdserve.protocol.outputs import REQUEST_FAILED
from pdserve.protocol.prefill_reply import decode_prefill_reply
from pdserve.protocol.token_lines import decode_line
from pdserve.worker_calls.errors import APIError, from_worker_body
from pdserve.worker_calls.http1 import CallFailed, WorkerPool

T = TypeVar("T")
JSON = {"content-type": "application/json"}

log = logging.getLogger(__name__)


class WorkerFailed(Exception):
    """A worker did not answer usefully (connection, timeout, 5xx, bad body): try another."""

    def __init__(self, url: str, reason: str, down: bool = True) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.down = down  # the worker itself looks broken (not just this request)


# Connection failures, timeouts and broken bodies: the worker did not answer usefully.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, CallFailed)


# How long an idle connection to a worker stays in the pool. Shorter than the workers' own
# idle timeout (worker/http.py: KEEP_ALIVE_S) on purpose: a connection the worker closes
# while the router reuses it fails the request ("Can not write request body", a reset),
# and that race is only excluded when the client side always gives up first.
POOL_KEEPALIVE_S = 60.0


def new_session(secret: str | tuple[str, ...] | None = None) -> aiohttp.ClientSession:
    """The router's one connection pool to its workers (unbounded, kept alive); every call
    is signed with a key derived from the service secret (``PDSERVE_SERVICE_SECRET`` unless
    given; pdserve/signing.py), and a reply counts only from a worker that proves it."""
    if secret is None:
        env.service_secret("the router")  # the warning, once, when there is none
        ring = keys.KeyRing.from_env(keys.HTTP)
    else:
        ring = keys.KeyRing(keys.HTTP, secret)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=POOL_KEEPALIVE_S)
    middlewares = (signed_calls(ring),) if ring else ()
    return aiohttp.ClientSession(
        connector=connector, raise_for_status=False, middlewares=middlewares
    )


def new_pool(secret: str | tuple[str, ...] | None = None) -> WorkerPool:
    """The router's pool for its per-request calls, signed as ``new_session``'s."""
    if secret is None:
        return WorkerPool(keys.KeyRing.from_env(keys.HTTP), POOL_KEEPALIVE_S)
    return WorkerPool(keys.KeyRing(keys.HTTP, secret), POOL_KEEPALIVE_S)


class UnprovenWorker(aiohttp.ClientResponseError):
    """A reply without the proof of the service secret: not one of our workers."""


def signed_calls(ring: keys.KeyRing) -> Any:
    """aiohttp middleware: sign each call; refuse a reply that does not prove the secret
    (a transport error to the callers: the worker counts as failed)."""

    async def sign(req: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
        body = req.body if isinstance(req.body, bytes) else await req.body.as_bytes()
        host = req.headers.get("Host", "")
        auth = signing.sign(ring, req.method, req.url.raw_path_qs, body, host=host)
        req.headers[signing.HEADER] = auth
        resp: aiohttp.ClientResponse = await handler(req)
        if not signing.proof_ok(ring, auth, resp.headers.get(signing.PROOF_HEADER)):
            resp.release()
            raise UnprovenWorker(
                req.request_info,
                (),
                status=resp.status,
                message="the worker did not prove the service secret",
            )
        return resp

    return sign


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


async def get_message(
    session: aiohttp.ClientSession, url: str, cls: type[T], timeout: float
) -> tuple[int, T | None]:
    """(status, the typed body, or None when not 200 or not a ``cls``)."""
    status, body = await get_json(session, url, timeout)
    try:
        return status, from_dict(body, cls) if status == 200 else None
    except CodecError as exc:
        log.warning("bad reply from %s: %s", url, exc)
        return status, None


MAX_LINE_BYTES = 1 << 20  # one NDJSON line from a worker; more is a broken stream


class StreamWatch:
    """One call to a worker (a prefill, a decode stream) as its dispatcher sees it: how
    long it has waited, and a way to give up on it. ``cut`` ends the wait for the worker's
    reply or next bytes at once (the call raises :class:`WorkerFailed`); while the
    request's task is elsewhere (handing tokens to a slow client) there is nothing to cut,
    and ``cut`` does nothing."""

    __slots__ = ("_since", "_task", "_waiting", "down", "reason", "role", "url", "via")

    def __init__(self, url: str, role: str = "decode") -> None:
        self.url, self.role = url, role
        # a chained decode call (--pd-handoff decode) before its first bytes: the prefill
        # worker the decode worker is waiting on, whose failed health check cuts it too
        self.via: str | None = None
        self.down = True  # the cut blames the worker called (False: the one it waits on)
        self.reason: str | None = None
        self._waiting: asyncio.Task[Any] | None = None  # the task that waits for the worker
        self._since = 0.0  # when that wait began
        self._task: asyncio.Task[Any] | None = None  # the call's task, looked up once

    def begin(self) -> None:
        """The current task now waits for the worker. A call runs in one task (its
        request's): looked up at its first wait, not at each chunk's (~2% of the router's
        CPU on the P/D path went to ``asyncio.current_task``, a Python function in 3.11)."""
        task = self._task
        if task is None:
            task = self._task = asyncio.current_task()
        self._waiting, self._since = task, time.monotonic()

    def end(self) -> None:
        self._waiting = None

    def quiet_s(self, now: float) -> float:
        """How long the stream has waited for its worker (0 while it is not waiting)."""
        return now - self._since if self._waiting is not None else 0.0

    def cut(self, reason: str) -> bool:
        if self._waiting is None or self.reason is not None:
            return False
        self.reason = reason
        self._waiting.cancel()
        return True


async def _watched(watch: StreamWatch | None, aw: Any) -> Any:
    if watch is None:
        return await aw
    watch.begin()
    try:
        return await aw
    finally:
        watch.end()


def _cut_or_cancelled(url: str, watch: StreamWatch | None) -> WorkerFailed:
    """The WorkerFailed for a cut stream; re-raises a cancellation that was not the cut."""
    if watch is None or watch.reason is None:
        raise asyncio.CancelledError
    task = asyncio.current_task()
    uncancel = getattr(task, "uncancel", None)  # Python 3.11+: count the cut's cancel off
    if uncancel is not None and uncancel() > 0:  # the client went away as well
        raise asyncio.CancelledError
    return WorkerFailed(url, f"stream cut: {watch.reason}", down=watch.down)


async def prefill(
    client: WorkerPool,
    url: str,
    req: PrefillRequest,
    timeout: float,
    watch: StreamWatch | None = None,
) -> PrefillReply:
    """The prefill worker's reply; raises :class:`WorkerFailed` when there is none (or
    ``watch`` cuts the wait)."""

    if watch is not None:
        watch.begin()
    try:  # inline, no coroutine around the call: it is one per request on the P/D path
        async with await client.post(url, "/prefill", encode(req), timeout) as resp:
            status, raw = resp.status, await resp.read()
    except TRANSPORT_ERRORS as exc:
        raise WorkerFailed(url, f"prefill failed: {exc!r}") from exc
    except asyncio.CancelledError:
        raise _cut_or_cancelled(url, watch) from None
    finally:
        if watch is not None:
            watch.end()
    if status != 200:
        _raise_for(url, status, _decode_json(raw))
    try:
        return decode_prefill_reply(raw)  # codec.decode(raw, PrefillReply), faster
    except CodecError as exc:
        raise WorkerFailed(url, f"bad prefill reply: {exc}") from exc


async def generate(
    client: WorkerPool,
    url: str,
    req: GenerateRequest,
    timeout: float,
    watch: StreamWatch | None = None,
) -> AsyncIterator[TokenDelta]:
    """Messages of the decode worker's NDJSON stream. Raises :class:`WorkerFailed` when the
    stream cannot start or breaks, or ``watch`` cuts it; a delta with an ``error`` is
    yielded as is.

    Lines that arrived together are merged into one message (see :func:`merge_lines`),
    so a router that falls behind its workers catches up instead of paying per token.
    """
    try:
        async with await _watched(
            watch, client.post(url, "/generate", encode(req), timeout)
        ) as resp:
            if resp.status != 200:
                _raise_for(url, resp.status, _decode_json(await resp.read()))
                raise WorkerFailed(url, f"HTTP {resp.status}")
            rest, read = b"", resp.readany
            while True:  # per chunk: the watch's two calls inline, no coroutine around read
                if watch is not None:
                    watch.begin()
                data = await read()
                if watch is not None:
                    watch.end()
                if not data:
                    break
                *lines, rest = (rest + data).split(b"\n") if rest else data.split(b"\n")
                if len(rest) > MAX_LINE_BYTES:
                    raise WorkerFailed(url, f"stream line over {MAX_LINE_BYTES} bytes")
                if lines:
                    for msg in merge_lines([_message(url, line) for line in lines if line.strip()]):
                        yield msg
            if rest.strip():
                yield _message(url, rest)
    except TRANSPORT_ERRORS as exc:
        raise WorkerFailed(url, f"generate failed: {exc!r}") from exc
    except asyncio.CancelledError:
        raise _cut_or_cancelled(url, watch) from None


def stream_error(url: str, error: WorkerError) -> Exception:
    """The error of a decode stream's line: a request fault (code ``request_failed``) goes
    to the client as is and is never retried elsewhere; any other error is the worker's
    (``WorkerFailed``: the dispatcher may try another)."""
    if error.code == REQUEST_FAILED:
        body = {
            "error": {
                "message": error.message,
                "type": error.type,
                "param": error.param,
                "code": error.code,
            }
        }
        return from_worker_body(422, body, "the request failed on the worker")
    return WorkerFailed(url, f"worker error: {error.message}", down=False)


def _message(url: str, line: bytes) -> TokenDelta:
    try:
        return decode_line(line)  # what codec.decode does, faster (pdserve/protocol/token_lines.py)
    except CodecError as exc:
        raise WorkerFailed(url, f"bad stream line {line[:80]!r}: {exc}") from exc


def merge_lines(msgs: list[TokenDelta]) -> list[TokenDelta]:
    """Consecutive token messages as one: ids and text joined, the last one's other fields.

    A message that finishes the stream, or carries an error, ends a run. (The result of
    folding :meth:`TokenDelta.then` over each run, built once per run.)
    """
    if len(msgs) < 2:
        return msgs
    out: list[TokenDelta] = []
    run: list[TokenDelta] = []
    for msg in msgs:
        if run and (run[-1].ends_run or msg.error is not None):
            out.append(_joined(run))
            run = []
        run.append(msg)
    out.append(_joined(run))
    return out


def _joined(run: list[TokenDelta]) -> TokenDelta:
    if len(run) == 1:
        return run[0]
    last = run[-1]
    lps = None
    if any(m.logprobs is not None for m in run):
        lps = [lp for m in run for lp in (m.logprobs or ())]
    ids = [t for m in run for t in m.token_ids]
    text = "".join(m.text for m in run)
    prompt = next((m.prompt_logprobs for m in run if m.prompt_logprobs is not None), None)
    return TokenDelta(ids, text, last.finish_reason, last.usage, last.error, lps, prompt)


async def abort(client: WorkerPool, url: str, request_id: str) -> bool:
    body = encode(RequestRef(request_id))
    try:
        async with await client.post(url, "/abort", body, 5.0) as resp:
            return decode(await resp.read(), AbortReply).aborted
    except (*TRANSPORT_ERRORS, CodecError) as exc:
        log.warning("abort of %s on %s failed: %s", request_id, url, exc)
        return False


def api_error_of(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    return APIError(502, f"worker error: {exc}")
