"""The prefill worker's side channel: a ZeroMQ ROUTER that answers handshakes, lease
claims and dones and (tcp transport) block reads; plus the decode side's client calls.

A request is ``[b"", message, mac]`` (the DEALER's frames; the ROUTER sees the peer's
identity first); a reply is ``[b"", message, mac, *extra frames]``. With a service secret
(``PDSERVE_SERVICE_SECRET``) ``mac`` is HMAC-SHA256 under the side channel's own key derived
from it (pdserve/keys.py): of the request message, and of request + reply messages for a
reply, so a reply answers this very request. A request with a wrong mac is refused; a reply
with a wrong mac is not believed: the decode side reads KV only from peers that proved the
secret. The extra frames (tcp block data) carry their own MAC under the KV data key
(tcp_transport.py). While the secret rotates, ``secret`` is a tuple: the first signs, every
one is accepted. Without a secret the macs are empty and not checked. Every client call
uses a fresh socket with a deadline, so a dead or wedged peer costs a timeout, never a hang.
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

from pdserve import keys
from pdserve.env import service_secret
from pdserve.protocol.codec import CodecError, decode, encode
from pdserve.transfer.base import IncompatiblePeerError, PeerUnreachable, TransferError
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


Secret = str | tuple[str, ...]


def ring(secret: Secret, purpose: str = keys.SIDE_CHANNEL) -> keys.KeyRing:
    return keys.KeyRing(purpose, secret)


def mac(secret: Secret, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` (length-prefixed) under the side channel's key of the
    (signing) ``secret``; b"" without one."""
    return ring(secret).sign(*parts)


def request_frames(msg: object, secret: Secret) -> tuple[bytes, list[bytes]]:
    """(the encoded message, the frames a DEALER sends for it)."""
    payload = encode(msg)
    return payload, [b"", payload, mac(secret, payload)]


def open_reply(frames: list[Any], request: bytes, secret: Secret, address: str) -> list[Any]:
    """``[message, *extra]`` of a reply (frames as received, b"" first) whose mac checks."""
    raw = [bytes(f.buffer) if hasattr(f, "buffer") else bytes(f) for f in frames[:3]]
    if len(raw) < 3:
        raise TransferError(f"malformed reply from side channel {address}")
    keys_ = ring(secret)
    # Without a secret only an unsigned reply is believed: a peer that signs is not ours.
    if (keys_.verify(raw[2], request, raw[1]) is None) if keys_ else raw[2] != b"":
        raise TransferError(
            f"side channel {address} did not prove the service secret (PDSERVE_SERVICE_SECRET): "
            f"its reply is not trusted: {raw[1][:120]!r}"
        )
    return [raw[1], *frames[3:]]


class SideChannelServer:
    """ROUTER socket served by one daemon thread; ``handler(msg)`` returns the reply frames."""

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        secret: Secret = "",
    ) -> None:
        self._handler = handler
        self._ring = ring(secret)
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
            payload, given = frames[2], frames[3] if len(frames) > 3 else b""
            head, *extra = self._answer(payload, given)
            tag = self._ring.sign(payload, bytes(head))
            self._sock.send_multipart([frames[0], b"", head, tag, *extra], copy=False)
        self._sock.close(linger=0)

    def _answer(self, payload: bytes, given: bytes) -> list[Any]:
        if self._ring.verify(bytes(given), payload) is None:
            log.warning("side channel: refused a request without the service secret")
            err = "unauthenticated: the request does not carry the service secret's mac"
            return [encode(SideChannelError(err))]
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


def call(address: str, msg: object, timeout: float, secret: Secret) -> object:
    """Send ``msg`` to a side channel and return the decoded reply, or raise TransferError."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            raise TransferError(f"bad side channel address {address!r}: {exc}") from exc
        payload, frames = request_frames(msg, secret)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise PeerUnreachable(f"no reply from side channel {address} within {timeout:g}s")
        head = open_reply(sock.recv_multipart(), payload, secret, address)[0]
    finally:
        sock.close(linger=0)
    return decode_reply(head, address)


def decode_reply(head: bytes, address: str) -> object:
    try:
        reply: object = decode(head)
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
    return out + compat.mismatches(req.compat)


def handshake(
    address: str,
    transport: str,
    compat: CompatRecord,
    agent_name: str,
    metadata: bytes,
    timeout: float,
    secret: Secret,
) -> HandshakeReply:
    """Decode side: introduce ourselves; raise IncompatiblePeerError if refused."""
    req = HandshakeRequest(
        transport=transport,
        agent_name=agent_name,
        agent_metadata=base64.b64encode(metadata).decode(),
        compat=compat,
    )
    reply = call(address, req, timeout, secret)
    if isinstance(reply, HandshakeRefused):
        fields = ", ".join(reply.mismatches) or reply.error
        raise IncompatiblePeerError(
            f"prefill peer at {address} refused the KV handshake: {fields}", reply.mismatches
        )
    if not isinstance(reply, HandshakeReply):
        raise TransferError(f"unexpected handshake reply {type(reply).__name__} from {address}")
    return reply


def service_secrets(role: str) -> tuple[str, ...]:
    """The service secret and, while it rotates, the one also accepted (pdserve/keys.py);
    none where no secret is set (``role`` names the process in the refusal to start)."""
    return keys.secrets_from_env() if service_secret(role) else ()
