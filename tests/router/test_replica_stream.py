"""The worker side of the event stream (worker/core/events.py): load reports at least
every 100 ms and when the counters change (at most every 10 ms), KV events with their
seq, and a snapshot that flushes pending events first, so the stream goes on exactly
after it. Over a real PUB socket, read back with a SUB socket."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import zmq

from pdserve.protocol.codec import decode
from pdserve.protocol.contract import EngineStats
from pdserve.protocol.kv_events import KVEvent, LoadReport
from pdserve.worker.core import events as ev_mod
from pdserve.worker.core.events import KVEventPublisher

pytestmark = pytest.mark.unit


class Engine:
    """What the publisher reads of LLMEngine: its KV events and its counters."""

    def __init__(self) -> None:
        self.events: list[tuple[str, list[int]]] = []
        self.running = 0

    def drain_kv_events(self) -> list[tuple[str, list[int]]]:
        out, self.events = self.events, []
        return out

    def drain_tier_events(self) -> list[tuple[str, str, list[int]]]:
        return []  # no KV tiers (their events: tests/engine/test_kv_tiers_engine.py)

    def stats(self) -> EngineStats:
        return EngineStats(running=self.running, kv_blocks_free=7, kv_blocks_total=9)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def connected(ctx: zmq.Context[Any], eng: Engine, kv: bool = True) -> Any:
    """A publisher and a SUB socket that receives it (reports until one lands)."""
    port = free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", "p0", eng, kv_events=kv)  # type: ignore[arg-type]
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    deadline = time.monotonic() + 30
    while not sub.poll(120):
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        pub.hook(eng)  # type: ignore[arg-type]  # a report every 100 ms while nothing changes
    while sub.poll(200):
        sub.recv_multipart()
    return pub, sub


@pytest.fixture
def stream() -> Any:
    ctx = zmq.Context()
    eng = Engine()
    pub, sub = connected(ctx, eng)
    pub.num_reports = 0
    yield eng, pub, sub
    pub.close()
    sub.close(linger=0)
    ctx.term()


def read(sub: zmq.Socket[bytes], timeout_s: float = 2.0) -> list[tuple[bytes, Any]]:
    out: list[tuple[bytes, Any]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sub.poll(50):
            if out:
                break
            continue
        topic, *bodies = sub.recv_multipart()
        out += [(topic, decode(b, KVEvent if topic == b"kv" else LoadReport)) for b in bodies]
    return out


def test_one_message_per_engine_step(stream: Any) -> None:
    """A step's KV events leave as one message, one frame per event in seq order."""
    eng, pub, sub = stream
    eng.events = [("stored", [1, 2]), ("stored", [3]), ("removed", [1])]
    pub.hook(eng)
    msgs = []
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and not any(m[0] == b"kv" for m in msgs):
        if sub.poll(50):
            msgs.append(sub.recv_multipart())
    kv = [m for m in msgs if m[0] == b"kv"]
    assert len(kv) == 1 and len(kv[0]) == 4, msgs
    assert [decode(b, KVEvent).seq for b in kv[0][1:]] == [1, 2, 3]


def test_events_reports_and_snapshot(stream: Any) -> None:
    eng, pub, sub = stream
    eng.events = [("stored", [1, 2, 3]), ("removed", [2])]
    eng.running = 2  # changed counters: a report goes with the events
    time.sleep(0.02)
    pub.hook(eng)
    got = read(sub)
    assert [(t, m.seq if t == b"kv" else m.kv_seq) for t, m in got] == [
        (b"kv", 1),
        (b"kv", 2),
        (b"stats", 2),
    ]
    rep = got[-1][1]
    assert rep.worker_id == "p0" and rep.kv_blocks_free == 7 and rep.running == 2
    # Pending events are published before the snapshot answers: it is as of their seq.
    eng.events = [("stored", [4])]
    snap = pub.snapshot()
    assert (snap.seq, snap.block_hashes) == (3, [1, 3, 4])
    assert [(t, m.seq) for t, m in read(sub)] == [(b"kv", 3)]
    eng.events = [("cleared", [])]
    assert pub.snapshot().block_hashes == [] and pub.seq == 4


def test_report_rate(stream: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    eng, pub, _ = stream
    now = [time.monotonic() + 100.0]
    monkeypatch.setattr(ev_mod.time, "monotonic", lambda: now[0])
    pub.hook(eng)
    assert pub.num_reports == 1
    for _ in range(5):  # unchanged: one more only once 100 ms have passed
        now[0] += 0.03
        pub.hook(eng)
    assert pub.num_reports == 2
    eng.running = 1  # changed: reported at once
    now[0] += 0.001
    pub.hook(eng)
    assert pub.num_reports == 3
    eng.running = 2
    now[0] += 0.005  # changed again, but within 10 ms of the last report
    pub.hook(eng)
    assert pub.num_reports == 3
    now[0] += 0.006
    pub.hook(eng)
    assert pub.num_reports == 4


def test_decode_stream_has_no_kv_events() -> None:
    ctx = zmq.Context()
    eng = Engine()
    pub, sub = connected(ctx, eng, kv=False)
    try:
        eng.events = [("stored", [1])]  # a decode engine records none; ignored if it did
        eng.running = 3
        time.sleep(0.02)
        pub.hook(eng)
        assert [(t, m.running) for t, m in read(sub)] == [(b"stats", 3)]
    finally:
        pub.close()
        sub.close(linger=0)
        ctx.term()


def test_a_taken_default_port_falls_back_to_any_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(zmq.ZMQError):  # a port given on purpose must be that port
            KVEventPublisher(f"tcp://127.0.0.1:{port}", "d0", kv_events=False)
        pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", "d0", kv_events=False, any_port=True)
        try:
            assert pub.port != port and pub.port > 0
        finally:
            pub.close()
