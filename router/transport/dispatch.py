"""One request's trip through the workers: the plan (router/scheduling/scheduler.py makes it)
run as remote prefill, decode, relay.

    plan ──remote──▶ POST /prefill (retry on the next prefill worker; with
      │                   --pd-handoff decode the decode worker makes this call itself:
      │                   GenerateRequest.prefill names the candidates, decode_worker/chain.py)
      │                   │ first token → client at once
      │                   ▼
      └──local──────▶ POST /generate (retry on the next decode worker while
                          no decode token has reached the client; a KV handle is
                          single-use, so a retry first prefills again for a new one;
                          after a token was sent, migrate: prompt + tokens sent go
                          to the next one)

If every prefill worker fails, the request falls back to local prefill. A
decode worker that dies mid-stream (connection reset, EOF before the final
line, timeout) costs the client nothing: the stream moves to the next decode
worker with ``resume_token_ids`` = every token already sent, which that worker
recomputes and continues from (docs/router.md, "Stream migration"); so does one
that hangs, and a hung prefill worker's request moves on too (``cut_stalled``). When no
other decode worker is left, the request waits up to ``failover_wait_s`` for one to
come back (a restart) and moves there (``_await_decode``). A request
fault (4xx, or an error line with code ``request_failed``) is never migrated. A
request that ends early (client gone, error) is aborted on the workers it
touched so their KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from pdserve.protocol.contract import (
    GenerateRequest,
    KVHandle,
    LoraRef,
    PrefillReply,
    PrefillRequest,
    TokenDelta,
)
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.discovery.workers import Discovery
from pdserve.router.errors import APIError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.scheduling import disagg
from pdserve.router.scheduling.routing import RoutePlan
from pdserve.router.scheduling.snapshot import WorkerView
from pdserve.worker_calls import worker_client
from pdserve.worker_calls.http1 import WorkerPool
from pdserve.worker_calls.worker_client import WorkerFailed

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
MAX_FAILOVER_WAITS = 2  # times a request waits for a decode worker to come back
FAILOVER_POLL_S = 0.1


class Delta(NamedTuple):
    """What the client is sent next (one per token, or per run of tokens that arrived
    together): a named tuple, built per token for a fraction of a frozen dataclass's cost."""

    text: str
    num_tokens: int
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Any, ...] | None = None  # per token: (logprob, [(id, logprob)])


@dataclass
class RequestState:
    """Mutable bookkeeping of one request, owned by the dispatcher while it runs."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    start: float = field(default_factory=time.perf_counter)
    completion_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)  # every token sent to the client
    migrations: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    touched: set[str] = field(default_factory=set)  # worker URLs that may hold state
    remote_prefill: bool = False  # a prefill worker computed the prompt
    # --pd-handoff decode: the decode worker called the prefill worker, so its first token
    # is the prefill's, streamed before the KV was pulled (router/api/choices.py waits on)
    chained: bool = False
    decode_worker: Any = None  # the WorkerView whose stream reached the client, once one did
    status: int = 200  # HTTP status for metrics (499: client went away)
    recorded: bool = False
    cache_salt: str | None = None  # enters the block hashes on every worker (hashing.py)
    prompt_logprobs: list[Any] | None = None  # the first that came (router/api/echo.py)
    lora: LoraRef | None = None  # the adapter both workers run it under (None: base model)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Dispatcher:
    def __init__(
        self,
        cfg: RouterConfig,
        discovery: Discovery,
        client: WorkerPool,
        metrics: RouterMetrics,
    ) -> None:
        self.cfg = cfg
        self.discovery = discovery
        self.client = client
        self.metrics = metrics
        self._background: set[asyncio.Task[Any]] = set()
        self._watches: set[worker_client.StreamWatch] = set()  # worker calls open now
        discovery.after_refresh.append(self.cut_stalled)

    async def run(self, rs: RequestState, plan: RoutePlan) -> AsyncGenerator[Delta, None]:
        self.metrics.prefill_queue_depth.inc()  # until the first token (or the end)
        chain: list[str] | None = None
        try:
            handle, first_id = None, None
            if plan.kind == disagg.REMOTE_PREFILL and self.cfg.pd_handoff == "decode":
                # the decode worker calls these (decode_worker/chain.py); an abort at the
                # end reaches them too, so no lease waits for its TTL
                chain = [w.url for w in plan.prefill[:MAX_ATTEMPTS]]
                rs.touched.update(chain)
                rs.chained = True
                self._track(chain[0], "prefill", len(rs.prompt_ids), +1)
            elif plan.kind == disagg.REMOTE_PREFILL:
                result = await self._prefill(rs, plan)
                if result is not None:
                    rs.remote_prefill = True
                    rs.cached_tokens = result.num_cached_tokens
                    rs.prompt_logprobs = result.prompt_logprobs
                    rs.output_ids.append(result.first_token_id)
                    yield self._delta(
                        rs,
                        result.text,
                        1,
                        result.finish_reason,
                        (result.first_token_id,),
                        result.logprobs,
                    )
                    if result.finish_reason is not None or result.kv_handle is None:
                        rs.finish_reason = rs.finish_reason or "stop"
                        return
                    handle, first_id = result.kv_handle, result.first_token_id
            async for delta in self._decode(rs, plan, handle, first_id, chain):
                if chain is not None:  # the first token came: the prefill is over
                    self._track(chain[0], "prefill", len(rs.prompt_ids), -1)
                    chain = None
                yield delta
        finally:
            if chain is not None:
                self._track(chain[0], "prefill", len(rs.prompt_ids), -1)
            if rs.first_token_at is None:
                self.metrics.prefill_queue_depth.dec()
            if not rs.finished:
                self._abort_all(rs)

    def _delta(
        self,
        rs: RequestState,
        text: str,
        n: int,
        finish: str | None,
        ids: tuple[int, ...] = (),
        logprobs: list[Any] | None = None,
    ) -> Delta:
        now = time.perf_counter()
        if n > 0:
            # One inter-token latency per token after the first, whatever lines a read
            # merged into this delta: its n tokens share the gap since the last delta (the
            # first delta's others came with the first token: 0). So both lanes count
            # completion_tokens - 1 per request (the compiled lane's lane.rs ``delta``).
            if rs.first_token_at is None:
                rs.first_token_at = now
                self.metrics.ttft.observe(now - rs.start)
                self.metrics.prefill_queue_depth.dec()
                if n > 1:
                    self.metrics.itl.observe(0.0, n - 1)
            elif rs.last_token_at is not None:
                self.metrics.itl.observe((now - rs.last_token_at) / n, n)
            rs.last_token_at = now
        rs.completion_tokens += n
        rs.finish_reason = finish
        return Delta(text, n, finish, ids, tuple(logprobs) if logprobs is not None else None)

    async def _prefill(self, rs: RequestState, plan: RoutePlan) -> PrefillReply | None:
        req = PrefillRequest(rs.request_id, rs.prompt_ids, rs.sampling, rs.cache_salt, rs.lora)
        for worker in plan.prefill[:MAX_ATTEMPTS]:
            url, n = worker.url, len(rs.prompt_ids)
            rs.touched.add(url)
            self._track(url, "prefill", n, +1)
            watch = worker_client.StreamWatch(url, "prefill")
            self._watches.add(watch)
            try:
                return await worker_client.prefill(
                    self.client, url, req, self.cfg.request_timeout_s, watch
                )
            except WorkerFailed as exc:
                log.warning("request %s: prefill failed on %s: %s", rs.request_id, url, exc)
                self.metrics.child(self.metrics.worker_failures, "prefill").inc()
                self.discovery.mark_failed(url)
                self._spawn(worker_client.abort(self.client, url, rs.request_id))
            finally:
                self._watches.discard(watch)
                self._track(url, "prefill", n, -1)
        log.warning("request %s: every prefill worker failed; prefilling locally", rs.request_id)
        return None

    async def _decode(
        self,
        rs: RequestState,
        plan: RoutePlan,
        handle: KVHandle | None,
        first: int | None,
        chain: list[str] | None = None,
    ) -> AsyncIterator[Delta]:
        req = GenerateRequest(
            rs.request_id,
            rs.prompt_ids,
            _after_prompt(rs),
            handle,
            first,
            rs.cache_salt,
            lora=rs.lora,
            prefill=chain,
        )
        relayed = False  # a decode token reached the client: from now on, migrate
        candidates, waits = list(plan.decode[:MAX_ATTEMPTS]), 0
        for attempt in itertools.count():
            if not candidates:  # every candidate failed: wait for one to come (back)
                if waits == MAX_FAILOVER_WAITS:
                    break
                waits += 1
                candidates = await self._await_decode(rs)
                if not candidates:
                    break
            worker = candidates.pop(0)
            url = worker.url
            if relayed:
                req = self._migrate(rs, req, url)
            elif attempt and req.kv_handle is not None:
                req = await self._fresh_handle(rs, plan, req)
            elif attempt and req.prefill:  # the last decode worker may hold a lease there
                await asyncio.gather(
                    *(worker_client.abort(self.client, u, rs.request_id) for u in req.prefill)
                )
                alive = [u for u in req.prefill if not self.discovery.failed_check(u)]
                req = replace(req, prefill=alive or None)  # none left: prefill there
            rs.touched.add(url)
            self._track(url, "decode", 0, +1)
            # One decode worker's stream, relayed here (not in a generator of its own: one
            # async generator less per token); raises WorkerFailed when it breaks.
            watch = worker_client.StreamWatch(url)
            watch.via = req.prefill[0] if req.prefill else None
            self._watches.add(watch)
            try:
                try:
                    async for msg in worker_client.generate(
                        self.client, url, req, self.cfg.request_timeout_s, watch
                    ):
                        watch.via = None  # the prefill is over: the decode worker's stream now
                        if rs.finished:  # read on to the end: the connection goes back to the pool
                            continue
                        if msg.error is not None:  # request_failed: an APIError, never moved
                            raise worker_client.stream_error(url, msg.error)
                        delta = self._relay(rs, msg)
                        relayed = relayed or delta.num_tokens > 0 or bool(delta.text)
                        rs.decode_worker = rs.decode_worker or worker
                        yield delta
                except WorkerFailed:
                    if not rs.finished:  # after the final line a break costs nothing
                        raise
                if not rs.finished:
                    raise WorkerFailed(url, "stream ended without a finish_reason")
                return
            except WorkerFailed as exc:
                log.warning("request %s: decode failed on %s: %s", rs.request_id, url, exc)
                self.metrics.child(self.metrics.worker_failures, "decode").inc()
                if exc.down:
                    self.discovery.mark_failed(url)
                self._spawn(worker_client.abort(self.client, url, rs.request_id))
            finally:
                self._watches.discard(watch)
                self._track(url, "decode", 0, -1)
        if relayed:
            raise APIError(502, "decode worker failed mid-stream and no other could take over")
        raise APIError(503, "no decode worker could serve the request", code="no_worker")

    async def _await_decode(self, rs: RequestState) -> list[WorkerView]:
        """Every decode candidate failed: wait up to ``failover_wait_s`` for a healthy decode
        worker (a restarted one, a new replica) and return it, the least busy first; [] if
        none came. A lone decode worker that dies and is restarted (``pdserve up``, the
        kubelet) so costs its streams a pause, not an error. A worker this request already
        used is told to drop the old request first (its id is about to come back)."""
        if self.cfg.failover_wait_s <= 0:
            return []
        deadline = time.monotonic() + self.cfg.failover_wait_s
        log.warning(
            "request %s: no decode worker left; waiting up to %.0fs for one",
            rs.request_id,
            self.cfg.failover_wait_s,
        )
        while True:
            ready = sorted(self.discovery.snapshot().decode, key=lambda w: w.inflight)
            if ready:
                for w in ready:
                    if w.url in rs.touched:
                        await worker_client.abort(self.client, w.url, rs.request_id)
                return ready[:MAX_ATTEMPTS]
            if time.monotonic() >= deadline:
                return []
            await asyncio.sleep(FAILOVER_POLL_S)

    async def _fresh_handle(
        self, rs: RequestState, plan: RoutePlan, req: GenerateRequest
    ) -> GenerateRequest:
        """The last decode worker may have claimed the handle (single-use): end the old
        lease and prefill again for a new one; the first token already sent stays. Without
        one the next decode worker recomputes the prompt when its claim is refused."""
        for worker in plan.prefill:
            if worker.url in rs.touched:  # awaited: the worker frees the id before reuse
                await worker_client.abort(self.client, worker.url, rs.request_id)
        fresh = await self._prefill(rs, plan)
        if fresh is None or fresh.kv_handle is None:
            return req
        return replace(req, kv_handle=fresh.kv_handle)

    def cut_stalled(self) -> None:
        """After each health round: a call that has waited ``stall_timeout_s`` for its
        worker's reply or next bytes, on a worker whose health check fails, is cut and so
        moves on (a prefill to the next prefill worker or a local prefill, a decode stream
        to the next decode worker). A hung worker (stopped, deadlocked, its host gone
        silent) closes nothing, and its calls would otherwise wait ``request_timeout_s``;
        a healthy worker's quiet call (a long queue, a long prefill) is left alone. A
        chained decode call (``--pd-handoff decode``) with no bytes yet is cut too when the
        prefill worker it waits on fails its check; the decode worker is not blamed, and
        the retry names only the candidates that pass theirs."""
        now, limit = time.monotonic(), self.cfg.stall_timeout_s
        for watch in list(self._watches):
            quiet = watch.quiet_s(now)
            if quiet < limit:
                continue
            if not self.discovery.failed_check(watch.url):
                if watch.via is None or not self.discovery.failed_check(watch.via):
                    continue
                watch.down = False  # the decode worker is fine: its prefill worker hangs
            if watch.cut(f"no bytes for {quiet:.1f}s and its health check fails"):
                log.warning(
                    "cutting a stalled %s call on %s (%.1fs quiet)", watch.role, watch.url, quiet
                )
                self.metrics.child(self.metrics.stalled, watch.role).inc()

    def _migrate(self, rs: RequestState, req: GenerateRequest, url: str) -> GenerateRequest:
        """The request that continues ``rs`` on ``url``: no KV handle (its lease belonged to
        the first worker); the worker recomputes prompt + sent tokens and goes on."""
        rs.migrations += 1
        self.metrics.migrated.inc()
        log.warning(
            "request %s: migrating to %s after %d tokens", rs.request_id, url, len(rs.output_ids)
        )
        return replace(
            req,
            kv_handle=None,
            first_token_id=None,
            resume_token_ids=list(rs.output_ids),
            prefill=None,
            sampling=_after_prompt(rs),
        )

    def _relay(self, rs: RequestState, msg: TokenDelta) -> Delta:
        ids = msg.token_ids
        if msg.prompt_logprobs is not None and rs.prompt_logprobs is None:
            rs.prompt_logprobs = msg.prompt_logprobs
        rs.output_ids.extend(ids)  # ints: the line decoder checked each
        # The prefill's count holds; after a migration the count covers the resumed tokens.
        if msg.usage is not None and not rs.remote_prefill and not rs.migrations:
            rs.cached_tokens = msg.usage.cached_tokens
        return self._delta(rs, msg.text, len(ids), msg.finish_reason, tuple(ids), msg.logprobs)

    def _track(self, url: str, role: str, tokens: int, step: int) -> None:
        if step > 0:
            self.discovery.begin(url, tokens)
            self.metrics.child(self.metrics.inflight, url, role).inc()
        else:
            self.discovery.end(url, tokens)
            self.metrics.child(self.metrics.inflight, url, role).dec()

    def _abort_all(self, rs: RequestState) -> None:
        for url in rs.touched:
            self._spawn(worker_client.abort(self.client, url, rs.request_id))

    def _spawn(self, coro: Any) -> None:
        # Aborts run outside the request's task: it may be the one being cancelled.
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _after_prompt(rs: RequestState) -> SamplingParams:
    """The sampling a decode worker gets: prompt logprobs only while none came (from the
    prefill worker, or a decode worker before a migration); a worker that has them to
    compute again would bypass its prefix cache for nothing."""
    if rs.prompt_logprobs is None or rs.sampling.prompt_logprobs is None:
        return rs.sampling
    return replace(rs.sampling, prompt_logprobs=None)
