"""The prefill worker's side channel: a ZeroMQ ROUTER that answers handshakes, lease
releases and (tcp transport) block reads; plus the decode side's client calls.

Frames are ``[identity, b"", codec message, *extra frames]`` on the server and
``[b"", codec message, *extra]`` on the client's DEALER socket. Every client call uses a
fresh socket with a deadline, so a dead or wedged peer costs a timeout, never a hang.
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

from pdserve.codec import CodecError, decode, encode
from pdserve.transfer.base import IncompatiblePeerError, TransferError
from pdserve.transfer.messages import (
    SIDE_CHANNEL_VERSION,
    CompatRecord,
    HandshakeRefused,
    HandshakeReply,
    HandshakeRequest,
    SideChannelError,
)

log = logging.getLogger(__name__)

Handler = Callable[[object], list[Any]]


class SideChannelServer:
    """ROUTER socket served by one daemon thread; ``handler(msg)`` returns the reply frames."""

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        self._handler = handler
        self._sock: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise TransferError(f"cannot bind the KV side channel on {host}:{port}: {exc}") from exc
        self.port = port
        self.address = f"tcp://{advertise_host or host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-side-channel", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50, zmq.POLLIN):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) < 3:
                continue  # not one of ours; nobody to answer sensibly
            reply = self._answer(frames[2])
            self._sock.send_multipart([frames[0], b"", *reply], copy=False)
        self._sock.close(linger=0)

    def _answer(self, payload: bytes) -> list[Any]:
        try:
            return self._handler(decode(payload))
        except CodecError as exc:
            return [encode(SideChannelError(f"bad side-channel message: {exc}"))]
        except Exception as exc:  # a bad request must never take the side channel down
            log.exception("side channel handler failed")
            return [encode(SideChannelError(f"side channel error: {exc}"))]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def call(address: str, msg: object, timeout: float) -> object:
    """Send ``msg`` to a side channel and return the decoded reply, or raise TransferError."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            raise TransferError(f"bad side channel address {address!r}: {exc}") from exc
        sock.send_multipart([b"", encode(msg)])
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise TransferError(f"no reply from side channel {address} within {timeout:g}s")
        frames = sock.recv_multipart()
    finally:
        sock.close(linger=0)
    try:
        reply: object = decode(frames[-1])
    except CodecError as exc:
        raise TransferError(f"bad reply from side channel {address}: {exc}") from exc
    if isinstance(reply, SideChannelError):
        raise TransferError(f"side channel {address}: {reply.error}")
    return reply


def answer_handshake(req: HandshakeRequest, compat: CompatRecord, transport: str) -> list[str]:
    """The prefill side's verdict: an empty list, or one ``field: ours != theirs`` per field."""
    out = []
    if req.version != SIDE_CHANNEL_VERSION:
        out.append(f"version: {SIDE_CHANNEL_VERSION!r} != {req.version!r}")
    if req.transport != transport:
        out.append(f"transport: {transport!r} != {req.transport!r}")
    return out + compat.mismatches(req.compat_record())


def handshake(
    address: str,
    transport: str,
    compat: CompatRecord,
    agent_name: str,
    metadata: bytes,
    timeout: float,
) -> HandshakeReply:
    """Decode side: introduce ourselves; raise IncompatiblePeerError if refused."""
    req = HandshakeRequest(
        transport=transport,
        agent_name=agent_name,
        agent_metadata=base64.b64encode(metadata).decode(),
        compat=_plain(compat),
    )
    reply = call(address, req, timeout)
    if isinstance(reply, HandshakeRefused):
        fields = ", ".join(reply.mismatches) or reply.error
        raise IncompatiblePeerError(
            f"prefill peer at {address} refused the KV handshake: {fields}", reply.mismatches
        )
    if not isinstance(reply, HandshakeReply):
        raise TransferError(f"unexpected handshake reply {type(reply).__name__} from {address}")
    return reply


def _plain(compat: CompatRecord) -> dict[str, object]:
    from dataclasses import asdict

    return asdict(compat)
