"""The transport interface: one object per worker, bound to its KV pool.

A transport moves blocks between two KV pools of compatible workers. Both sides
create one at start-up with their pool tensor (``transfer.registry.transport_class``):

* prefill side: ``metadata()`` is published in handshake replies; ``serve()`` answers
  transport-specific side-channel requests (the tcp transport's reads). Called from the
  side-channel thread.
* decode side: ``add_peer`` after a handshake, then ``start_read`` / ``check`` / ``abort``
  per request. Called from the connector's transfer thread only (NIXL agents are created
  without internal locking), never from the engine thread.

Who frees what: a ``ReadOp`` is owned by the caller of ``start_read``; it is finished when
``check`` returns DONE or ERR, or ``abort`` returned True. After that the transport never
touches the local blocks again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from pdserve.transfer.layout import PoolGeometry
from pdserve.transfer.messages import CompatRecord

State = Literal["PROC", "DONE", "ERR"]


class TransferError(RuntimeError):
    """A transfer could not be set up or failed."""


class PeerUnreachable(TransferError):
    """The peer did not answer within the deadline: it looks gone (or frozen)."""


class IncompatiblePeerError(TransferError):
    """The prefill side refused the handshake; ``mismatches`` names the differing fields."""

    def __init__(self, message: str, mismatches: list[str] | None = None) -> None:
        super().__init__(message)
        self.mismatches = list(mismatches or [])


@dataclass(frozen=True)
class PeerInfo:
    """What the decode side learned about a prefill peer in the handshake."""

    agent_name: str
    side_channel: str
    metadata: bytes
    geometry: PoolGeometry


@dataclass(frozen=True)
class LeaseRef:
    """The claimed lease a read belongs to (the tcp transport names it to the peer)."""

    request_id: str
    nonce: str
    agent_name: str  # the claiming (reading) agent


class ReadOp:
    """One in-flight read of a request's blocks; transports subclass it."""

    def __init__(self, request_id: str, num_bytes: int) -> None:
        self.request_id = request_id
        self.num_bytes = num_bytes
        self.error = ""


class KVTransport(ABC):
    name: ClassVar[str]
    # True if reads progress only inside check() calls, so the caller should call it in a
    # tight loop while reads are in flight (NIXL without a progress thread).
    busy_poll: ClassVar[bool] = False

    def __init__(
        self,
        pool: torch.Tensor,
        compat: CompatRecord,
        agent_name: str,
        initiator: bool = False,
        secret: str | tuple[str, ...] = "",
    ) -> None:
        self.pool = pool
        self.secret = secret  # the service secret, for transports that talk on the side channel
        self.initiator = initiator  # the decode side: it starts reads, nobody reads from it
        self.compat = compat
        self.agent_name = agent_name
        self.geometry = PoolGeometry.of(pool)
        self.open()

    def open(self) -> None:  # noqa: B027 - a hook: most transports need nothing more
        """Set up what the transport needs beyond the pool (called once, by ``__init__``)."""

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to reach this transport (NIXL agent metadata; b"" for tcp)."""

    def serve(self, msg: object) -> list[bytes] | None:
        """Answer a transport-specific side-channel request, or None if not ours."""
        return None

    @abstractmethod
    def add_peer(self, peer: PeerInfo) -> None:
        """Make ``peer`` readable (decode side, after its handshake)."""

    @abstractmethod
    def remove_peer(self, agent_name: str) -> None:
        """Forget a peer (it failed or went away); a new handshake adds it again."""

    @abstractmethod
    def start_read(
        self, lease: LeaseRef, peer: PeerInfo, remote_ids: list[int], local_ids: list[int]
    ) -> ReadOp:
        """Start one read of ``remote_ids`` of ``peer`` into ``local_ids``; never blocks long.
        ``lease`` names the claimed lease the blocks belong to."""

    @abstractmethod
    def check(self, op: ReadOp) -> State:
        """Progress ``op``; ERR sets ``op.error``."""

    @abstractmethod
    def abort(self, op: ReadOp) -> bool:
        """Try to stop ``op``; True once it can no longer write into the local blocks."""

    @abstractmethod
    def close(self) -> None:
        """Release the transport's resources (the pool tensor stays the caller's)."""
