"""The router's live state: everything the HTTP handlers share.

Built at app start-up (it needs the event loop), closed at shutdown.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from pdserve import keys
from pdserve.protocol.contract import LoraRef
from pdserve.router import errors
from pdserve.router.adapters import Adapter, AdapterTable
from pdserve.router.admission import Admission, Ticket
from pdserve.router.api.openai_request import check_model
from pdserve.router.api_keys import OPEN, Caller, KeyStore
from pdserve.router.config import RouterConfig
from pdserve.router.discovery.events import EventSubscriber
from pdserve.router.discovery.replicas import replica_count
from pdserve.router.discovery.workers import Discovery, EndpointSource
from pdserve.router.errors import APIError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.peer_budgets import KUBERNETES, PeerBudgets, own_url
from pdserve.router.peer_list import PREFIX, PeerFile, read_peers
from pdserve.router.ratelimit import RateLimiter
from pdserve.router.scheduling.prefix_index import PrefixIndex
from pdserve.router.scheduling.scheduler import Scheduler
from pdserve.router.scheduling.tier_index import TierIndex, parse_weights
from pdserve.router.shared_limits import SharedLimits
from pdserve.router.shared_limits import installed as shared_table
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.router.transport.dispatch import Dispatcher, RequestState
from pdserve.router.transport.lora_sync import LoraSync
from pdserve.worker_calls import worker_client

log = logging.getLogger(__name__)
T = TypeVar("T")


class Runtime:
    def __init__(
        self,
        cfg: RouterConfig,
        source: EndpointSource,
        tokenizer: PromptTokenizer,
        loras: Sequence[Adapter] = (),
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics()
        self.client = worker_client.new_session()
        self.index = PrefixIndex(
            cfg.prefix_index_capacity,
            TierIndex(cfg.prefix_index_capacity, parse_weights(cfg.prefix_tier_weights)),
        )
        self.metrics.watch_index(lambda: len(self.index), lambda: self.index.num_evicted)
        self.subscriber = EventSubscriber(self.index)  # every worker's KV events and load
        self.discovery = Discovery(source, self.client, cfg.health_interval_s, self.subscriber)
        self.calls = worker_client.new_pool()  # the per-request calls (prefill, generate, abort)
        self.scheduler = Scheduler(cfg, self.index, self.metrics)  # every request's plan
        self.dispatcher = Dispatcher(cfg, self.discovery, self.calls, self.metrics)
        self.keys = KeyStore(
            cfg.api_keys, cfg.api_key_file, cfg.admin_api_keys, cfg.admin_api_key_file
        )
        # --procs N: the per-client budgets in the table the processes share
        shared = shared_table() if len(cfg.proc_metrics_ports) > 1 else None
        self.admission = Admission(
            cfg.max_queue,
            cfg.max_concurrency_per_key,
            cfg.max_waiting,
            cfg.queue_timeout_s,
            self.metrics.queue_depth.set,
            shared,
        )
        self.created = int(time.time())
        self.limiter = RateLimiter(cfg.rate_limit_rpm, cfg.rate_limit_tpm, shared=shared)
        self._salt_key = salt_key()
        self.replicas = replica_count(cfg)
        self.peer_file: PeerFile | None = None  # --budget-peers @FILE
        self.peers = self._peer_budgets(cfg, shared)
        if self.peers is None:
            # Per-client budgets: this replica enforces 1/replicas of them (replicas.py).
            self.replicas.listen(self.limiter.split)
            self.replicas.listen(self.admission.split)
        # Parsing, chat templates and tokenizing: CPU work kept off the event loop.
        self.pool = ThreadPoolExecutor(cfg.tokenizer_threads, thread_name_prefix="pdserve-tok")
        self.loras = AdapterTable(loras)  # LoRA adapters served as models of their names
        self.lora_sync = LoraSync(self.loras, self.discovery.snapshot, self.client)
        if cfg.proc_index == 0:  # with --procs, one process tells late workers
            self.discovery.after_refresh.append(self.lora_sync.check)

    def _peer_budgets(self, cfg: RouterConfig, shared: SharedLimits | None) -> PeerBudgets | None:
        """--budget-peers: each key's budget kept whole by one replica (peer_budgets.py);
        the local limiter and admission cap are then off (the owner's count it)."""
        if not cfg.budget_peers or not any(
            (cfg.rate_limit_rpm, cfg.rate_limit_tpm, cfg.max_concurrency_per_key)
        ):
            return None
        kube = cfg.budget_peers == (KUBERNETES,)
        listed = cfg.budget_peers
        if listed[0].startswith(PREFIX):  # a file, re-read when it changes (peer_list.py)
            listed = read_peers(listed[0][1:])
        peers = PeerBudgets(
            own_url(cfg.budget_self, cfg.admin_port),
            () if kube else listed,
            self.limiter,
            cfg.max_concurrency_per_key,
            keys.KeyRing.from_env(keys.ROUTER_PEER),
            shared,
        )
        if kube:
            self.replicas.listen_addresses(peers.listen_endpoints(cfg.admin_port))
        elif cfg.budget_peers[0].startswith(PREFIX):
            self.peer_file = PeerFile(cfg.budget_peers[0][1:], peers.set_peers)
        self.limiter = RateLimiter(0, 0)  # the gate's own buckets: off (the owner's count)
        self.admission.counting, self.admission.deferred = False, True
        return peers

    @property
    def base_names(self) -> tuple[str, ...]:
        return (self.cfg.model_name, self.cfg.model_dir)

    @property
    def served_names(self) -> tuple[str, ...]:
        return self.base_names + self.loras.names()

    def adapter_of(self, model: str) -> LoraRef | None:
        """The adapter a request's ``model`` names; None for the base model; 404 for a
        name served by neither (an adapter unloaded since the request was parsed)."""
        if model in self.base_names:
            return None
        lora = self.loras.ref(model)
        if lora is None:
            check_model(model, self.served_names)
        return lora

    async def start(self) -> None:
        await self.discovery.refresh()
        self.discovery.start()
        await self.replicas.start()
        if self.peers is not None:
            self.peers.start()  # the counts of its keys asked for (the hand-over)
        if self.peer_file is not None:
            self.peer_file.check()
            self.peer_file.start()

    async def close(self) -> None:
        if self.peer_file is not None:
            await self.peer_file.close()
        if self.peers is not None:
            await self.peers.close()
        await self.discovery.stop()
        await self.lora_sync.close()
        await self.replicas.close()
        await self.dispatcher.drain()
        await self.client.close()
        await self.calls.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a tokenizer thread; its exceptions are raised here."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- admission ---------------------------------------------------------------------
    @property
    def active(self) -> int:
        """Requests admitted and not finished."""
        return self.admission.active

    def caller(self, request: Request) -> Caller:
        """Who sends ``request`` (its API key, priority class, admin or not); 401 without a
        valid key when keys are configured."""
        if not self.keys.enabled:  # no header to read: Starlette's Headers not built
            return OPEN
        return self.keys.caller(request.headers.get("authorization", ""))

    def check_auth(self, request: Request) -> str:
        """The caller's API key ("" when no keys are configured); 401 without a valid one."""
        return self.caller(request).key

    def require_admin(self, request: Request, change: bool = False) -> None:
        """/metrics and /workers: open on ``--admin-port`` (kept off the tenants' network),
        else an admin key while tenant keys are on (router/api_keys.py). A route that changes
        state (``change``: LoRA load and unload) needs an admin key on every port, keys
        or no keys: the admin port only opens what reads."""
        if change:  # an admin key always, even with no tenant keys (router/api_keys.py)
            self.keys.require_admin_key(request.headers.get("authorization", ""))
            return
        server = request.scope.get("server") or ("", 0)
        if self.cfg.admin_port and server[1] == self.cfg.admin_port:
            return
        if server[1] in self.cfg.proc_metrics_ports:  # loopback: a sibling process's scrape
            return
        self.keys.require_admin(request.headers.get("authorization", ""))

    @staticmethod
    def client_of(request: Request, key: str) -> str:
        """Who rate limits and fair shares count against: the API key, else the address."""
        if key:
            return "key:" + key
        return "addr:" + (request.client.host if request.client else "")

    def cache_salt(self, key: str, requested: str | None) -> str | None:
        """The prefix-cache salt sent with the request: the API key's own (an HMAC under a
        key derived from the service's block-hash key, never the key: key_salt) unless
        ``--cache-isolation none``, and the client's cache_salt."""
        parts = []
        if key and self.cfg.cache_isolation == "api-key":
            parts.append("k:" + key_salt(self._salt_key, key))
        if requested:
            parts.append("r:" + requested)
        return "|".join(parts) or None

    def gate(self, request: Request) -> tuple[Caller, str]:
        """What a request passes before its body is read: the API key and the client's
        requests-per-minute bucket. Returns (caller, client). No slot is taken: a slot
        is taken only once the body is in (``admit``), so a client that trickles its
        body holds nothing but its own connection (until ``--body-timeout``)."""
        caller = self.caller(request)
        client = self.client_of(request, caller.key)
        self.limiter.take_request(client)
        return caller, client

    async def admit(self, client: str, priority: int = 0) -> Ticket:
        """A slot under ``--max-queue``, shared fairly across clients (router/admission.py);
        with --budget-peers the key's count at its owner was taken by ``take_request``
        (one call with its requests bucket) and the ticket gives it back when the request
        ends; a refusal here does not (the caller's ``untake``)."""
        ticket = await self.admission.acquire(client, priority)
        if self.peers is not None:
            ticket.after = self.peers.leave
        return ticket

    async def take_request(self, client: str) -> None:
        """--budget-peers: the key's requests bucket and one more of its requests in
        flight, at its owner in one call (the gate's bucket and admission's per-key count
        are off). Until ``admit`` hands the count to a ticket, a request that ends gives
        it back with ``untake``."""
        if self.peers is not None:
            await self.peers.acquire(client)

    def untake(self, client: str) -> None:
        """A request that ``take_request`` counted ended before ``admit`` (its body never
        came, no slot): the count given back at the key's owner."""
        if self.peers is not None:
            self.peers.leave(client)

    async def take_tokens(self, client: str, n: int) -> None:
        """The key's tokens bucket: here, or at its owner with --budget-peers (no call
        without --rate-limit-tpm: every replica runs the same limits, and the owner's
        bucket would take nothing)."""
        if self.peers is None:
            self.limiter.take_tokens(client, n)
        elif self.cfg.rate_limit_tpm:
            await self.peers.take_tokens(client, n)

    # -- accounting --------------------------------------------------------------------
    def error(self, err: APIError) -> JSONResponse:
        self.metrics.child(self.metrics.requests, str(err.status)).inc()
        if err.status >= 500:
            log.warning("request failed (%d): %s", err.status, err.message)
        return errors.response(err)

    def internal_error(self, path: str, exc: Exception) -> JSONResponse:
        """An unexpected exception while serving ``path``: logged, answered with a 500."""
        log.error("internal error on %s", path, exc_info=exc)
        return self.error(APIError(500, f"internal error: {type(exc).__name__}"))

    def finish(self, rs: RequestState, code: int) -> None:
        if rs.recorded:
            return
        rs.recorded = True
        m = self.metrics
        m.child(m.requests, str(code)).inc()
        m.e2e.observe(time.perf_counter() - rs.start)
        m.prompt_tokens.inc(len(rs.prompt_ids))
        m.generation_tokens.inc(rs.completion_tokens)
        if rs.first_token_at is not None and rs.last_token_at and rs.completion_tokens > 1:
            tpot = (rs.last_token_at - rs.first_token_at) / (rs.completion_tokens - 1)
            m.tpot.observe(tpot)


def salt_key() -> bytes:
    """The key of the API keys' cache salts, never empty: an HMAC under the prefix cache's
    hash key with its own label (protocol/hashing.py: the Secret's ``hash-key``, else, for a
    Secret from before that entry, derived from ``secret``; the same value either way once
    ``pdserve rotate-secret`` patches the entry in). With no service secret at all (a bare
    local router) a random per-process key: a salt is then stable only within this process
    (a key's prefix-cache hits stay within one router process), never an unkeyed hash."""
    from pdserve.protocol.hashing import hash_key, note_key_source

    note_key_source()
    base = hash_key()
    if base:
        return hmac.new(base, b"pdserve/v1/cache-salt", hashlib.sha256).digest()
    log.warning(
        "no service secret: the API keys' cache salts are keyed with a random key of this "
        "process (set PDSERVE_SERVICE_SECRET to share one across router processes)"
    )
    return os.urandom(32)


def key_salt(salt_key_: bytes, api_key: str) -> str:
    """An API key's salt: an HMAC (the salt travels in clear on every worker call, and an
    unkeyed SHA-256 of a low-entropy key could be searched offline; issue 44 item 14)."""
    if not salt_key_:
        raise ValueError("an API key's cache salt needs a key (salt_key())")
    return hmac.new(salt_key_, api_key.encode(), hashlib.sha256).hexdigest()[:32]
