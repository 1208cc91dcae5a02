"""One KV load's life on the decode side, as named phases (like SGLang's ``KVPoll``).

Every load the connector admits is one :class:`LoadRecord`; its ``phase`` says where it
is, and :meth:`LoadRecord.advance` is the only way to change it (an illegal step raises,
so a bug shows where it happens, not as a leaked lease or block three calls later)::

    QUEUED ─┬─▶ HANDSHAKING ─▶ CLAIMING ─▶ CLAIMED ─▶ TRANSFERRING ─▶ CONFIRMING ─▶ DONE
            └──(peer known)──────▲                        │
                                                          └─▶ STOPPING ─▶ FAILED
    every live phase ─▶ FAILED;  HANDSHAKING, CLAIMED, TRANSFERRING ─▶ ABORTED (cancel)

* HANDSHAKING: waiting for the peer's handshake (once per peer; again if the peer
  restarted under a new agent name).
* CLAIMING: the lease claim is on the wire; a cancel now is honoured when it returns.
* CLAIMED: the peer granted the claim; from here until the peer answers our done, the
  lease is ours to end (``holds_lease``).
* TRANSFERRING: the READ is in flight.
* CONFIRMING: ``LeaseDone(ok)`` is on the wire; the peer answers whether the lease held
  the blocks throughout (only then DONE).
* STOPPING: reported failed and quarantined: the READ could not be aborted and may still
  write the local blocks; the record stays until the transport says it stopped.
"""

from __future__ import annotations

import enum
import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

from pdserve.transfer.base import ReadOp
from pdserve.transfer.messages import KVHandle


class LoadPhase(enum.Enum):
    QUEUED = "queued"
    HANDSHAKING = "handshaking"
    CLAIMING = "claiming"
    CLAIMED = "claimed"
    TRANSFERRING = "transferring"
    CONFIRMING = "confirming"
    STOPPING = "stopping"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in (LoadPhase.DONE, LoadPhase.FAILED, LoadPhase.ABORTED)


P = LoadPhase
NEXT: dict[LoadPhase, frozenset[LoadPhase]] = {
    # HANDSHAKING → HANDSHAKING: the peer restarted under a new name; ask once more.
    P.QUEUED: frozenset({P.HANDSHAKING, P.CLAIMING, P.FAILED}),
    P.HANDSHAKING: frozenset({P.HANDSHAKING, P.CLAIMING, P.FAILED, P.ABORTED}),
    P.CLAIMING: frozenset({P.CLAIMED, P.FAILED}),
    P.CLAIMED: frozenset({P.TRANSFERRING, P.FAILED, P.ABORTED}),
    P.TRANSFERRING: frozenset({P.CONFIRMING, P.STOPPING, P.FAILED, P.ABORTED}),
    P.CONFIRMING: frozenset({P.DONE, P.FAILED}),
    P.STOPPING: frozenset({P.FAILED}),
    P.DONE: frozenset(),
    P.FAILED: frozenset(),
    P.ABORTED: frozenset(),
}
LEASE_HELD = frozenset({P.CLAIMED, P.TRANSFERRING, P.CONFIRMING})
_serials = itertools.count()


class IllegalTransition(RuntimeError):
    """A load was moved along an edge its life does not have (a connector bug)."""


@dataclass(eq=False)
class LoadRecord:
    request_id: str
    handle: KVHandle
    remote_ids: list[int]
    local_ids: list[int]
    deadline: float  # time.monotonic()
    phase: LoadPhase = LoadPhase.QUEUED
    serial: int = field(default_factory=lambda: next(_serials))  # the connector's key
    cancelled: bool = False  # asked while CLAIMING: honoured when the claim returns
    handshake_retries: int = 0
    op: ReadOp | None = None  # the READ (TRANSFERRING, STOPPING)
    step: Future[object] | None = None  # the side-channel call (CLAIMING, CONFIRMING)
    read_started: float = 0.0
    num_bytes: int = 0
    seconds: float = 0.0

    @property
    def holds_lease(self) -> bool:
        """The peer granted our claim and has not answered our done: we must end it."""
        return self.phase in LEASE_HELD

    def advance(self, to: LoadPhase) -> None:
        if to not in NEXT[self.phase]:
            raise IllegalTransition(
                f"KV load of {self.request_id}: {self.phase.value} -> {to.value} is not a step"
            )
        self.phase = to
