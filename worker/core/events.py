"""A worker's event stream on a ZeroMQ PUB socket: KV events (prefill workers) and load
reports (every worker), see ``pdserve/protocol/kv_events.py``.

Runs as an engine hook, so the socket and the mirror of the cache's hashes are used from
the engine thread only (the core loop also answers queries, ``snapshot``, on that
thread). The core loop runs hooks after every step and every 20 ms when idle; a load
report goes out when the counters changed (at most every ``MIN_GAP_S``) and at least
every ``EVERY_S`` (10 Hz when nothing changes).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import zmq

from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.codec import encode
from pdserve.protocol.contract import EngineStats
from pdserve.protocol.kv_events import STATS_TOPIC, TOPIC, KVEvent, KVSnapshot, LoadReport

EVERY_S = 0.1  # a report at least this often, changed or not (>= 10 Hz)
MIN_GAP_S = 0.01  # and no more often than this while the counters change every step


class KVEventPublisher:
    """``kv_events``: publish KV events too (prefill); a decode worker's stream carries
    only load reports (its cache is not routed to). ``any_port``: when the port in
    ``bind`` is taken, bind any free one (``port`` says which)."""

    def __init__(
        self,
        bind: str,
        worker_id: str,
        engine: LLMEngine | None = None,
        kv_events: bool = True,
        any_port: bool = False,
    ) -> None:
        self.worker_id = worker_id
        self.kv_events = kv_events
        self._engine = engine
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        host, _, port = bind.rpartition(":")
        try:
            self._sock.bind(bind)
            self.port = int(port)
        except zmq.ZMQError:
            if not any_port:  # a port given on purpose: its being taken is an error
                raise
            # Its default port (HTTP + 1) is taken: any free one (/stats advertises it).
            self.port = self._sock.bind_to_random_port(host)
        self.seq = 0
        self.held: set[int] = set()  # the hashes the events so far say the cache holds
        self._last: EngineStats | None = None
        self._sent_at = 0.0
        self.num_reports = 0

    def hook(self, engine: LLMEngine) -> None:
        if self.kv_events:
            self._publish_kv(engine)
        now = time.monotonic()
        gap = now - self._sent_at
        if gap < MIN_GAP_S:
            return
        stats = engine.stats()
        if stats == self._last and gap < EVERY_S:
            return
        self._last, self._sent_at = stats, now
        report = LoadReport(**_fields(stats), worker_id=self.worker_id, kv_seq=self.seq)
        self._sock.send_multipart([STATS_TOPIC, encode(report)])
        self.num_reports += 1

    def _publish_kv(self, engine: LLMEngine) -> None:
        """One message for one engine step's events: ``[TOPIC, event, event, ...]``, each
        event with its own ``seq`` (a router pays a receive per message, not per event;
        pdserve/protocol/kv_events.py)."""
        frames = [TOPIC]
        for kind, hashes in engine.drain_kv_events():
            if kind == "stored":
                self.held.update(hashes)
            elif kind == "removed":
                self.held.difference_update(hashes)
            else:
                self.held.clear()
            self.seq += 1
            frames.append(encode(KVEvent(kind, self.worker_id, self.seq, hashes)))
        for kind, tier, hashes in engine.drain_tier_events():  # not in ``held``: pool only
            self.seq += 1
            frames.append(encode(KVEvent(kind, self.worker_id, self.seq, hashes, tier)))
        if len(frames) > 1:
            self._sock.send_multipart(frames)

    def snapshot(self) -> KVSnapshot:
        """Every hash the cache holds, as of ``seq``: events not yet published are sent
        first, so the stream goes on exactly where the snapshot ends."""
        if self._engine is not None and self.kv_events:
            self._publish_kv(self._engine)
        return KVSnapshot(self.worker_id, self.seq, sorted(self.held))

    def close(self) -> None:
        self._sock.close()


def _fields(stats: EngineStats) -> dict[str, Any]:
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(EngineStats)}
