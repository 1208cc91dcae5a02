"""The prefill side of the KV hand-off: the engine's ``KVHolder`` over a transport.

The prefill worker attaches one ``KVServer`` to its engine (``engine.attach_holder``).
It owns, in one object, what the decode side's ``RemoteKVConnector`` mirrors: the
blocks of handed-off requests, their leases (``transfer/leases.py``: the one lease clock)
and the side channel that serves them — handshakes (refusing incompatible peers and
peers without the service secret), lease claims and dones, and tcp reads of claimed
blocks only. Side-channel requests arrive on its thread; ``hold``/``freed`` run on the
engine thread (docs/kv_transfer.md).
"""

from __future__ import annotations

import base64
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

import torch

from pdserve.engine.kv_connector import KVHolder
from pdserve.protocol.codec import encode
from pdserve.transfer.leases import LeaseTable
from pdserve.transfer.messages import (
    CompatRecord,
    HandshakeRefused,
    HandshakeReply,
    HandshakeRequest,
    KVHandle,
    LeaseClaim,
    LeaseClaimed,
    LeaseDone,
    LeaseDoneAck,
    SideChannelError,
    TcpReadRequest,
)
from pdserve.transfer.registry import DEFAULT_LEASE_SECONDS, new_agent_name, transport_class
from pdserve.transfer.side_channel import SideChannelServer, answer_handshake, service_secrets

log = logging.getLogger(__name__)


class KVServer(KVHolder):
    def __init__(
        self,
        pool: torch.Tensor,
        compat: CompatRecord,
        transport: str = "nixl",
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        agent_name: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        on_expired: Callable[[str], None] | None = None,
        secret: str | tuple[str, ...] | None = None,
    ) -> None:
        if host == "0.0.0.0" and advertise_host is None:
            raise ValueError("KVServer bound to 0.0.0.0 needs advertise_host (the pod/host IP)")
        self.agent_name = agent_name or new_agent_name("prefill")
        self.compat = compat
        self.secret = service_secrets("the KV side channel") if secret is None else secret
        self.transport = transport_class(transport)(
            pool, compat, self.agent_name, secret=self.secret
        )
        self.leases = LeaseTable(lease_seconds, on_expired)
        self._peers: set[str] = set()  # decode agents that passed the handshake
        self._peers_lock = threading.Lock()
        try:
            self._server = SideChannelServer(
                self._handle, host, port, advertise_host, secret=self.secret
            )
        except Exception:
            self.transport.close()
            raise
        self.side_channel = self._server.address
        self.port = self._server.port

    @property
    def transport_name(self) -> str:
        return self.transport.name

    # --- KVHolder (engine thread) ----------------------------------------------------------

    def hold(
        self, request_id: str, block_ids: list[int], num_tokens: int, block_hashes: list[int]
    ) -> KVHandle:
        n = -(-num_tokens // self.compat.block_size)
        return self.make_handle(request_id, block_ids[:n], num_tokens, block_hashes, held=block_ids)

    def release(self, request_id: str) -> bool:
        return self.leases.end(request_id)

    def freed(self) -> list[list[int]]:
        return [blocks for _, blocks in self.leases.ended()]

    def held_ids(self) -> set[str]:
        return self.leases.held_ids()

    def make_handle(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        block_hashes: list[int],
        lease_seconds: float | None = None,
        held: list[int] | None = None,
    ) -> KVHandle:
        """Start a lease on ``held`` (default ``block_ids``) and return its handle."""
        ttl = self.leases.ttl_s if lease_seconds is None else lease_seconds
        handle = KVHandle(
            request_id=request_id,
            agent_name=self.agent_name,
            side_channel=self.side_channel,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            block_hashes=list(block_hashes),
            block_size=self.compat.block_size,
            nonce=secrets.token_hex(16),
            lease_ttl_s=ttl,
            transport=self.transport.name,
        )
        handle.validate()
        self.leases.add(request_id, handle.nonce, held if held is not None else block_ids, ttl)
        return handle

    def released(self) -> list[str]:
        """Request ids whose lease ended since the last call (tools that hold no engine)."""
        return [rid for rid, _ in self.leases.ended()]

    def wait_released(self, timeout: float) -> str | None:
        """Block up to ``timeout`` s for the next ended lease's request id (tests, tools)."""
        ended = self.leases.wait_ended(timeout)
        return ended[0] if ended is not None else None

    # --- side channel (its thread) ---------------------------------------------------------

    def _handle(self, msg: object) -> list[Any]:
        if isinstance(msg, HandshakeRequest):
            return [encode(self._handshake(msg))]
        if isinstance(msg, LeaseClaim):
            return [encode(self._claim(msg))]
        if isinstance(msg, LeaseDone):
            intact = self.leases.done(msg.request_id, msg.nonce, msg.agent_name, msg.ok)
            err = "" if intact else "the lease ended before the read was confirmed"
            return [encode(LeaseDoneAck(msg.request_id, intact, err if msg.ok else ""))]
        if isinstance(msg, TcpReadRequest):
            return self._tcp_read(msg)
        err = f"{type(msg).__name__} is not served by a {self.transport.name} side channel"
        return [encode(SideChannelError(err))]

    def _claim(self, msg: LeaseClaim) -> LeaseClaimed | SideChannelError:
        with self._peers_lock:
            known = msg.agent_name in self._peers
        if not known:
            return SideChannelError(f"agent {msg.agent_name!r} has not passed the handshake")
        err = self.leases.claim(msg.request_id, msg.nonce, msg.agent_name)
        if err:
            log.warning("refused a lease claim by %s: %s", msg.agent_name, err)
            return SideChannelError(err)
        return LeaseClaimed(msg.request_id, self.leases.ttl_s)

    def _tcp_read(self, msg: TcpReadRequest) -> list[Any]:
        """Serve only blocks of a lease this agent claimed: never arbitrary ids."""
        claimed = self.leases.claimed_blocks(msg.request_id, msg.nonce, msg.agent_name)
        if claimed is None or not set(msg.block_ids) <= set(claimed):
            err = f"tcp read {msg.request_id}: not blocks of a claimed lease"
            return [encode(SideChannelError(err))]
        return self.transport.serve(msg) or [encode(SideChannelError("not served"))]

    def _handshake(self, req: HandshakeRequest) -> HandshakeReply | HandshakeRefused:
        mismatches = answer_handshake(req, self.compat, self.transport.name)
        if mismatches:
            log.warning("refused KV peer %s: %s", req.agent_name, "; ".join(mismatches))
            return HandshakeRefused("incompatible KV peers (prefill != decode)", mismatches)
        with self._peers_lock:
            self._peers.add(req.agent_name)
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
