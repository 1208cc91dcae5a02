"""The tiers below one engine's pool, driven off the engine step.

    engine thread                         store threads
    ─────────────                         ─────────────
    evicted(hash, block copy) ──queue──▶  writer: encode, put in every tier
    start_load(rid, hashes, ids) ──────▶  loader: first tier that has each block,
                                              decode + verify, copy into the pool block
    poll() ◀── finished / timed-out loads (how many leading blocks were loaded)
    cancel(rid): no write into the request's blocks after it returns

The writer's queue is bounded (``write_queue_blocks``): when it is full an evicted block is
dropped (counted), never waited for. A load writes its blocks in order and stops at the
first block no tier has (or that fails to verify); ``poll`` reports a load that runs past
its deadline as done with the blocks loaded so far, and the rest are recomputed. Every
tier error, bad entry and timeout is counted (``stats``), none reaches the request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pdserve.engine.kv_tiers import codec
from pdserve.engine.kv_tiers.base import Tier
from pdserve.engine.kv_tiers.stats import TierStats

logger = logging.getLogger(__name__)

WriteBlock = Callable[[int, torch.Tensor], None]  # (pool block id, block) from a loader


@dataclass
class _Load:
    request_id: str
    hashes: list[int]
    block_ids: list[int]
    deadline: float
    started: float = field(default_factory=time.monotonic)
    loaded: int = 0
    done: bool = False
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class TierLoad:
    request_id: str
    num_blocks: int  # leading blocks now in the pool
    timed_out: bool = False


class TieredStore:
    def __init__(
        self,
        tiers: Sequence[Tier],
        ns: bytes,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        write_block: WriteBlock,
        load_timeout_s: float = 1.0,
        write_queue_blocks: int = 256,
        loader_threads: int = 2,
    ) -> None:
        assert tiers, "a store needs a tier"
        self.tiers = list(tiers)
        self.ns, self.dtype, self.shape = ns, dtype, shape
        self.write_block = write_block
        self.load_timeout_s = load_timeout_s
        self.stats = TierStats([t.name for t in self.tiers])
        self._events: list[tuple[str, str, list[int]]] = []
        self._events_lock = threading.Lock()
        for tier in self.tiers:
            tier.on_evict = self._listener(tier.name)
        self._writes: queue.Queue[tuple[int, torch.Tensor] | None] = queue.Queue(write_queue_blocks)
        self._loads: dict[str, _Load] = {}
        self._pool = ThreadPoolExecutor(loader_threads, thread_name_prefix="kv-tier-load")
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-write", daemon=True)
        self._writer.start()

    # -- engine thread -----------------------------------------------------------------
    def accepting(self) -> bool:
        """Room in the write queue (else the engine does not even copy the block)."""
        return not self._writes.full()

    def evicted(self, block_hash: int, block: torch.Tensor) -> None:
        """A block leaving the pool (``block``: a copy the engine will not touch again)."""
        try:
            self._writes.put_nowait((block_hash, block))
        except queue.Full:
            self.stats.dropped_writes += 1

    def may_have(self, block_hash: int) -> bool:
        """Whether a load of this block is worth starting: a local tier holds it, or a
        shared tier may (asked off the engine thread, by the load itself)."""
        key = codec.block_key(self.ns, block_hash)
        return any(not t.local or t.contains(key) for t in self.tiers)

    def start_load(self, request_id: str, hashes: list[int], block_ids: list[int]) -> None:
        assert len(hashes) == len(block_ids) and request_id not in self._loads
        job = _Load(request_id, hashes, block_ids, time.monotonic() + self.load_timeout_s)
        self._loads[request_id] = job
        self._pool.submit(self._load, job)

    def poll(self) -> list[TierLoad]:
        now, out = time.monotonic(), []
        for rid, job in list(self._loads.items()):
            if not job.done and now < job.deadline:
                continue
            with job.lock:
                job.cancelled = True  # a late loader writes nothing more
                timed_out = not job.done
            del self._loads[rid]
            self.stats.loaded(job.loaded, now - job.started, timed_out)
            out.append(TierLoad(rid, job.loaded, timed_out))
        return out

    def cancel(self, request_id: str) -> None:
        """Stop a load: once this returns, no loader writes into its blocks."""
        job = self._loads.pop(request_id, None)
        if job is not None:
            with job.lock:
                job.cancelled = True

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def drain_events(self) -> list[tuple[str, str, list[int]]]:
        """(kind, tier, block hashes) since the last call: "stored" / "removed"."""
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for tier in self.tiers:
            tier.close()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued write is done (tests, benches)."""
        end = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.001)

    # -- store threads -----------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:
                logger.exception("KV tier write failed")
            finally:
                self._writes.task_done()

    def _write(self, block_hash: int, block: torch.Tensor) -> None:
        key = codec.block_key(self.ns, block_hash)
        entry = codec.encode(key, block)
        for tier in self.tiers:
            try:
                if tier.put(key, entry):
                    self.stats.wrote(tier.name, len(entry))
                    self._event("stored", tier.name, [block_hash])
            except Exception as exc:
                self._failed(tier.name, "write", exc)

    def _load(self, job: _Load) -> None:
        try:
            for block_hash, block_id in zip(job.hashes, job.block_ids, strict=True):
                if job.cancelled:
                    return
                block = self._read(block_hash)
                if block is None:
                    return
                with job.lock:
                    if job.cancelled:
                        return
                    self.write_block(block_id, block)
                    job.loaded += 1
        except Exception:
            logger.exception("KV tier load of %s failed", job.request_id)
        finally:
            job.done = True

    def _read(self, block_hash: int) -> torch.Tensor | None:
        key = codec.block_key(self.ns, block_hash)
        for tier in self.tiers:
            try:
                entry = tier.get(key)
            except Exception as exc:
                self._failed(tier.name, "read", exc)
                continue
            if entry is None:
                continue
            try:
                block = codec.decode(entry, key, self.dtype, self.shape)
            except codec.BadEntry as exc:
                self.stats.bad_entries += 1
                logger.warning("KV tier %s: bad entry dropped: %s", tier.name, exc)
                self._forget(tier, key)
                continue
            self.stats.hit(tier.name, len(entry))
            return block
        self.stats.misses += 1
        return None

    def _failed(self, tier: str, what: str, exc: Exception) -> None:
        """Count a tier's failure; log the 1st, 10th, 100th... (a dead store fails them all)."""
        self.stats.error(tier)
        n = self.stats.errors[tier]
        if n & (n - 1) == 0 or n % 1000 == 0:  # powers of two, then every 1000th
            logger.warning("KV tier %s: %s failed (%d failures so far): %s", tier, what, n, exc)

    def _forget(self, tier: Tier, key: bytes) -> None:
        try:
            tier.delete(key)
        except Exception:
            self.stats.error(tier.name)

    def _listener(self, tier_name: str) -> Callable[[list[bytes]], None]:
        def removed(keys: list[bytes]) -> None:
            hashes = [int.from_bytes(k[16:], "little") for k in keys]
            self._event("removed", tier_name, hashes)

        return removed

    def _event(self, kind: str, tier: str, hashes: list[int]) -> None:
        with self._events_lock:
            if self._events and self._events[-1][:2] == (kind, tier):
                self._events[-1][2].extend(hashes)
            else:
                self._events.append((kind, tier, list(hashes)))
