"""Publishes the prefill worker's KV events on a ZeroMQ PUB socket."""

from __future__ import annotations

import zmq

from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.codec import encode
from pdserve.protocol.kv_events import TOPIC, KVEvent


class KVEventPublisher:
    """Runs as an engine hook: the socket is used from the engine thread only."""

    def __init__(self, bind: str, worker_id: str) -> None:
        self.worker_id = worker_id
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.bind(bind)
        self.seq = 0

    def hook(self, engine: LLMEngine) -> None:
        for kind, hashes in engine.drain_kv_events():
            self.seq += 1
            event = KVEvent(kind, self.worker_id, self.seq, hashes)
            self._sock.send_multipart([TOPIC, encode(event)])

    def close(self) -> None:
        self._sock.close()
