"""KV transport over plain ZeroMQ: the fallback where NIXL is not installed.

The decode side sends ``TcpReadRequest(lease, block_ids)`` to the prefill worker's side
channel (signed like every side-channel request); the prefill side serves only blocks of a
lease that agent claimed (``KVServer``), at most ``MAX_READ_BYTES`` and never a block twice,
gathers ``pool[:, :, block_ids]`` into one contiguous buffer and replies with
``TcpReadReply`` plus one raw data frame and its MAC (HMAC-SHA256 under the KV data key,
pdserve/keys.py, over the request and the data): the decode side checks the MAC before a
byte enters its pool, then scatters the frame into its local blocks.
Each read uses its own DEALER socket, so a dead peer costs one socket, never a wedged one.
Two copies and a TCP hop make it several times slower than NIXL; it exists for portability.
"""

from __future__ import annotations

import hmac
import warnings
from typing import Any

import torch
import zmq

from pdserve import keys
from pdserve.protocol.codec import CodecError, decode, encode
from pdserve.transfer.base import KVTransport, LeaseRef, PeerInfo, ReadOp, State, TransferError
from pdserve.transfer.messages import SideChannelError, TcpReadReply, TcpReadRequest
from pdserve.transfer.side_channel import open_reply, request_frames, ring
from pdserve.transfer.staging import PinnedStaging

MAX_READ_BYTES = 4 << 30  # one tcp read's reply; a larger request is refused


def data_mac(key: bytes, head: bytes, data: Any) -> bytes:
    """HMAC-SHA256 of a reply's head (which names the request) and its data frame, read in
    place (the data can be gigabytes: no copy); b"" without a key."""
    if not key:
        return b""
    h = hmac.new(key, len(head).to_bytes(8, "big") + bytes(head), "sha256")
    h.update(memoryview(data).cast("B"))
    return h.digest()


class _TcpOp(ReadOp):
    def __init__(
        self, request_id: str, num_bytes: int, sock: zmq.Socket, local_ids: list[int], sent: bytes
    ):
        super().__init__(request_id, num_bytes)
        self.sent = sent  # the request message: the reply's mac covers it
        self.sock: zmq.Socket | None = sock
        self.local_ids = local_ids
        self.state: State = "PROC"


class TcpTransport(KVTransport):
    name = "tcp"

    def open(self) -> None:
        # A CUDA pool's bytes cross to the host through one reusable pinned buffer.
        self._staging = PinnedStaging() if self.pool.is_cuda else None

    def metadata(self) -> bytes:
        return b""

    # --- prefill side ---------------------------------------------------------------------

    def serve(self, msg: object) -> list[Any] | None:
        if not isinstance(msg, TcpReadRequest):
            return None
        err = self._refusal(msg.block_ids)
        if err:
            return [encode(SideChannelError(f"tcp read {msg.request_id}: {err}"))]
        idx = torch.tensor(msg.block_ids, dtype=torch.long, device=self.pool.device)
        data = self._planes().index_select(1, idx)
        if self._staging is not None:  # a CUDA pool: through the pinned buffer
            raw = self._staging.to_host(data)
        else:
            raw = data.view(torch.uint8).reshape(-1).numpy()
        head = encode(TcpReadReply(msg.request_id, int(raw.nbytes)))
        return [head, raw, data_mac(ring(self.secret, keys.KV_DATA).signing, head, raw)]

    def _refusal(self, ids: list[int]) -> str:
        n = self.geometry.num_blocks
        if not ids or len(ids) > n or len(set(ids)) != len(ids):
            return f"{len(ids)} block ids: need 1 to {n}, none repeated"
        if self.geometry.request_bytes(len(ids)) > MAX_READ_BYTES:
            return f"{len(ids)} blocks are over {MAX_READ_BYTES} bytes"
        bad = [b for b in ids if not 0 <= b < n]
        return f"block ids {bad[:8]} out of range [0, {n})" if bad else ""

    def _planes(self) -> torch.Tensor:
        """The pool as ``[layers * planes, blocks, block elements]``: index_select/index_copy_ over
        the middle dim of this view are several times faster than over dim 2 of the 6-d pool."""
        layers, kv, blocks = self.pool.shape[:3]
        return self.pool.view(layers * kv, blocks, -1)

    # --- decode side ----------------------------------------------------------------------

    def add_peer(self, peer: PeerInfo) -> None:
        pass  # nothing to set up: every read connects to the peer's side channel

    def remove_peer(self, agent_name: str) -> None:
        pass

    def start_read(
        self, lease: LeaseRef, peer: PeerInfo, remote_ids: list[int], local_ids: list[int]
    ) -> ReadOp:
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(peer.side_channel)
        req = TcpReadRequest(lease.request_id, lease.nonce, lease.agent_name, list(remote_ids))
        sent, frames = request_frames(req, self.secret)
        sock.send_multipart(frames)
        num_bytes = self.geometry.request_bytes(len(local_ids))
        return _TcpOp(lease.request_id, num_bytes, sock, local_ids, sent)

    def check(self, op: ReadOp) -> State:
        assert isinstance(op, _TcpOp)
        if op.sock is None or not op.sock.poll(0, zmq.POLLIN):
            return op.state
        frames = op.sock.recv_multipart(copy=False)
        try:
            self._receive(op, open_reply(frames, op.sent, self.secret, "tcp read"))
            op.state = "DONE"
        except (TransferError, CodecError) as exc:
            op.error, op.state = str(exc), "ERR"
        self._close(op)
        return op.state

    def _receive(self, op: _TcpOp, frames: list[Any]) -> None:
        head: object = decode(frames[0])
        if isinstance(head, SideChannelError):
            raise TransferError(head.error)
        if not isinstance(head, TcpReadReply) or len(frames) != 3:
            raise TransferError(f"tcp read: unexpected reply {type(head).__name__}")
        if head.num_bytes != op.num_bytes or len(frames[1].buffer) != op.num_bytes:
            raise TransferError(f"tcp read: got {head.num_bytes} bytes, expected {op.num_bytes}")
        data_ring = ring(self.secret, keys.KV_DATA)
        if data_ring and not any(
            hmac.compare_digest(bytes(frames[2].buffer), data_mac(k, frames[0], frames[1].buffer))
            for k in data_ring.keys
        ):  # before a byte enters the pool: a frame altered on the wire is never used
            raise TransferError("tcp read: the data frame's MAC does not check (altered?)")
        planes = self._planes()
        with warnings.catch_warnings():  # the zmq frame is read-only; we only read it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(frames[1].buffer, dtype=torch.uint8)
        shape = (planes.shape[0], len(op.local_ids), planes.shape[2])
        if self._staging is not None:
            raw = self._staging.to_device(raw, self.pool.device)
        data = raw.view(self.pool.dtype).view(shape)
        idx = torch.tensor(op.local_ids, dtype=torch.long, device=self.pool.device)
        planes.index_copy_(1, idx, data)

    def abort(self, op: ReadOp) -> bool:
        assert isinstance(op, _TcpOp)
        if op.state == "PROC":
            op.error, op.state = "aborted", "ERR"
        self._close(op)
        return True  # the data is only written in check(), on this thread

    @staticmethod
    def _close(op: _TcpOp) -> None:
        if op.sock is not None:
            op.sock.close(linger=0)
            op.sock = None

    def close(self) -> None:
        pass
