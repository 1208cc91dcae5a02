"""The prefill side of the KV hand-off: a transport plus the side channel that serves it.

The prefill worker starts one ``KVServer`` with its KV pool at start-up. It answers
handshakes (refusing incompatible peers), serves tcp reads, and delivers lease releases:
to ``on_release(request_id)`` if given (called on the side-channel thread — keep it short
and thread-safe), else into a queue drained with ``released()``. Leases themselves (which
blocks, when they expire) stay with the worker's lease manager.
"""

from __future__ import annotations

import base64
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.codec import encode
from pdserve.transfer.messages import (
    CompatRecord,
    HandshakeRefused,
    HandshakeReply,
    HandshakeRequest,
    KVHandle,
    LeaseRelease,
    LeaseReleaseAck,
    SideChannelError,
)
from pdserve.transfer.registry import make_transport, new_agent_name
from pdserve.transfer.side_channel import SideChannelServer, answer_handshake

log = logging.getLogger(__name__)


class KVServer:
    def __init__(
        self,
        pool: torch.Tensor,
        compat: CompatRecord,
        transport: str = "nixl",
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        agent_name: str | None = None,
        on_release: Callable[[str], None] | None = None,
    ) -> None:
        if host == "0.0.0.0" and advertise_host is None:
            raise ValueError("KVServer bound to 0.0.0.0 needs advertise_host (the pod/host IP)")
        self.agent_name = agent_name or new_agent_name("prefill")
        self.compat = compat
        self.transport = make_transport(transport, pool, compat, self.agent_name)
        self._on_release = on_release
        self._released: queue.Queue[str] = queue.Queue()
        try:
            self._server = SideChannelServer(self._handle, host, port, advertise_host)
        except Exception:
            self.transport.close()
            raise
        self.side_channel = self._server.address
        self.port = self._server.port

    @property
    def transport_name(self) -> str:
        return self.transport.name

    def make_handle(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        block_hashes: list[int],
        lease_seconds: float = 30.0,
    ) -> KVHandle:
        """The handle returned with the first token; the worker starts the lease."""
        handle = KVHandle(
            request_id=request_id,
            agent_name=self.agent_name,
            side_channel=self.side_channel,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            block_hashes=list(block_hashes),
            block_size=self.compat.block_size,
            lease_expires_at=time.time() + lease_seconds,
            transport=self.transport.name,
        )
        handle.validate()
        return handle

    def released(self) -> list[str]:
        """Request ids whose lease the decode side released since the last call."""
        out = []
        while True:
            try:
                out.append(self._released.get_nowait())
            except queue.Empty:
                return out

    def wait_released(self, timeout: float) -> str | None:
        """Block up to ``timeout`` s for the next released request id (tests, tools)."""
        try:
            return self._released.get(timeout=timeout)
        except queue.Empty:
            return None

    def _handle(self, msg: object) -> list[Any]:
        if isinstance(msg, HandshakeRequest):
            return [encode(self._handshake(msg))]
        if isinstance(msg, LeaseRelease):
            if self._on_release is not None:
                self._on_release(msg.request_id)
            else:
                self._released.put(msg.request_id)
            return [encode(LeaseReleaseAck(msg.request_id))]
        frames = self.transport.serve(msg)
        if frames is None:
            err = f"{type(msg).__name__} is not served by a {self.transport.name} side channel"
            return [encode(SideChannelError(err))]
        return frames

    def _handshake(self, req: HandshakeRequest) -> HandshakeReply | HandshakeRefused:
        mismatches = answer_handshake(req, self.compat, self.transport.name)
        if mismatches:
            log.warning("refused KV peer %s: %s", req.agent_name, "; ".join(mismatches))
            return HandshakeRefused("incompatible KV peers (prefill != decode)", mismatches)
        geo = self.transport.geometry
        return HandshakeReply(
            transport=self.transport.name,
            agent_name=self.agent_name,
            agent_metadata=base64.b64encode(self.transport.metadata()).decode(),
            num_blocks=geo.num_blocks,
            mem_type=geo.mem_type,
            device_id=geo.device_id,
            base_addr=geo.base_addr,
        )

    def close(self) -> None:
        self._server.close()
        self.transport.close()
