"""Transfers from a real prefill-side process on 127.0.0.1, and what happens when it dies."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from kv_helpers import PeerProcess, as_bytes, make_pool, wait_results

from pdserve.transfer.connector import RemoteKVConnector
from pdserve.transfer.load_state import LoadPhase
from pdserve.transfer.messages import CompatRecord, KVHandle

pytestmark = pytest.mark.cluster  # real peer processes (forked), transfers over UCX

TIMEOUT = 1.5  # transfer_timeout of these tests; results must come within it (+ slack)


def handle_for(peer: PeerProcess, rid: str, block_ids: list[int], transport: str) -> KVHandle:
    handle = peer.handle(rid, block_ids, len(block_ids) * 4 - 1)  # a lease the peer holds
    assert handle.transport == transport
    return handle


def freeze_peer_when_read_starts(conn: RemoteKVConnector, peer: PeerProcess, mp) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP the peer right after it granted the claim, as the READ is posted."""
    real = conn.transport.start_read

    def start_read(*args):  # type: ignore[no-untyped-def]
        os.kill(peer.proc.pid, signal.SIGSTOP)
        _until_stopped(peer.proc.pid)  # a signal lands later: the peer could answer first
        return real(*args)

    mp.setattr(conn.transport, "start_read", start_read)


def _until_stopped(pid: int, timeout: float = 5.0) -> None:
    """Until the kernel shows ``pid`` stopped (state T in /proc/PID/stat)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop in {timeout} s")


def connector(transport: str, blocks: int = 16) -> tuple[RemoteKVConnector, torch.Tensor]:
    dst = make_pool(blocks, seed=None)
    conn = RemoteKVConnector(
        dst, CompatRecord.for_pool(dst, "test-model"), transport, transfer_timeout=TIMEOUT
    )
    return conn, dst


def test_read_from_peer_process(transport: str) -> None:
    peer = PeerProcess(transport, blocks=40, seed=11)
    conn, dst = connector(transport)
    try:
        remote, local = [39, 0, 17, 18, 19, 5], [15, 2, 3, 4, 5, 9]
        conn.start_load("x1", handle_for(peer, "x1", remote, transport), remote, local)
        (res,) = wait_results(conn, 1, timeout=10)
        assert res.ok, res.error
        want = make_pool(40, seed=11)  # the peer filled its pool with the same seed
        assert torch.equal(as_bytes(dst[:, :, local]), as_bytes(want[:, :, remote]))
        assert peer.released(timeout=5) == "x1"
        assert conn.pending() == 0
    finally:
        conn.close()
        peer.close()
    assert peer.proc.returncode == 0


def test_peer_killed_before_the_read(transport: str) -> None:
    peer = PeerProcess(transport, blocks=8, seed=1)
    conn, dst = connector(transport)
    try:
        conn.start_load("a", handle_for(peer, "a", [1], transport), [1], [0])
        assert wait_results(conn, 1, timeout=10)[0].ok  # handshake done, peer cached
        hb, hc = handle_for(peer, "b", [2, 3], transport), handle_for(peer, "c", [2], transport)
        peer.proc.kill()
        peer.proc.wait()
        dst.zero_()
        t0 = time.monotonic()
        conn.start_load("b", hb, [2, 3], [1, 2])
        (res,) = wait_results(conn, 1, timeout=TIMEOUT + 3)
        assert not res.ok and res.error, res
        assert time.monotonic() - t0 < TIMEOUT + 1.0
        # Next request re-handshakes with the (dead) address and fails in bounded time too.
        conn.start_load("c", hc, [2], [3])
        (res,) = wait_results(conn, 1, timeout=TIMEOUT + 3)
        assert not res.ok and ("handshake" in res.error or "side channel" in res.error), res
        assert conn.pending() == 0
    finally:
        conn.close()
        peer.close()


def test_peer_frozen_during_the_read(transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGSTOP: the peer's process is alive but answers nothing (a hung or swapped-out node)."""
    peer = PeerProcess(transport, blocks=8, seed=1)
    conn, _ = connector(transport)
    try:
        conn.start_load("a", handle_for(peer, "a", [1], transport), [1], [0])
        assert wait_results(conn, 1, timeout=10)[0].ok
        freeze_peer_when_read_starts(conn, peer, monkeypatch)
        t0 = time.monotonic()
        conn.start_load("b", handle_for(peer, "b", [2, 3], transport), [2, 3], [1, 2])
        (res,) = wait_results(conn, 1, timeout=TIMEOUT + 3)
        elapsed = time.monotonic() - t0
        if transport == "tcp":
            assert not res.ok and "timed out" in res.error
        # A NIXL READ is one-sided: UCX may finish it from a stopped process's memory; it
        # must then be correct. Either way the result comes within the timeout.
        assert elapsed < TIMEOUT + 1.0
        assert conn.pending() == 0
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
        conn.close()
        peer.close()


@pytest.mark.parametrize("when", ["posted", "in_flight"])
def test_peer_killed_during_a_large_read(transport: str, when: str) -> None:
    blocks, head_dim = 2048, 256  # 64 MiB: long enough to be killed mid-read
    peer = PeerProcess(transport, blocks=blocks, seed=2, head_dim=head_dim)
    dst = make_pool(blocks, seed=None, head_dim=head_dim)
    conn = RemoteKVConnector(
        dst, CompatRecord.for_pool(dst, "test-model"), transport, transfer_timeout=TIMEOUT
    )
    try:
        conn.start_load("a", handle_for(peer, "a", [1], transport), [1], [0])
        assert wait_results(conn, 1, timeout=10)[0].ok
        dst.zero_()
        ids = list(range(blocks))[::-1]
        conn.start_load("big", handle_for(peer, "big", ids, transport), ids, list(range(blocks)))
        if when == "in_flight":  # wait until the transfer thread has the read in flight
            end = time.monotonic() + 2
            while conn.phase("big") is not LoadPhase.TRANSFERRING and time.monotonic() < end:
                time.sleep(0.0001)
        peer.proc.kill()
        t0 = time.monotonic()
        (res,) = wait_results(conn, 1, timeout=TIMEOUT + 3)
        assert time.monotonic() - t0 < TIMEOUT + 1.0
        if res.ok:  # finished before the kill landed: then it must be whole and exact
            want = make_pool(blocks, seed=2, head_dim=head_dim)
            assert torch.equal(as_bytes(dst), as_bytes(want[:, :, ids]))
        assert conn.pending() == 0
    finally:
        conn.close()
        peer.close()


def test_nixl_read_hung_on_frozen_peer_is_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    """With UCX limited to TCP the READ needs the peer's progress thread, so a SIGSTOPped
    peer really hangs it: the connector must time out, abort the transfer and report."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by UCX when the agents are created
    peer = PeerProcess("nixl", blocks=8, seed=1, env={"UCX_TLS": "tcp"})
    conn, dst = connector("nixl")
    try:
        conn.start_load("a", handle_for(peer, "a", [1], "nixl"), [1], [0])
        assert wait_results(conn, 1, timeout=10)[0].ok
        freeze_peer_when_read_starts(conn, peer, monkeypatch)
        t0 = time.monotonic()
        conn.start_load("b", handle_for(peer, "b", [2, 3], "nixl"), [2, 3], [1, 2])
        (res,) = wait_results(conn, 1, timeout=3 * TIMEOUT + 3)
        assert not res.ok, res
        assert time.monotonic() - t0 < TIMEOUT + 1.0
        assert conn.pending() == 0
        if "no reply from side channel" in res.error:
            # A race of the test's own: UCX finished the READ before the stop took hold. The
            # frozen peer cannot confirm it intact (LeaseDone gets no reply): still a failure.
            return
        assert "timed out" in res.error, res
        # The aborted READ must not land later, when the peer wakes up: the engine has
        # been told the blocks are free.
        os.kill(peer.proc.pid, signal.SIGCONT)
        time.sleep(0.5)
        assert not as_bytes(dst[:, :, 1:3]).any()
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
        conn.close()
        peer.close()
