"""Fault injection on the lease protocol (issue 9.3), real NIXL / tcp on loopback.

Each case failed on the code before the protocol (checked against it): a lease could
expire mid-read and the read still reported success, a handle could be read twice, and a
read that could not be aborted was reported "anyway" and its blocks reused. The one thing
injected in each test is the fault itself (a slow or unstoppable transport); the servers,
side channel and transports around it are real.
"""

from __future__ import annotations

import time

import pytest
from kv_helpers import as_bytes, make_pool, wait_results

from pdserve.transfer.connector import RemoteKVConnector
from pdserve.transfer.messages import CompatRecord
from pdserve.transfer.server import KVServer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def endpoints(transport: str, lease_seconds: float = 30.0, timeout: float = 5.0):  # type: ignore[no-untyped-def]
    src, dst = make_pool(16, seed=3), make_pool(16, seed=None)
    server = KVServer(src, CompatRecord.for_pool(src, "m"), transport, lease_seconds=lease_seconds)
    conn = RemoteKVConnector(
        dst, CompatRecord.for_pool(dst, "m"), transport, transfer_timeout=timeout
    )
    return server, conn, src, dst


def slow_reads(conn: RemoteKVConnector, monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
    """The injected fault: every read progresses only after ``delay`` seconds."""
    real = conn.transport.check
    started: dict[int, float] = {}

    def check(op):  # type: ignore[no-untyped-def]
        t0 = started.setdefault(id(op), time.monotonic())
        return "PROC" if time.monotonic() - t0 < delay else real(op)

    monkeypatch.setattr(conn.transport, "check", check)


def test_lease_expiring_mid_read_is_not_used(transport: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    server, conn, src, _ = endpoints(transport, lease_seconds=0.5)
    try:
        slow_reads(conn, monkeypatch, delay=1.2)
        handle = server.make_handle("m", [4, 5, 6], 12, [])
        conn.start_load("m", handle, [4, 5, 6], [0, 1, 2])
        # The claimed lease expires on the prefill side's clock while the read is stalled;
        # its blocks are freed and reused by another request there.
        assert server.wait_released(3) == "m"
        assert "m" not in server.held_ids()
        src[:, :, 4:7] = 7.0
        (res,) = wait_results(conn, 1, timeout=5)
        assert not res.ok and "lease ended before the read was confirmed" in res.error, res
        assert res.num_bytes == 0  # nothing of it may enter the prefix cache
    finally:
        conn.close()
        server.close()


def test_handle_replayed_to_a_second_decode_worker_is_refused(transport: str) -> None:
    server, first, src, dst = endpoints(transport)
    dst2 = make_pool(16, seed=None)
    second = RemoteKVConnector(
        dst2, CompatRecord.for_pool(dst2, "m"), transport, transfer_timeout=5
    )
    try:
        handle = server.make_handle("r", [1, 2], 8, [])
        first.start_load("r", handle, [1, 2], [3, 4])
        (res,) = wait_results(first, 1, timeout=5)
        assert res.ok, res.error
        assert as_bytes(dst[:, :, [3, 4]]).equal(as_bytes(src[:, :, [1, 2]]))
        assert server.wait_released(2) == "r"  # done: ended at once, not at expiry
        second.start_load("r", handle, [1, 2], [3, 4])
        (res,) = wait_results(second, 1, timeout=5)
        assert not res.ok and "already ended (a kv handle is single-use)" in res.error, res.error
        assert not as_bytes(dst2).any(), "a replayed handle read KV"
        # While the first claim is live, a second claim is refused as a replay too.
        handle = server.make_handle("s", [3], 4, [])
        assert server.leases.claim("s", handle.nonce, first.agent_name) == ""
        second.start_load("s", handle, [3], [0])
        (res,) = wait_results(second, 1, timeout=5)
        assert not res.ok and "already claimed" in res.error, res.error
        assert server.release("s")
    finally:
        second.close()
        first.close()
        server.close()


def test_read_that_cannot_be_aborted_stays_quarantined(transport: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    server, conn, _, _ = endpoints(transport, timeout=0.4)
    try:
        monkeypatch.setattr(conn.transport, "check", lambda op: "PROC")  # never ends...
        monkeypatch.setattr(conn.transport, "abort", lambda op: False)  # ...nor stops
        conn.start_load("q", server.make_handle("q", [1], 4, []), [1], [0])
        (res,) = wait_results(conn, 1, timeout=3)
        assert not res.ok and res.quarantined and "could not be stopped" in res.error
        assert conn.quarantined() == 1
        time.sleep(1.0)  # well past two timeouts: the old code reused the blocks by now
        assert conn.unquarantined() == [] and conn.quarantined() == 1
        monkeypatch.setattr(conn.transport, "abort", lambda op: True)  # the transfer ended
        end = time.monotonic() + 3
        lifted: list[str] = []
        while not lifted and time.monotonic() < end:
            lifted = conn.unquarantined()
            time.sleep(0.01)
        assert lifted == ["q"] and conn.quarantined() == 0
        assert conn.pending() == 0
    finally:
        conn.close()
        server.close()
