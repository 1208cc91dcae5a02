"""The decode side of the KV hand-off: ``KVConnector`` over a registry transport.

The engine thread only queues work (``start_load``, ``cancel``) and drains results
(``poll``); a transfer thread does everything that waits: handshakes (run in a small pool so a
dead peer cannot stall other peers), one read per request, deadlines and lease releases.
Every load ends in exactly one ``LoadResult`` within ``transfer_timeout`` of ``start_load``,
unless the transport cannot stop a read, in which case its result waits until it has stopped
(so the engine never frees a block that is still being written), at most another timeout.

Lease release: once a load that reached the transfer thread is over (read done, cancelled,
refused by a live peer: incompatible or out-of-range ids) a ``LeaseRelease`` goes to the
handle's side channel in the background, so the prefill side frees the blocks at once instead
of at lease expiry. Not sent when the peer looks gone (read error, timeout, no handshake), when
the handle names an agent other than the one at its side channel (a stale handle), nor for
handles refused by the local checks (expired lease, bad ids), which never reach a peer.

Measured per load: ``num_bytes`` (all layers, k and v) and ``seconds`` from posting the read to
its completion (the handshake, paid once per peer, is not included).
"""

from __future__ import annotations

import base64
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdserve.engine.kv_connector import KVConnector, LoadResult
from pdserve.transfer.base import IncompatiblePeerError, PeerInfo, ReadOp, State
from pdserve.transfer.layout import PoolGeometry
from pdserve.transfer.messages import CompatRecord, HandshakeReply, KVHandle, LeaseRelease
from pdserve.transfer.registry import make_transport, new_agent_name
from pdserve.transfer.side_channel import call, handshake
from pdserve.transfer.validation import check_local, check_peer

log = logging.getLogger(__name__)


@dataclass
class _Load:
    request_id: str
    handle: KVHandle
    remote_ids: list[int]
    local_ids: list[int]
    deadline: float  # time.monotonic()
    op: ReadOp | None = None
    read_started: float = 0.0
    retried_handshake: bool = False
    release_lease: bool = True  # False for a stale handle (other agent) or an unreachable peer


class RemoteKVConnector(KVConnector):
    def __init__(
        self,
        pool: torch.Tensor,
        compat: CompatRecord,
        transport: str = "nixl",
        agent_name: str | None = None,
        transfer_timeout: float = 10.0,
        release_timeout: float = 2.0,
    ) -> None:
        assert transfer_timeout > 0
        self.agent_name = agent_name or new_agent_name("decode")
        self.compat = compat
        self.transfer_timeout = transfer_timeout
        self.release_timeout = release_timeout
        self.transport = make_transport(transport, pool, compat, self.agent_name, initiator=True)
        self._num_blocks = PoolGeometry.of(pool).num_blocks
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._done: queue.Queue[LoadResult] = queue.Queue()
        self._peers: dict[str, PeerInfo] = {}  # by side-channel address
        self._handshakes: dict[str, Future[HandshakeReply]] = {}
        self._waiting: dict[str, _Load] = {}  # loads waiting for their peer's handshake
        self._active: dict[str, _Load] = {}  # loads with a read in flight
        self._stopping: dict[str, tuple[_Load, str]] = {}  # aborted reads not yet stopped
        self._pending = 0  # started and not yet reported; engine thread only
        # Handshakes and lease releases get separate pools: releases to a dead peer (each up
        # to release_timeout) must never delay a handshake with a live one.
        self._calls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-handshake")
        self._releases = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-release")
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._thread.start()

    @property
    def transport_name(self) -> str:
        return self.transport.name

    # --- engine thread ---------------------------------------------------------------------

    def start_load(
        self,
        request_id: str,
        handle: object,
        remote_block_ids: list[int],
        local_block_ids: list[int],
    ) -> None:
        self._pending += 1
        err = check_local(
            handle,
            remote_block_ids,
            local_block_ids,
            self.transport.name,
            self.compat.block_size,
            self._num_blocks,
        )
        if err:
            self._done.put(LoadResult(request_id, False, f"request {request_id}: {err}"))
            return
        assert isinstance(handle, KVHandle)
        deadline = time.monotonic() + self.transfer_timeout
        load = _Load(request_id, handle, list(remote_block_ids), list(local_block_ids), deadline)
        self._inbox.put(("load", load))

    def poll(self) -> list[LoadResult]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                self._pending -= len(out)
                return out

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def pending(self) -> int:
        """Loads started and not yet returned by ``poll`` (0 when nothing is in flight)."""
        return self._pending

    def close(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout=self.transfer_timeout + 5)
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._releases.shutdown(wait=False)  # pending lease releases still go out
        self.transport.close()

    # --- transfer thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            wait = self._wait()
            try:
                kind, arg = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
            except queue.Empty:
                kind, arg = "", None
            if kind == "stop":
                self._shutdown()
                return
            try:
                if kind == "load":
                    assert isinstance(arg, _Load)
                    self._admit(arg)
                elif kind == "cancel":
                    assert isinstance(arg, str)
                    self._cancel(arg)
                self._progress()
            except Exception:  # the transfer thread must outlive any one bad load
                log.exception("kv transfer thread")

    def _wait(self) -> float:
        """How long to wait for new work before progressing again. While a NIXL read is in
        flight: not at all. UCX moves the data only inside check() calls here (no progress
        thread on the initiator; with cma the copy runs in this thread), so any sleep between
        checks is lost bandwidth. The GIL's switch interval still lets the engine thread in."""
        if self._active and self.transport.busy_poll:
            return 0.0
        if self._active or self._waiting or self._stopping:
            return 0.0005
        return 0.05

    def _admit(self, load: _Load) -> None:
        peer = self._peers.get(load.handle.side_channel)
        if peer is not None:
            self._start(load, peer)
            return
        self._waiting[load.request_id] = load
        self._ensure_handshake(load.handle.side_channel)

    def _ensure_handshake(self, address: str) -> None:
        if address not in self._handshakes:
            self._handshakes[address] = self._calls.submit(
                handshake,
                address,
                self.transport.name,
                self.compat,
                self.agent_name,
                self.transport.metadata(),
                self.transfer_timeout,
            )

    def _start(self, load: _Load, peer: PeerInfo) -> None:
        err = check_peer(load.handle, load.remote_ids, peer)
        if err and not load.retried_handshake and load.handle.agent_name != peer.agent_name:
            # The peer may have restarted under a new agent name: ask once more.
            load.retried_handshake = True
            self._forget_peer(peer.side_channel)
            self._admit(load)
            return
        if err:
            load.release_lease = load.handle.agent_name == peer.agent_name
            self._finish(load, f"request {load.request_id}: {err}")
            return
        try:
            load.read_started = time.monotonic()
            load.op = self.transport.start_read(
                load.request_id, peer, load.remote_ids, load.local_ids
            )
        except Exception as exc:
            self._forget_peer(peer.side_channel)
            load.release_lease = False  # the peer is most likely gone
            self._finish(load, f"request {load.request_id}: could not start the read: {exc}")
            return
        self._active[load.request_id] = load

    def _progress(self) -> None:
        self._progress_handshakes()
        now = time.monotonic()
        for rid, load in list(self._active.items()):
            assert load.op is not None
            state = self._check(load.op)
            if state == "DONE":
                del self._active[rid]
                self._finish(load, "", load.op.num_bytes, time.monotonic() - load.read_started)
            elif state == "ERR":
                del self._active[rid]
                self._forget_peer(load.handle.side_channel)
                load.release_lease = False
                self._finish(load, f"request {rid}: {load.op.error}")
            elif now > load.deadline:
                del self._active[rid]
                self._forget_peer(load.handle.side_channel)
                load.release_lease = False
                err = f"KV read timed out after {self.transfer_timeout:g}s (prefill peer gone?)"
                self._abort(load, f"request {rid}: {err}")
        for rid, load in list(self._waiting.items()):
            if now > load.deadline:
                del self._waiting[rid]
                t, addr = self.transfer_timeout, load.handle.side_channel
                err = f"no handshake with {addr} within {t:g}s"
                load.release_lease = False
                self._finish(load, f"request {rid}: {err}")
        self._progress_stopping(now)

    def _check(self, op: ReadOp) -> State:
        try:
            return self.transport.check(op)
        except Exception as exc:  # a transport error ends this read, never the thread
            self._try_abort(op)
            op.error = f"transfer check failed: {exc}"
            return "ERR"

    def _progress_handshakes(self) -> None:
        for address, fut in list(self._handshakes.items()):
            if not fut.done():
                continue
            del self._handshakes[address]
            waiting = [ld for ld in self._waiting.values() if ld.handle.side_channel == address]
            for ld in waiting:
                del self._waiting[ld.request_id]
            try:
                peer = self._add_peer(address, fut.result())
            except Exception as exc:
                for ld in waiting:  # an incompatible peer is alive: let it free the blocks
                    ld.release_lease = isinstance(exc, IncompatiblePeerError)
                    self._finish(ld, f"request {ld.request_id}: {exc}")
                continue
            for ld in waiting:
                self._start(ld, peer)

    def _add_peer(self, address: str, reply: HandshakeReply) -> PeerInfo:
        geo = PoolGeometry(
            reply.base_addr,
            self.compat.num_layers,
            reply.num_blocks,
            self.transport.geometry.block_bytes,
            reply.device_id,
            reply.mem_type,
        )
        meta = base64.b64decode(reply.agent_metadata)
        peer = PeerInfo(reply.agent_name, address, meta, geo)
        self.transport.add_peer(peer)
        self._peers[address] = peer
        return peer

    def _forget_peer(self, address: str) -> None:
        peer = self._peers.pop(address, None)
        if peer is not None:
            self.transport.remove_peer(peer.agent_name)

    def _cancel(self, rid: str) -> None:
        if rid in self._waiting:
            self._finish(self._waiting.pop(rid), f"request {rid}: cancelled")
        elif rid in self._active:
            self._abort(self._active.pop(rid), f"request {rid}: cancelled")

    def _abort(self, load: _Load, error: str) -> None:
        assert load.op is not None
        if self._try_abort(load.op):
            self._finish(load, error)
        else:
            load.deadline = time.monotonic() + self.transfer_timeout
            self._stopping[load.request_id] = (load, error)

    def _try_abort(self, op: ReadOp) -> bool:
        try:
            return self.transport.abort(op)
        except Exception as exc:
            log.warning("abort of KV read %s: %s", op.request_id, exc)
            return False

    def _progress_stopping(self, now: float) -> None:
        for rid, (load, error) in list(self._stopping.items()):
            assert load.op is not None
            if self._try_abort(load.op) or now > load.deadline:
                if now > load.deadline:
                    log.error("KV read %s could not be stopped; reporting it anyway", rid)
                del self._stopping[rid]
                self._finish(load, error)

    def _finish(self, load: _Load, error: str, num_bytes: int = 0, seconds: float = 0.0) -> None:
        ok = not error
        self._done.put(LoadResult(load.request_id, ok, error, num_bytes if ok else 0, seconds))
        if load.release_lease:  # done with the blocks either way: let the prefill side free them
            msg = LeaseRelease(load.handle.request_id, self.agent_name)
            fut = self._releases.submit(call, load.handle.side_channel, msg, self.release_timeout)
            fut.add_done_callback(_log_release_failure)

    def _shutdown(self) -> None:
        for rid in list(self._active):
            self._abort(self._active.pop(rid), f"request {rid}: connector closed")
        for rid in list(self._waiting):
            self._finish(self._waiting.pop(rid), f"request {rid}: connector closed")


def _log_release_failure(fut: Future[object]) -> None:
    exc = None if fut.cancelled() else fut.exception()
    if exc is not None:
        log.warning("lease release failed (the lease will expire instead): %s", exc)
