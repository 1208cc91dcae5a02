"""Handshake: compatible peers are accepted once; incompatible ones refused, fields named."""

from __future__ import annotations

import dataclasses

import pytest
import zmq
from kv_helpers import as_bytes, make_pool, wait_results

from pdserve import env
from pdserve.protocol.codec import encode
from pdserve.transfer.base import IncompatiblePeerError, TransferError
from pdserve.transfer.connector import RemoteKVConnector
from pdserve.transfer.messages import CompatRecord, HandshakeReply, LeaseClaim
from pdserve.transfer.server import KVServer
from pdserve.transfer.side_channel import call, handshake

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compatibility, not authentication (that is tests/transfer/test_kv_auth.py): both ends
    of every handshake here run without the suite's service secret."""
    monkeypatch.delenv(env.SERVICE_SECRET, raising=False)


@pytest.fixture
def server(transport: str):
    pool = make_pool(8, seed=3)
    srv = KVServer(pool, CompatRecord.for_pool(pool, "model-a"), transport=transport)
    yield srv
    srv.close()


def test_accepted_reply_describes_the_pool(server: KVServer, transport: str) -> None:
    reply = handshake(server.side_channel, transport, server.compat, "d", b"", timeout=2, secret="")
    assert isinstance(reply, HandshakeReply)
    assert reply.agent_name == server.agent_name and reply.num_blocks == 8
    assert reply.mem_type == "DRAM" and reply.base_addr == server.transport.geometry.base_addr
    assert bool(reply.agent_metadata) == (transport == "nixl")


@pytest.mark.parametrize(
    ("change", "fields"),
    [
        ({"block_size": 8}, ["block_size: 4 != 8"]),
        ({"model": "model-b", "dtype": "bfloat16"}, ["model: 'model-a' != 'model-b'", "dtype"]),
        (
            {"num_layers": 3, "num_kv_heads": 4, "head_dim": 16},
            ["num_layers", "num_kv_heads", "head_dim"],
        ),
        ({"kv_layout": "LNKBHD"}, ["kv_layout"]),
    ],
)
def test_mismatch_refused_naming_fields(server: KVServer, transport: str, change, fields) -> None:
    theirs = dataclasses.replace(server.compat, **change)
    with pytest.raises(IncompatiblePeerError) as info:
        handshake(server.side_channel, transport, theirs, "d", b"", timeout=2, secret="")
    for name in fields:
        assert name in str(info.value)
    assert len(info.value.mismatches) == len(change)


def test_transport_mismatch_refused(server: KVServer, transport: str) -> None:
    other = "tcp" if transport == "nixl" else "nixl"
    with pytest.raises(IncompatiblePeerError, match=f"transport: '{transport}' != '{other}'"):
        handshake(server.side_channel, other, server.compat, "d", b"", timeout=2, secret="")


def test_connector_reports_refusal_and_reads_nothing(server: KVServer, transport: str) -> None:
    dst = make_pool(8, seed=None, block_size=4, head_dim=16)
    conn = RemoteKVConnector(
        dst, CompatRecord.for_pool(dst, "model-a"), transport, transfer_timeout=3
    )
    try:
        conn.start_load("r", server.make_handle("r", [1, 2], 8, []), [1, 2], [0, 1])
        (res,) = wait_results(conn, 1, timeout=5)
        assert not res.ok and "refused the KV handshake: head_dim: 8 != 16" in res.error
        assert not as_bytes(dst).any()
        # Never claimed: the lease stays until it times out on the prefill side.
        assert server.wait_released(0.3) is None and "r" in server.held_ids()
    finally:
        conn.close()


def test_garbage_and_unserved_messages_get_errors(server: KVServer, transport: str) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.side_channel)
    sock.send_multipart([b"", b"not json"])
    assert sock.poll(2000)
    assert b"bad side-channel message" in sock.recv_multipart()[1]  # [b"", reply, mac]
    sock.close()
    # A reply message sent as a request is answered with an error, not a crash.
    with pytest.raises(TransferError, match="not served by a"):
        call(
            server.side_channel,
            HandshakeReply(transport, "x", "", 1, "DRAM", 0, 0),
            timeout=2,
            secret="",
        )
    # ...and the side channel still works afterwards: a claim from an agent that never
    # passed the handshake is refused by name.
    server.make_handle("r1", [1], 4, [])
    with pytest.raises(TransferError, match="'d' has not passed the handshake"):
        call(server.side_channel, LeaseClaim("r1", "n", "d"), timeout=2, secret="")
    assert server.release("r1") and server.wait_released(1) == "r1"


def test_unreachable_side_channel_times_out() -> None:
    ctx_sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = ctx_sock.bind_to_random_port("tcp://127.0.0.1")
    ctx_sock.close()  # nobody listens there now
    compat = CompatRecord("m", "float32", 4, 2, 2, 8)
    with pytest.raises(TransferError, match="no reply from side channel"):
        handshake(f"tcp://127.0.0.1:{port}", "tcp", compat, "d", b"", timeout=0.3, secret="")
    assert encode(compat)


def test_side_channel_port_in_use_is_a_clear_error(server: KVServer, transport: str) -> None:
    pool = make_pool(4, seed=None)
    with pytest.raises(
        TransferError, match=f"cannot bind the KV side channel on 127.0.0.1:{server.port}"
    ):
        KVServer(pool, CompatRecord.for_pool(pool, "m"), transport=transport, port=server.port)
