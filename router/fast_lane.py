"""The compiled lane's Python half (``--fast-lane``; docs/router.md, "Eighth pass").

``pdserve_lane`` (rust/router_lane/, built by scripts/setup.sh) serves the router's public
socket on a thread of its own: POST /v1/completions with one choice, no logprobs and no
echo, on the P/D path (router-called prefill) and decode-direct, streamed or whole. It
does the HTTP, the signed worker calls, the prefill reply, the SSE relay, retries and
migration in Rust. Everything stateful stays here, on the event loop, as the Python lane
does it: the gate (API key, per-client rate), admission, the body's checks and
tokenization, the in-flight counts, failures and metrics. The plan is the Rust planner's
(router/lane_plan.py: the snapshot and the prefix index mirrored into it; the Python
scheduler stays its reference). Rust queues jobs and wakes the loop through a pipe;
``_drain`` runs them in a batch.

Any other request, and a completion this side declines (``eligible``), goes to the
Python server behind the lane on loopback, unchanged, with the client's address in
``x-pdserve-lane-peer``, believed only with this process's token (``LanePeer``). The
Python lane stays the reference: tests/router/test_fast_lane.py runs the same requests
through both.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request

from pdserve.protocol.codec import all_ints, encode
from pdserve.protocol.contract import PrefillRequest
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router import edge, lane_plan
from pdserve.router.api.openai_request import CompletionRequest
from pdserve.router.api.serving import INLINE_BODY_BYTES, INLINE_TEXT_CHARS, fit_context
from pdserve.router.api.serving import prepare_body as prepare_body
from pdserve.router.errors import APIError
from pdserve.router.lane_plan import LanePlanner, python_plan
from pdserve.router.runtime import Runtime, Ticket
from pdserve.router.scheduling import disagg
from pdserve.router.transport.dispatch import MAX_ATTEMPTS, RequestState

log = logging.getLogger(__name__)

PEER_HEADER = b"x-pdserve-lane-peer"
TOKEN_HEADER = b"x-pdserve-lane-token"


def load() -> Any:
    """The compiled module, or None with the reason logged (the Python lane serves)."""
    try:
        import pdserve_lane  # type: ignore[import-not-found]
    except ImportError as exc:
        log.warning(
            "--fast-lane: the compiled lane is not installed (%s; scripts/setup.sh builds it "
            "with cargo); serving on the Python lane",
            exc,
        )
        return None
    if not hasattr(pdserve_lane, "tokenize"):  # built before the lane tokenized text
        log.warning(
            "--fast-lane: the compiled lane installed is out of date (a build of an older "
            "tree: scripts/setup.sh rebuilds it); serving on the Python lane"
        )
        return None
    return pdserve_lane


def eligible(rt: Runtime, req: CompletionRequest) -> bool:
    """A request the lane answers as the Python lane would: one choice, text only. With
    --budget-peers a key's budget is an awaited call to its owner (``Runtime.take_request``,
    ``take_tokens``), which the lane's inline begin does not make: the Python lane serves."""
    cfg = rt.cfg
    return (
        rt.peers is None
        and not req.chat
        and req.best_of == 1
        and req.echo is None
        and req.sampling.logprobs is None
        and req.sampling.prompt_logprobs is None
        and req.tools is None
        and cfg.pd_handoff == "router"
        and not cfg.prefill_from_header
        and req.model in rt.base_names  # a LoRA adapter's request: the Python lane
    )


@dataclass
class _Run:
    ticket: Ticket
    prompt_tokens: int
    start: float
    first: bool = False


class LaneHost:
    """Runs the lane's jobs on the loop: one per request to begin it, then its first
    token, its worker calls' in-flight counts, failures, and its end."""

    def __init__(self, rt: Runtime, lane: Any, planner: LanePlanner | None = None) -> None:
        self.rt, self.lane = rt, lane
        # the plan: the Rust planner's (router/lane_plan.py), else the scheduler's
        self.plan = planner.plan if planner is not None else partial(python_plan, rt.scheduler)
        self.runs: dict[int, _Run] = {}
        self._next = 0
        self.served = 0  # requests the lane served (the rest went to the Python lane)
        self.tls = False  # a worker behind https://: the lane speaks plain HTTP only
        self._tasks: set[asyncio.Task[Any]] = set()
        m = rt.metrics
        self._err_mid = _body(APIError(502, MID_STREAM))
        self._err_none = _body(APIError(503, NO_WORKER, code="no_worker"))
        self._handlers: dict[str, Any] = {
            "begin": self._begin,
            "first": self._first,
            "track": self._track,
            "failed": self._failed,
            "migrated": lambda token: m.migrated.inc(),
            "stalled": self._stalled,
            "counted": lambda status: m.child(m.requests, str(status)).inc(),
            "slow_reader": self._slow_reader,
            "await_decode": self._await_decode,
            "end": self._end,
        }

    def _drain(self) -> None:
        for job in self.lane.take():
            try:
                self._handlers[job[0]](*job[1:])
            except Exception:  # a job must never stop the loop's reader
                log.exception("fast lane: job %s failed", job[0])

    # -- begin: serving.serve's steps up to the plan -------------------------------------
    def _begin(
        self,
        job: int,
        raw: bytes,
        headers: list[Any],
        peer: tuple[str, int],
        given: tuple[str, list[int]] | None = None,
    ) -> None:
        """``given``: the body's text prompt and its ids, tokenized by the lane."""
        rt = self.rt
        req_ids = self._parsed(raw, given)
        if req_ids is None:
            self.lane.answer(job, ("fallback",))
            return
        request = Request(_scope(headers, peer))
        try:
            caller, client = rt.gate(request)
            ticket = rt.admission.try_now(client)
        except APIError as err:
            self.lane.answer(job, self._error(err))
            return
        if ticket is None:  # a queue: wait for a slot as the Python lane does
            task = asyncio.get_running_loop().create_task(
                self._admit_then(job, request, caller, client, *req_ids)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._go(job, caller.key, client, ticket, *req_ids)

    async def _admit_then(
        self,
        job: int,
        request: Request,
        caller: Any,
        client: str,
        req: CompletionRequest,
        ids: list[int],
    ) -> None:
        try:
            ticket = await self.rt.admit(client, caller.priority)
        except APIError as err:
            self.lane.answer(job, self._error(err))
            return
        self._go(job, caller.key, client, ticket, req, ids)

    def _parsed(
        self, raw: bytes, given: tuple[str, list[int]] | None = None
    ) -> tuple[CompletionRequest, list[int]] | None:
        """The checked request and its ids, or None: the Python lane answers it (another
        shape, a body the loop does not parse inline, or an error: that lane's order of
        checks, the gate first, decides which error the client hears)."""
        if len(raw) > INLINE_BODY_BYTES or self.tls:
            return None
        try:
            body = edge.parse_json(raw)
            prompt = body.get("prompt") if isinstance(body, dict) else None
            if not (isinstance(prompt, list) and all_ints(prompt)) and not (
                isinstance(prompt, str) and len(prompt) <= INLINE_TEXT_CHARS
            ):
                return None
            req, ids = prepare_body(self.rt, body, False, given)
        except APIError:
            return None
        return (req, ids) if eligible(self.rt, req) else None

    def _go(
        self,
        job: int,
        key: str,
        client: str,
        ticket: Ticket,
        req: CompletionRequest,
        ids: list[int],
    ) -> None:
        """serving.serve after admission: the context fit, the token budget, the salt and
        the plan; the two worker bodies encoded as the dispatcher would send them."""
        rt = self.rt
        try:
            snap = rt.discovery.snapshot()  # one view of the workers for the whole decision
            req = fit_context(rt, snap, req, len(ids))
            rt.limiter.take_tokens(client, len(ids) + req.best_of * req.sampling.max_tokens)
            salt = rt.cache_salt(key, req.cache_salt)
            kind, prefill, decode = self.plan(ids, snap, salt)
        except APIError as err:
            ticket.release()
            self.lane.answer(job, self._error(err))
            return
        rid = "cmpl-" + os.urandom(16).hex()
        prefill = prefill[:MAX_ATTEMPTS] if kind == disagg.REMOTE_PREFILL else []
        decode = decode[:MAX_ATTEMPTS]
        # the lane derives the GenerateRequest from it (test_generate_request_is_the_codecs)
        pbody = encode(PrefillRequest(rid, ids, req.sampling, salt, None))
        self._next += 1
        self.served += 1
        token = self._next
        self.runs[token] = _Run(ticket, len(ids), time.perf_counter())
        rt.metrics.prefill_queue_depth.inc()  # until the first token (or the end)
        self.lane.answer(
            job,
            (
                "go",
                token,
                rid,
                req.model,
                req.stream,
                req.include_usage,
                prefill,
                decode,
                pbody,
                b"",
                len(ids),
                rt.cfg.request_timeout_s,
                self._err_mid,
                self._err_none,
            ),
        )

    # -- the jobs after begin -------------------------------------------------------------
    def _first(self, token: int, ttft: float) -> None:
        run = self.runs.get(token)
        if run is None or run.first:
            return
        run.first = True
        self.rt.metrics.ttft.observe(ttft)
        self.rt.metrics.prefill_queue_depth.dec()

    def _track(self, url: str, role: str, step: int, tokens: int) -> None:
        """A batch's worker calls begun and ended on ``url`` in ``role``, net (lib.rs
        ``netted``: one per worker, ahead of the batch's other jobs), and their prompt
        tokens (prefill calls)."""
        m = self.rt.metrics
        self.rt.discovery.shift(url, step, tokens)
        m.child(m.inflight, url, role).inc(step)

    def _stalled(self, token: int, url: str, role: str, quiet: float) -> None:
        log.warning("cutting a stalled %s call on %s (%.1fs quiet)", role, url, quiet)
        self.rt.metrics.child(self.rt.metrics.stalled, role).inc()

    def health(self) -> None:
        """After each health round: the workers failing their check, for the stall cuts."""
        d = self.rt.discovery
        workers = d.snapshot().workers
        self.tls = any(not w.url.startswith("http://") for w in workers)
        failing = [w.url for w in workers if d.failed_check(w.url)]
        self.lane.set_health(failing, self.rt.cfg.stall_timeout_s)

    def _await_decode(self, job: int, token: int, rid: str, touched: list[str]) -> None:
        task = asyncio.get_running_loop().create_task(self._decode_ready(job, rid, touched))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _decode_ready(self, job: int, rid: str, touched: list[str]) -> None:
        """Dispatcher._await_decode: the decode workers ready within failover_wait_s."""
        urls: list[str] = []
        try:
            rs = RequestState(rid, [], SamplingParams())
            rs.touched.update(touched)
            urls = [w.url for w in await self.rt.dispatcher._await_decode(rs)]
        finally:
            self.lane.decode_ready(job, urls)

    def _slow_reader(self, token: int, waited: float) -> None:
        log.warning(
            "stream aborted: its client read nothing for %.1f s (--stream-write-timeout)", waited
        )
        self.rt.metrics.slow_readers.inc()

    def _failed(self, token: int, url: str, role: str, down: bool, reason: str) -> None:
        log.warning("fast lane: %s failed on %s: %s", role, url, reason)
        m = self.rt.metrics
        m.child(m.worker_failures, role).inc()
        if down:
            self.rt.discovery.mark_failed(url)

    def _end(
        self,
        token: int,
        status: int,
        completion: int,
        e2e: float,
        tpot: float | None,
    ) -> None:
        """Runtime.finish's metrics, and the slot back (the inter-token latencies are
        counted in the lane and folded in on scrape: ``Histogram.pull``)."""
        run = self.runs.pop(token, None)
        if run is None:
            return
        m = self.rt.metrics
        if not run.first:
            m.prefill_queue_depth.dec()
        m.child(m.requests, str(status)).inc()
        m.e2e.observe(e2e)
        m.prompt_tokens.inc(run.prompt_tokens)
        m.generation_tokens.inc(completion)
        if tpot is not None:
            m.tpot.observe(tpot)
        run.ticket.release()

    def _error(self, err: APIError) -> tuple[Any, ...]:
        resp = self.rt.error(err)  # counted, logged, OpenAI's body
        headers = [(k.decode(), v.decode()) for k, v in resp.raw_headers if k != b"content-length"]
        return ("error", resp.status_code, bytes(resp.body), headers)


MID_STREAM = "decode worker failed mid-stream and no other could take over"
NO_WORKER = "no decode worker could serve the request"


def _body(err: APIError) -> bytes:
    from pdserve.router.errors import response

    return bytes(response(err).body)


def _scope(headers: list[Any], peer: tuple[str, int]) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": peer,
        "server": None,
        "scheme": "http",
        "http_version": "1.1",
    }


@dataclass
class LaneSetup:
    """What the lane starts with once the runtime is up (router/app.py's lifespan): the
    compiled module, the public socket (bound), the Python server's loopback address, and
    this process's token for ``x-pdserve-lane-peer``."""

    module: Any
    public: socket.socket
    backend: tuple[str, int]
    token: str

    def start(self, rt: Runtime) -> Lane:
        ring = rt.dispatcher.client.ring  # the keys the Python lane signs its calls with
        lane = self.module.Lane(
            os.dup(self.public.fileno()),
            f"{self.backend[0]}:{self.backend[1]}",
            [bytes(k) for k in ring.keys],
            self.token,
            min(INLINE_BODY_BYTES, rt.cfg.max_body_bytes),
            rt.cfg.stall_timeout_s,
            rt.cfg.body_timeout_s,
            _body(edge.body_timeout(rt.cfg.body_timeout_s)),
            rt.cfg.stream_write_timeout_s,
            list(rt.metrics.itl.bounds),
            rt.tokenizer.backend_json(),  # text prompts tokenized on the lane's thread
            INLINE_TEXT_CHARS,
        )
        rt.metrics.itl.pull = lane.take_itl
        self.public.close()  # the lane holds its own copy
        rust = lane_plan.planner(self.module, rt.cfg, rt.scheduler.hash_key)
        host = LaneHost(rt, lane, LanePlanner(rust, rt.scheduler, rt.index))
        asyncio.get_running_loop().add_reader(lane.notify_fd(), host._drain)
        rt.discovery.after_refresh.append(host.health)
        host.health()
        log.info("fast lane: POST /v1/completions served by the compiled lane")
        return Lane(lane, host)


@dataclass
class Lane:
    lane: Any
    host: LaneHost

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.lane.notify_fd())
        self.lane.close()
        itl = self.host.rt.metrics.itl
        itl.fold()  # the last of the lane's counts
        itl.pull = None
        log.info("fast lane: served %d requests", self.host.served)
        for run in self.host.runs.values():
            run.ticket.release()
        self.host.runs.clear()


def setup(module: Any, public: socket.socket, backend: socket.socket) -> LaneSetup:
    """The lane on ``public`` (bound: it listens from now), the Python server on ``backend``
    (bound, loopback: uvicorn serves it; kept as ``backend_socket``)."""
    public.listen(2048)
    lane = LaneSetup(module, public, backend.getsockname()[:2], os.urandom(16).hex())
    lane.backend_socket = backend  # type: ignore[attr-defined]
    return lane


class LanePeer:
    """ASGI wrapper of the Python server behind the lane: a request the lane passed on
    carries the client's address and this process's token; the address replaces the
    loopback one (before the proxy-header rewrite, which would otherwise trust the
    loopback peer), the public socket's address the server's. The two headers are
    dropped from every request, so no client can set them."""

    def __init__(self, app: Any, token: str, server: tuple[str, int]) -> None:
        self.app, self.token, self.server = app, token.encode(), server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            peer = token = None
            for k, v in scope["headers"]:
                if k == PEER_HEADER:
                    peer = v
                elif k == TOKEN_HEADER:
                    token = v
            if peer is not None or token is not None:
                kept = [(k, v) for k, v in scope["headers"] if k not in (PEER_HEADER, TOKEN_HEADER)]
                scope = {**scope, "headers": kept}
                if token is not None and hmac.compare_digest(token, self.token) and peer:
                    ip, _, port = peer.decode().rpartition(":")
                    scope["client"] = (ip.strip("[]"), int(port))
                    scope["server"] = self.server
        await self.app(scope, receive, send)
