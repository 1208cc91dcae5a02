"""KV transport over NIXL (UCX backend): the decode side pulls with one READ per request.

The whole pool is registered once as a single region. A request becomes one transfer whose
descriptor list holds ``layers * planes * runs`` ranges (runs of block ids contiguous on both
sides, see ``layout.merge_runs``); the remote ranges are computed from the pool geometry the
prefill side sent in its handshake reply. The READ is one-sided: the prefill side's CPU is
not involved, and completion is learnt by polling the transfer state. The lease is released
over the side channel, not by NIXL notification (see docs/kv_transfer.md).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pdserve.transfer.base import KVTransport, LeaseRef, PeerInfo, ReadOp, State, TransferError
from pdserve.transfer.layout import descriptors, merge_runs
from pdserve.transfer.staging import registration

log = logging.getLogger(__name__)

# Microseconds the target's UCX progress thread sleeps between rounds. The Python API starts it
# with 0, a busy loop that costs a whole core per idle worker; 100 us costs ~2% and only delays
# connection wire-up (the data of a READ moves without the target's help on shm/RDMA links).
PROGRESS_DELAY_US = 100
_config_lock = threading.Lock()


def _make_agent(name: str, progress_thread: bool) -> Any:
    """A UCX NIXL agent. The target side (prefill) needs UCX's progress thread: it never
    calls into NIXL while a peer reads from it. The initiator (decode) progresses its reads
    from check(); a second thread polling the same worker only adds lock contention."""
    try:
        from nixl import _api
    except ImportError as exc:
        raise TransferError(f"the nixl transport needs the 'nixl' package: {exc}") from exc
    config = _api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    base = getattr(_api.nixlBind, "nixlAgentConfig", None)
    if not progress_thread or base is None:
        return _api.nixl_agent(name, config)

    class _Delayed(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: object) -> None:
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    with _config_lock:  # nixl_agent() builds its native config from this module attribute
        _api.nixlBind.nixlAgentConfig = _Delayed
        try:
            return _api.nixl_agent(name, config)
        finally:
            _api.nixlBind.nixlAgentConfig = base


class _NixlOp(ReadOp):
    def __init__(self, request_id: str, num_bytes: int, handle: object) -> None:
        super().__init__(request_id, num_bytes)
        self.handle = handle
        self.finished = False


class NixlTransport(KVTransport):
    name = "nixl"
    busy_poll = True

    def open(self) -> None:
        self.agent = _make_agent(self.agent_name, progress_thread=not self.initiator)
        if "UCX" not in self.agent.backends:
            raise TransferError("NIXL has no UCX backend plugin; use --kv-transport tcp")
        # By address, with the memory type named: VRAM (and the GPU's index) for a CUDA pool,
        # so reads land in GPU memory directly; DRAM otherwise (staging.registration).
        descs, mem_type = registration(self.geometry, self.pool.numel() * self.pool.element_size())
        self._reg = self.agent.register_memory(descs, mem_type=mem_type)
        self._peers: set[str] = set()

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, peer: PeerInfo) -> None:
        if peer.agent_name in self._peers:
            self.remove_peer(peer.agent_name)
        name = self.agent.add_remote_agent(peer.metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != peer.agent_name:
            self.agent.remove_remote_agent(name)
            raise TransferError(f"peer metadata names agent {name!r}, not {peer.agent_name!r}")
        self._peers.add(name)

    def remove_peer(self, agent_name: str) -> None:
        if agent_name in self._peers:
            self._peers.discard(agent_name)
            try:
                self.agent.remove_remote_agent(agent_name)
            except Exception as exc:  # the peer may be gone already
                log.debug("remove_remote_agent(%s): %s", agent_name, exc)

    def start_read(
        self, lease: LeaseRef, peer: PeerInfo, remote_ids: list[int], local_ids: list[int]
    ) -> ReadOp:
        if peer.agent_name not in self._peers:
            raise TransferError(f"unknown NIXL peer {peer.agent_name!r}")
        runs = merge_runs(remote_ids, local_ids)
        lengths = [n for _, _, n in runs]
        remote = descriptors(peer.geometry, [s for s, _, _ in runs], lengths)
        local = descriptors(self.geometry, [d for _, d, _ in runs], lengths)
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local, self.geometry.mem_type),
            self.agent.get_xfer_descs(remote, peer.geometry.mem_type),
            peer.agent_name,
        )
        op = _NixlOp(lease.request_id, self.geometry.request_bytes(len(local_ids)), handle)
        if self.agent.transfer(handle) == "ERR":
            op.error = "NIXL could not post the READ"
            self._finish(op)
        return op

    def check(self, op: ReadOp) -> State:
        assert isinstance(op, _NixlOp)
        if op.finished:
            return "ERR" if op.error else "DONE"
        state = self.agent.check_xfer_state(op.handle)
        if state == "ERR":
            op.error = "NIXL READ failed (peer gone or memory not readable)"
        if state != "PROC":
            self._finish(op)
        return state  # type: ignore[no-any-return]

    def abort(self, op: ReadOp) -> bool:
        assert isinstance(op, _NixlOp)
        if op.finished:
            return True
        # Releasing an active transfer asks the backend to cancel it; if it cannot yet, the
        # handle stays and a later check()/abort() finishes the job.
        if self._finish(op):
            return True
        return self.check(op) != "PROC"

    def _finish(self, op: _NixlOp) -> bool:
        try:
            op.handle.release()  # type: ignore[attr-defined]
        except Exception as exc:
            log.debug("release of NIXL transfer %s deferred: %s", op.request_id, exc)
            return False
        op.finished = True
        return True

    def close(self) -> None:
        for name in list(self._peers):
            self.remove_peer(name)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as exc:
            log.debug("deregister_memory: %s", exc)
