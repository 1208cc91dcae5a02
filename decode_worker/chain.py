"""Decode-side prefill: the decode worker calls the prefill worker itself.

With the router's ``--pd-handoff decode`` a remote-prefill request reaches the decode
worker alone, naming the prefill workers to use (``GenerateRequest.prefill``: the
router's prefix-aware pick first). The decode worker's front then does what the router
does in the default handoff (router/transport/dispatch.py), one hop closer to the KV:

    POST /prefill to the first candidate ──fails──▶ the next one ──all fail──▶ local prefill
        │ reply: first token (+ KV handle)
        ▼
    the first token is the stream's first line; then the KV is pulled over NIXL/tcp and
    decoding goes on as for a handle the router sent

So the router makes one worker call per request instead of two (its CPU per P/D
request drops by that call), and the prefill's reply does not cross the router. The
prefill call is signed with the service secret like the router's, on the same keep-alive
pool (pdserve/worker_calls/http1.py). A request fault (4xx) from the prefill worker is this
request's answer; a worker fault (connection, 5xx, timeout, a bad reply) moves to the next
candidate, after an abort that frees anything the failed worker held, and puts the failed
worker last for the next ``FAILED_S`` (as the router takes a worker whose call failed out of
rotation until its health check passes). A prefill worker
that hangs and fails its health checks is cut by the router's stall watch, whose abort
ends this worker's wait (``DecodeWorker.abort_chain``); one that hangs while healthy costs
up to ``timeout_s`` (the decode worker's ``--prefill-timeout``). The router aborts the
request on every candidate when it ends early, so a lease is never left to its TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pdserve.protocol.contract import GenerateRequest, PrefillReply, PrefillRequest
from pdserve.worker.args import DEFAULT_PREFILL_TIMEOUT_S as DEFAULT_PREFILL_TIMEOUT_S
from pdserve.worker.http import BadRequest
from pdserve.worker_calls import worker_client
from pdserve.worker_calls.errors import APIError
from pdserve.worker_calls.http1 import WorkerPool
from pdserve.worker_calls.worker_client import WorkerFailed

log = logging.getLogger(__name__)

FAILED_S = 5.0  # a prefill worker whose call failed is tried last for this long


class PrefillChain:
    """The prefill calls of one decode worker's front (its pool, created on first use)."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S,
        pool: WorkerPool | None = None,
        count: Callable[[str], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._pool = pool
        self.count = count or (lambda outcome: None)  # "ok", "failed", "local": metrics
        self._background: set[asyncio.Task[Any]] = set()
        self._failed: dict[str, float] = {}  # url -> until when it is tried last
        self.local = 0  # requests prefilled here after every candidate failed

    @property
    def pool(self) -> WorkerPool:
        if self._pool is None:
            self._pool = worker_client.new_pool()
        return self._pool

    async def prefill(self, req: GenerateRequest) -> PrefillReply | None:
        """The first candidate's reply that came; None when every candidate failed (the
        caller prefills locally). A request fault raises :class:`BadRequest` with the
        prefill worker's status, message, param and code."""
        assert req.prefill
        preq = PrefillRequest(
            req.request_id, req.prompt_token_ids, req.sampling, req.cache_salt, req.lora
        )
        for url in self._order(req.prefill):
            try:
                reply = await worker_client.prefill(self.pool, url, preq, self.timeout_s)
            except WorkerFailed as exc:
                self.count("failed")
                self._failed[url] = time.monotonic() + FAILED_S
                log.warning("request %s: prefill failed on %s: %s", req.request_id, url, exc)
                self._spawn(worker_client.abort(self.pool, url, req.request_id))
            except APIError as exc:
                raise BadRequest(exc.message, exc.param, exc.status, exc.code) from exc
            else:
                self.count("ok")
                return reply
        self.local += 1
        self.count("local")
        log.warning("request %s: every prefill worker failed; prefilling here", req.request_id)
        return None

    def _order(self, urls: list[str]) -> list[str]:
        """The candidates, those that failed a call in the last ``FAILED_S`` last (still
        tried when every other one fails): a worker that answers its health check but fails
        its calls costs one request a failed call, not every request until the router's
        health checks see it."""
        if not self._failed:
            return urls
        now = time.monotonic()
        for url in [u for u, until in self._failed.items() if until <= now]:
            del self._failed[url]
        return sorted(urls, key=lambda u: u in self._failed)  # stable: the router's order

    @staticmethod
    def after(req: GenerateRequest, reply: PrefillReply) -> GenerateRequest:
        """The request this worker decodes once ``reply`` came: its handle and first token;
        prompt logprobs not asked again once the prefill worker sent them."""
        sampling = req.sampling
        if reply.prompt_logprobs is not None and sampling.prompt_logprobs is not None:
            sampling = replace(sampling, prompt_logprobs=None)
        return replace(
            req,
            prefill=None,
            sampling=sampling,
            kv_handle=reply.kv_handle,
            first_token_id=reply.first_token_id,
        )

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
