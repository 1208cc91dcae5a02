"""Token-budget continuous batching.

Each step the scheduler hands out at most ``max_num_batched_tokens`` tokens:
running requests first, in arrival order (a decode takes one token, a prefill
chunk what the budget leaves), then waiting requests, admitted only when blocks
for their whole prompt are free. When a running request cannot grow, the newest
running request is preempted (its blocks freed, to be recomputed later). A
request that arrives with a remote KV handle is admitted into
``WAITING_FOR_REMOTE_KV``: its blocks are allocated and the connector pulls
them, while the rest of the batch keeps running.

Waiting requests are admitted fairly across tenants (the router's API keys): each tenant
has a queue of its own beside the arrival order (``waiting``), and the next one admitted
is the oldest of the tenant with the fewest requests running, however deep one key's
burst is (before, only the first 64 waiting were looked through: a burst longer than that
held every other key back). Preempted requests go first; with one tenant (no keys) this
is first come, first served.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable

from pdserve.engine import prompt_logprobs
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.engine.kv_tiers.sched import TierLoading
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sched_output import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        connector: KVConnector | None = None,
        recompute_on_load_failure: bool = True,
    ) -> None:
        self.config = config
        self.kv = kv  # the KV cache manager: this scheduler's, as in vLLM v1 (kv_manager.py)
        self.connector = connector
        self.recompute_on_load_failure = recompute_on_load_failure
        self.waiting: deque[Request] = deque()  # arrival order (preempted in front)
        self.waiting_by_tenant: dict[str, deque[Request]] = {}  # the same, per tenant
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        self.tiers: TierLoading | None = None  # KV tiers below the pool (kv_tiers/attach.py)
        # Keep a little headroom so admissions do not immediately force preemptions.
        self.watermark_blocks = max(1, kv.num_blocks // 100)
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0
        # Speculative decoding (engine/spec_decode.py): draft tokens for a decode, given
        # the budget left for them; None: off.
        self.drafter: Callable[[Request, int], list[int]] | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.tiers)

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.waiting_by_tenant.setdefault(req.tenant, deque()).append(req)

    def _unwait(self, req: Request) -> None:
        self.waiting.remove(req)
        queue = self.waiting_by_tenant[req.tenant]
        queue.remove(req)  # its head, when admitted
        if not queue:
            del self.waiting_by_tenant[req.tenant]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._collect_loads(out)
        if self.tiers is not None:
            self.running.extend(self.tiers.collect())
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    # -- running ---------------------------------------------------------------
    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = deque(self.running)
        self.running = []
        while queue:
            req = queue.popleft()
            n = min(req.num_uncomputed_tokens, budget)
            if n == 0:
                self.running.append(req)
                continue
            need = req.num_computed_tokens + n
            while not self.kv.can_grow(req.block_ids, need):
                victim = queue.pop() if queue else req
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # preempted itself: nothing smaller is left to run
            draft = self._draft(req, need, budget - n)
            self.kv.grow(req.block_ids, need + len(draft))
            out.chunks.append(ScheduledChunk.of(req, n, draft))
            self.running.append(req)
            budget -= n + len(draft)
        for req in out.preempted:  # newest first, so the oldest ends up in front
            self.waiting.appendleft(req)
            self.waiting_by_tenant.setdefault(req.tenant, deque()).appendleft(req)
        return budget

    def _draft(self, req: Request, need: int, room: int) -> list[int]:
        """Draft tokens to verify with ``req``'s decode (none for a prompt chunk, or when
        their KV would need blocks that are not free: drafts never preempt anyone)."""
        if self.drafter is None or req.num_uncomputed_tokens != 1 or room <= 0:
            return []
        draft = self.drafter(req, room)
        if draft and not self.kv.can_grow(req.block_ids, need + len(draft)):
            return []
        return draft

    def _preempt(self, req: Request) -> None:
        self.kv.free_request(req)
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1

    # -- waiting ---------------------------------------------------------------
    def _next_waiting(self, tenants: Counter[str]) -> Request:
        """The next request to admit: a preempted one at the head (it was running), else
        the oldest of the tenant with the fewest running (``tenants``)."""
        head = self.waiting[0]
        if head.num_preemptions or not tenants[head.tenant]:
            return head
        return min(
            (queue[0] for queue in self.waiting_by_tenant.values()),
            key=lambda r: (tenants[r.tenant], r.arrival_time),
        )

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        tiered = self.tiers.requests.values() if self.tiers is not None else ()
        tenants = Counter(r.tenant for r in (*self.running, *self.loading.values(), *tiered))
        while self.waiting and budget > 0:
            if len(self.running) + self.num_loading >= self.config.max_num_seqs:
                return
            req = self._next_waiting(tenants)
            # A remote request always reads its last prompt block, so the load (and the
            # lease release that comes with it) is never empty.
            covered = req.num_prompt_tokens if req.remote_kv is not None else req.num_tokens
            hits = self.kv.cached_prefix(req.block_hashes, covered)
            if prompt_logprobs.wanted(req):  # cached rows would have no logits to score
                hits = []
            need = req.num_tokens + 1  # room for the first generated token too
            if not self.kv.can_allocate(hits, need) or (
                self.kv.num_free_blocks - self.kv.blocks_needed(need) + len(hits)
                < self.watermark_blocks
                and self.running
            ):
                return
            self._unwait(req)
            tenants[req.tenant] += 1
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            alloc = self.kv.allocate(hits, need)
            req.block_ids = alloc.block_ids
            req.num_computed_tokens = alloc.num_cached_blocks * self.kv.block_size
            req.num_registered_blocks = alloc.num_cached_blocks
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
                self.num_prefix_hit_tokens += req.num_computed_tokens
            if req.remote_kv is not None:
                self._start_load(req, alloc.num_cached_blocks)
                continue
            if self._from_tier(req, alloc.num_cached_blocks):
                continue
            req.status = RequestStatus.RUNNING
            n = min(req.num_uncomputed_tokens, budget)
            out.chunks.append(ScheduledChunk.of(req, n))
            self.running.append(req)
            budget -= n

    @property
    def num_loading(self) -> int:
        """Requests waiting for KV: from a remote worker or from a tier."""
        return len(self.loading) + (len(self.tiers) if self.tiers is not None else 0)

    @property
    def num_tier_hit_tokens(self) -> int:
        return self.tiers.num_hit_tokens if self.tiers is not None else 0

    def _from_tier(self, req: Request, num_cached_blocks: int) -> bool:
        """Whether the request waits for its prefix from a KV tier (kv_tiers/sched.py)."""
        if self.tiers is None or prompt_logprobs.wanted(req):
            return False
        return self.tiers.maybe_start(req, num_cached_blocks)

    # -- remote KV -------------------------------------------------------------
    def _start_load(self, req: Request, num_cached_blocks: int) -> None:
        assert self.connector is not None, "remote KV needs a connector"
        handle = req.remote_kv
        num_remote = len(handle.block_ids)
        remote = list(handle.block_ids[num_cached_blocks:num_remote])
        local = req.block_ids[num_cached_blocks:num_remote]
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[req.request_id] = req
        self.connector.start_load(req.request_id, handle, remote, local)

    def _collect_loads(self, out: SchedulerOutput) -> None:
        if self.connector is None or not self.loading:
            return
        for result in self.connector.poll():
            req = self.loading.pop(result.request_id, None)
            if req is None:
                continue
            out.loaded.append((req, result))
            if req.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
                continue  # aborted while loading; the engine frees it now
            req.remote_kv, handle = None, req.remote_kv
            if result.quarantined:
                continue  # its blocks may still be written: the engine fails the request
            if result.ok:
                req.num_computed_tokens = handle.num_tokens
            elif self.recompute_on_load_failure:
                logger.warning(
                    "KV load of %s failed (%s): recomputing", req.request_id, result.error
                )
            else:
                continue  # the engine fails the request
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    # -- leaving ---------------------------------------------------------------
    def remove(self, req: Request) -> None:
        """Take a finished or aborted request out of every queue (blocks are the caller's)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self._unwait(req)
        elif self.tiers is not None and self.tiers.cancel(req):
            pass  # no tier writes its blocks any more: the caller frees them
        elif req.request_id in self.loading and self.connector is not None:
            # Stays in ``loading`` until the connector reports the transfer stopped.
            self.connector.cancel(req.request_id)
