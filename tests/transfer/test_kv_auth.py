"""The service secret on the KV side channel, and bounded tcp reads (issue 9.4).

Every refusal here is by a real side channel on loopback: a peer without the secret is
not answered, a prefill side without it is not believed (the decode side reads KV only
from peers that proved it), and a tcp read names a claimed lease and only its blocks.
"""

from __future__ import annotations

import logging

import pytest
import zmq
from kv_helpers import load_with, make_pool

from pdserve import env
from pdserve.protocol.codec import decode
from pdserve.transfer.base import TransferError
from pdserve.transfer.messages import (
    CompatRecord,
    HandshakeRequest,
    LeaseClaim,
    SideChannelError,
    TcpReadRequest,
)
from pdserve.transfer.server import KVServer
from pdserve.transfer.side_channel import call, handshake, request_frames
from pdserve.transfer.tcp_transport import TcpTransport

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.mark.parametrize(("server_secret", "decode_secret"), [("s1", "s2"), ("s1", ""), ("", "s1")])
def test_peers_without_the_same_secret_exchange_no_kv(
    transport: str, server_secret: str, decode_secret: str
) -> None:
    res, wrote = load_with(transport, server_secret, decode_secret)
    assert not res.ok and "did not prove the service secret" in res.error, res.error
    assert not wrote, "KV moved between peers that do not share the secret"


def test_same_secret_reads(transport: str) -> None:
    res, wrote = load_with(transport, "s1", "s1")
    assert res.ok and wrote, res.error


def test_claims_and_tcp_reads_are_refused_without_the_handshake() -> None:
    pool = make_pool(8, seed=1)
    server = KVServer(pool, CompatRecord.for_pool(pool, "m"), "tcp", secret="s")
    try:
        handle = server.make_handle("r", [1, 2], 8, [])
        with pytest.raises(TransferError, match="did not prove the service secret"):
            call(server.side_channel, LeaseClaim("r", handle.nonce, "x"), 2, secret="wrong")
        with pytest.raises(TransferError, match="'x' has not passed the handshake"):
            call(server.side_channel, LeaseClaim("r", handle.nonce, "x"), 2, secret="s")
        read = TcpReadRequest("r", handle.nonce, "x", [1, 2])
        with pytest.raises(TransferError, match="not blocks of a claimed lease"):
            call(server.side_channel, read, 2, secret="s")  # never claimed
        handshake(server.side_channel, "tcp", server.compat, "x", b"", 2, secret="s")
        assert call(server.side_channel, LeaseClaim("r", handle.nonce, "x"), 2, secret="s")
        other = TcpReadRequest("r", handle.nonce, "x", [1, 2, 5])  # block 5 is not the lease's
        with pytest.raises(TransferError, match="not blocks of a claimed lease"):
            call(server.side_channel, other, 2, secret="s")
        with pytest.raises(TransferError, match="not blocks of a claimed lease"):
            call(server.side_channel, TcpReadRequest("r", "forged", "x", [1]), 2, secret="s")
    finally:
        server.close()


def _unchecked_call(address: str, msg: object, secret: str) -> object:
    """A request sent as a pod without the secret would send it, its reply read without
    checking the reply's MAC (an attacker need not)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(request_frames(msg, secret)[1])
        assert sock.poll(5000, zmq.POLLIN), "no reply"
        return decode(bytes(sock.recv_multipart()[1]))
    finally:
        sock.close(linger=0)


def test_the_server_answers_nothing_to_a_request_without_the_secret() -> None:
    """The side channel's own check of each request (not the caller's check of the reply,
    which the other tests also hit): a handshake without the service secret's MAC, or
    under another secret, gets only the refusal, and its agent is never registered."""
    pool = make_pool(8, seed=1)
    server = KVServer(pool, CompatRecord.for_pool(pool, "m"), "tcp", secret="s")
    try:
        for secret in ("wrong", ""):
            hello = HandshakeRequest("tcp", "x", "", server.compat)
            got = _unchecked_call(server.side_channel, hello, secret)
            assert isinstance(got, SideChannelError) and "unauthenticated" in got.error, got
        handle = server.make_handle("r", [1, 2], 8, [])
        with pytest.raises(TransferError, match="'x' has not passed the handshake"):
            call(server.side_channel, LeaseClaim("r", handle.nonce, "x"), 2, secret="s")
    finally:
        server.close()


def test_tcp_reads_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_pool(8, seed=1)
    t = TcpTransport(pool, CompatRecord.for_pool(pool, "m"), "unit")
    for ids, words in [
        ([], "1 to 8"),
        (list(range(9)), "1 to 8"),
        ([1, 1], "none repeated"),
        ([1, 99], "out of range"),
    ]:
        (frame,) = t.serve(TcpReadRequest("r", "n", "a", ids)) or []
        assert words.encode() in frame, (ids, frame)
    monkeypatch.setattr("pdserve.transfer.tcp_transport.MAX_READ_BYTES", 1000)
    (frame,) = t.serve(TcpReadRequest("r", "n", "a", [1, 2])) or []
    assert b"over 1000 bytes" in frame


def test_no_secret_logs_one_warning(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(env.SERVICE_SECRET, raising=False)
    monkeypatch.setattr(env, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="pdserve.env"):
        assert env.service_secret("a") == "" and env.service_secret("b") == ""
    assert [r.message for r in caplog.records].count(
        f"{env.SERVICE_SECRET} is not set: a accepts unauthenticated internal requests and KV peers"
    ) == 1
    assert len(caplog.records) == 1
