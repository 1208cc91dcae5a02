"""The router's live state: everything the HTTP handlers share.

Built at app start-up (it needs the event loop), closed at shutdown.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from pdserve.router import worker_client
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import Discovery, EndpointSource
from pdserve.router.dispatch import Dispatcher, RequestState
from pdserve.router.errors import APIError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefix_index import KVEventSubscriber, PrefixIndex
from pdserve.router.ratelimit import RateLimiter
from pdserve.router.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")


class Ticket:
    """One admitted request's place in the queue; releasing twice is harmless."""

    def __init__(self, rt: Runtime) -> None:
        self._rt: Runtime | None = rt

    def release(self) -> None:
        if self._rt is not None:
            self._rt._release()
            self._rt = None


class Runtime:
    def __init__(
        self, cfg: RouterConfig, source: EndpointSource, tokenizer: PromptTokenizer
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics()
        self.client = worker_client.new_session()
        self.index = PrefixIndex(cfg.prefix_index_capacity)
        self.subscriber = KVEventSubscriber(self.index)
        self.discovery = Discovery(source, self.client, cfg.health_interval_s, self.subscriber)
        self.dispatcher = Dispatcher(cfg, self.discovery, self.index, self.client, self.metrics)
        self.active = 0
        self.created = int(time.time())
        self.limiter = RateLimiter(cfg.rate_limit_rpm, cfg.rate_limit_tpm)
        # Parsing, chat templates and tokenizing: CPU work kept off the event loop.
        self.pool = ThreadPoolExecutor(cfg.tokenizer_threads, thread_name_prefix="pdserve-tok")

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.cfg.model_name, self.cfg.model_dir)

    async def start(self) -> None:
        await self.discovery.refresh()
        self.discovery.start()

    async def close(self) -> None:
        await self.discovery.stop()
        await self.dispatcher.drain()
        await self.client.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a tokenizer thread; its exceptions are raised here."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- admission ---------------------------------------------------------------------
    def check_auth(self, request: Request) -> str:
        """The caller's API key ("" when no keys are configured); 401 without a valid one."""
        if not self.cfg.api_keys:
            return ""
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")  # fmt: skip
        if not any(hmac.compare_digest(token.encode(), k.encode()) for k in self.cfg.api_keys):
            raise APIError(401, "incorrect API key", code="invalid_api_key")
        return token

    @staticmethod
    def client_of(request: Request, key: str) -> str:
        """Who rate limits count against: the API key, else the peer's address."""
        if key:
            return "key:" + key
        return "addr:" + (request.client.host if request.client else "")

    def cache_salt(self, key: str, requested: str | None) -> str | None:
        """The prefix-cache salt sent with the request: the API key's own (a digest,
        never the key) unless ``--cache-isolation none``, and the client's cache_salt."""
        parts = []
        if key and self.cfg.cache_isolation == "api-key":
            parts.append("k:" + hashlib.sha256(key.encode()).hexdigest()[:32])
        if requested:
            parts.append("r:" + requested)
        return "|".join(parts) or None

    def gate(self, request: Request) -> tuple[str, str, Ticket]:
        """What a request passes before its body is read: the API key, the client's
        requests-per-minute bucket, ``--max-queue`` admission. Returns (key, client,
        ticket); the caller releases the ticket."""
        key = self.check_auth(request)
        client = self.client_of(request, key)
        self.limiter.take_request(client)
        return key, client, self.admit()

    def admit(self) -> Ticket:
        if self.active >= self.cfg.max_queue:
            raise APIError(
                429,
                f"the router's queue is full ({self.cfg.max_queue} requests); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self.active += 1
        self.metrics.queue_depth.set(self.active)
        return Ticket(self)

    def _release(self) -> None:
        assert self.active > 0
        self.active -= 1
        self.metrics.queue_depth.set(self.active)

    # -- accounting --------------------------------------------------------------------
    def error(self, err: APIError) -> JSONResponse:
        self.metrics.requests.labels(str(err.status)).inc()
        if err.status >= 500:
            log.warning("request failed (%d): %s", err.status, err.message)
        return err.response()

    def internal_error(self, path: str, exc: Exception) -> JSONResponse:
        """An unexpected exception while serving ``path``: logged, answered with a 500."""
        log.error("internal error on %s", path, exc_info=exc)
        return self.error(APIError(500, f"internal error: {type(exc).__name__}"))

    def finish(self, rs: RequestState, code: int) -> None:
        if rs.recorded:
            return
        rs.recorded = True
        m = self.metrics
        m.requests.labels(str(code)).inc()
        m.e2e.observe(time.perf_counter() - rs.start)
        m.prompt_tokens.inc(len(rs.prompt_ids))
        m.generation_tokens.inc(rs.completion_tokens)
        if rs.first_token_at is not None and rs.last_token_at and rs.completion_tokens > 1:
            tpot = (rs.last_token_at - rs.first_token_at) / (rs.completion_tokens - 1)
            m.tpot.observe(tpot)
