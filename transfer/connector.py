"""The decode side of the KV hand-off: ``KVConnector`` over a registry transport.

The engine thread only queues work (``start_load``, ``cancel``) and drains results
(``poll``, ``unquarantined``); a transfer thread does everything that waits. One load:

    handshake (once per peer) ─▶ claim the lease ─▶ READ ─▶ done: the peer confirms the
    lease held the blocks throughout ─▶ LoadResult(ok)

Each load is one ``LoadRecord``; its ``phase`` (transfer/load_state.py: HANDSHAKING →
CLAIMING → CLAIMED → TRANSFERRING → CONFIRMING → DONE | FAILED | ABORTED | STOPPING) is
moved on by the transfer thread alone, one checked ``advance`` per step.

Side-channel calls (handshake, claim, done) run in a small pool so a dead peer cannot stall
the others. Every load ends in exactly one ``LoadResult`` within ``transfer_timeout`` of
``start_load``. A read that fails or times out is aborted first; if the transport cannot
confirm the abort, the result says ``quarantined``: the engine keeps the local blocks out of
use until ``unquarantined`` names the request (the transport reported the read ended).

A claimed lease is always ended: ``LeaseDone(ok)`` after the READ (answered with
``intact``), else ``LeaseDone(ok=False)`` in the background, unless the peer looks gone (read
error, timeout), where the lease times out on the prefill side instead. A claim that is
refused (handle replayed, lease expired) fails the load before any byte moves.

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

import torch

from pdserve.engine.kv_connector import KVConnector, LoadResult
from pdserve.transfer.base import LeaseRef, PeerInfo, PeerUnreachable, ReadOp, State
from pdserve.transfer.layout import PoolGeometry
from pdserve.transfer.load_state import LoadPhase, LoadRecord
from pdserve.transfer.messages import (
    CompatRecord,
    HandshakeReply,
    KVHandle,
    LeaseClaim,
    LeaseDone,
    LeaseDoneAck,
)
from pdserve.transfer.registry import DEFAULT_TRANSFER_TIMEOUT, new_agent_name, transport_class
from pdserve.transfer.side_channel import call, handshake, service_secrets
from pdserve.transfer.validation import check_local, check_peer

log = logging.getLogger(__name__)


class RemoteKVConnector(KVConnector):
    def __init__(
        self,
        pool: torch.Tensor,
        compat: CompatRecord,
        transport: str = "nixl",
        agent_name: str | None = None,
        transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
        release_timeout: float = 2.0,
        secret: str | tuple[str, ...] | None = None,
    ) -> None:
        assert transfer_timeout > 0
        self.agent_name = agent_name or new_agent_name("decode")
        self.compat = compat
        self.transfer_timeout = transfer_timeout
        self.release_timeout = release_timeout
        self.secret = service_secrets("the KV connector") if secret is None else secret
        kind = transport_class(transport)
        self.transport = kind(pool, compat, self.agent_name, initiator=True, secret=self.secret)
        self._num_blocks = PoolGeometry.of(pool).num_blocks
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._done: queue.Queue[LoadResult] = queue.Queue()
        self._peers: dict[str, PeerInfo] = {}  # by side-channel address
        self._handshakes: dict[str, Future[HandshakeReply]] = {}
        # Every admitted load until it ends (STOPPING ones until their read stopped), by
        # serial: a quarantined load may outlive its request, whose id may come back.
        self._loads: dict[int, LoadRecord] = {}
        self._lifted: queue.Queue[str] = queue.Queue()  # quarantines lifted
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
        load = LoadRecord(
            request_id, handle, list(remote_block_ids), list(local_block_ids), deadline
        )
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

    def unquarantined(self) -> list[str]:
        out = []
        while not self._lifted.empty():
            out.append(self._lifted.get_nowait())
        return out

    def phase(self, request_id: str) -> LoadPhase | None:
        """The phase of the request's live load (any thread, approximate); None if none."""
        live = [ld for ld in list(self._loads.values()) if ld.request_id == request_id]
        return live[-1].phase if live else None

    def quarantined(self) -> int:
        """Reads reported failed that may still write their blocks (any thread, approximate)."""
        return sum(ld.phase is LoadPhase.STOPPING for ld in list(self._loads.values()))

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
                    assert isinstance(arg, LoadRecord)
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
        if self.transport.busy_poll and self._in(LoadPhase.TRANSFERRING):
            return 0.0
        if self._loads:
            return 0.0005
        return 0.05

    def _in(self, *phases: LoadPhase) -> list[LoadRecord]:
        """The loads in ``phases`` now, oldest first (a copy: callers move them on)."""
        return [ld for ld in self._loads.values() if ld.phase in phases]

    def _admit(self, load: LoadRecord) -> None:
        self._loads[load.serial] = load
        peer = self._peers.get(load.handle.side_channel)
        if peer is not None:
            self._start(load, peer)
            return
        load.advance(LoadPhase.HANDSHAKING)
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
                self.secret,
            )

    def _start(self, load: LoadRecord, peer: PeerInfo) -> None:
        err = check_peer(load.handle, load.remote_ids, peer)
        if err and not load.handshake_retries and load.handle.agent_name != peer.agent_name:
            # The peer may have restarted under a new agent name: ask once more.
            load.handshake_retries += 1
            self._forget_peer(peer.side_channel)
            self._admit(load)
            return
        if err:
            self._finish(load, LoadPhase.FAILED, f"request {load.request_id}: {err}")
            return
        h = load.handle
        self._call(load, LeaseClaim(h.request_id, h.nonce, self.agent_name), LoadPhase.CLAIMING)

    def _call(self, load: LoadRecord, msg: object, phase: LoadPhase) -> None:
        addr = load.handle.side_channel
        load.step = self._calls.submit(call, addr, msg, self.transfer_timeout, self.secret)
        load.advance(phase)

    def _gone(self, load: LoadRecord, error: str) -> None:
        """The peer did not answer: forget it (the next load re-handshakes); its lease
        times out there."""
        self._forget_peer(load.handle.side_channel)
        self._finish(load, LoadPhase.FAILED, error, release=False)

    def _read(self, load: LoadRecord) -> None:
        peer = self._peers.get(load.handle.side_channel)
        if peer is None:  # forgotten meanwhile (another read from it failed)
            msg = f"request {load.request_id}: the KV peer went away"
            self._finish(load, LoadPhase.FAILED, msg)
            return
        lease = LeaseRef(load.handle.request_id, load.handle.nonce, self.agent_name)
        try:
            load.read_started = time.monotonic()
            load.op = self.transport.start_read(lease, peer, load.remote_ids, load.local_ids)
        except Exception as exc:
            self._forget_peer(peer.side_channel)
            msg = (
                f"request {load.request_id}: could not start the read: {type(exc).__name__}: {exc}"
            )
            self._finish(load, LoadPhase.FAILED, msg, release=False)  # the peer is likely gone
            return
        load.advance(LoadPhase.TRANSFERRING)

    def _progress(self) -> None:
        self._progress_handshakes()
        now = time.monotonic()
        for load in self._in(LoadPhase.TRANSFERRING):
            assert load.op is not None
            rid, state = load.request_id, self._check(load.op)
            if state == "DONE":
                load.num_bytes = load.op.num_bytes
                load.seconds = time.monotonic() - load.read_started
                h = load.handle
                done = LeaseDone(h.request_id, h.nonce, self.agent_name, True)
                self._call(load, done, LoadPhase.CONFIRMING)
            elif state == "ERR":
                self._forget_peer(load.handle.side_channel)
                self._finish(
                    load, LoadPhase.FAILED, f"request {rid}: {load.op.error}", release=False
                )
            elif now > load.deadline:
                self._forget_peer(load.handle.side_channel)
                err = f"KV read timed out after {self.transfer_timeout:g}s (prefill peer gone?)"
                self._abort(load, LoadPhase.FAILED, f"request {rid}: {err}", release=False)
        for load in self._in(LoadPhase.HANDSHAKING):
            if now > load.deadline:
                t, addr = self.transfer_timeout, load.handle.side_channel
                err = f"request {load.request_id}: no handshake with {addr} within {t:g}s"
                self._finish(load, LoadPhase.FAILED, err, release=False)
        self._progress_calls(now)
        self._progress_stopping()

    def _progress_calls(self, now: float) -> None:
        """Claims granted start their read; confirmed dones end their load."""
        for load in self._in(LoadPhase.CLAIMING, LoadPhase.CONFIRMING):
            assert load.step is not None
            if not load.step.done() and now <= load.deadline:
                continue
            rid = load.request_id
            if not load.step.done():
                addr, t = load.handle.side_channel, self.transfer_timeout
                self._gone(load, f"request {rid}: no reply from side channel {addr} within {t:g}s")
                continue
            try:
                reply = load.step.result()
            except PeerUnreachable as exc:
                self._gone(load, f"request {rid}: {exc}")
                continue
            except Exception as exc:  # refused (replayed handle, expired lease)
                self._finish(load, LoadPhase.FAILED, f"request {rid}: {exc}")
                continue
            if load.phase is LoadPhase.CLAIMING:
                load.advance(LoadPhase.CLAIMED)
                if load.cancelled:
                    self._finish(load, LoadPhase.ABORTED, f"request {rid}: cancelled")
                else:
                    self._read(load)
            elif isinstance(reply, LeaseDoneAck) and reply.intact:  # the done ended the lease
                self._finish(load, LoadPhase.DONE, "", load.num_bytes, load.seconds, release=False)
            else:
                err = getattr(reply, "error", "") or "the peer did not confirm the read"
                msg = f"request {rid}: {err}; its blocks are not used"
                self._finish(load, LoadPhase.FAILED, msg, release=False)  # answered: lease ended

    def _check(self, op: ReadOp) -> State:
        try:
            return self.transport.check(op)
        except Exception as exc:  # a transport error ends this read, never the thread
            self._try_abort(op)
            op.error = f"transfer check failed: {type(exc).__name__}: {exc}"
            return "ERR"

    def _progress_handshakes(self) -> None:
        for address, fut in list(self._handshakes.items()):
            if not fut.done():
                continue
            del self._handshakes[address]
            waiting = [
                ld for ld in self._in(LoadPhase.HANDSHAKING) if ld.handle.side_channel == address
            ]
            try:
                peer = self._add_peer(address, fut.result())
            except Exception as exc:
                for ld in waiting:  # never claimed: the lease times out on the peer
                    self._finish(ld, LoadPhase.FAILED, f"request {ld.request_id}: {exc}")
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
            self.transport.geometry.planes,  # the handshake checked both layouts agree
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
        live = (ld for ld in self._loads.values() if ld.request_id == rid)
        load = next((ld for ld in live if ld.phase is not LoadPhase.STOPPING), None)
        if load is None:
            return
        if load.phase is LoadPhase.HANDSHAKING:
            self._finish(load, LoadPhase.ABORTED, f"request {rid}: cancelled")
        elif load.phase is LoadPhase.TRANSFERRING:
            self._abort(load, LoadPhase.ABORTED, f"request {rid}: cancelled")
        elif load.phase is LoadPhase.CLAIMING:  # ends when the claim's reply comes
            load.cancelled = True
        # CONFIRMING: the read is done; its result (ok or not) is reported as it comes.

    def _abort(self, load: LoadRecord, to: LoadPhase, error: str, release: bool = True) -> None:
        """Stop the READ; ``to`` if it stopped, else STOPPING (quarantined)."""
        assert load.op is not None
        if self._try_abort(load.op):
            self._finish(load, to, error, release=release)
        else:  # it may still write the local blocks: report it, keep them out of use
            log.error("KV read %s could not be stopped; its blocks are quarantined", load.op)
            msg = f"{error} (the read could not be stopped)"
            self._finish(load, LoadPhase.STOPPING, msg, quarantined=True, release=release)

    def _try_abort(self, op: ReadOp) -> bool:
        try:
            return self.transport.abort(op)
        except Exception as exc:
            log.warning("abort of KV read %s: %s", op.request_id, exc)
            return False

    def _progress_stopping(self) -> None:
        """Quarantines end only when the transport says the read stopped, never by a timer."""
        for load in self._in(LoadPhase.STOPPING):
            assert load.op is not None
            if self._try_abort(load.op):
                rid = load.request_id
                log.warning("quarantined KV read %s stopped; its blocks are free again", rid)
                load.advance(LoadPhase.FAILED)
                del self._loads[load.serial]
                self._lifted.put(rid)

    def _finish(
        self,
        load: LoadRecord,
        to: LoadPhase,
        error: str,
        num_bytes: int = 0,
        seconds: float = 0.0,
        quarantined: bool = False,
        release: bool = True,
    ) -> None:
        """Report the load's one result and move it to ``to``. ``release``: end a lease we
        hold now (False where the peer looks gone, or its answer ended the lease)."""
        held = load.holds_lease
        load.advance(to)
        if to.terminal:
            self._loads.pop(load.serial, None)
        ok = to is LoadPhase.DONE
        assert ok == (not error), (to, error)
        res = LoadResult(load.request_id, ok, error, num_bytes if ok else 0, seconds, quarantined)
        self._done.put(res)
        if held and release:  # we hold the lease: let the peer free it now
            h = load.handle
            msg = LeaseDone(h.request_id, h.nonce, self.agent_name, False)
            fut = self._releases.submit(
                call, h.side_channel, msg, self.release_timeout, self.secret
            )
            fut.add_done_callback(_log_release_failure)

    def _shutdown(self) -> None:
        closed = "connector closed"
        for load in self._in(LoadPhase.TRANSFERRING):
            self._abort(load, LoadPhase.FAILED, f"request {load.request_id}: {closed}")
        for load in self._in(LoadPhase.HANDSHAKING, LoadPhase.CLAIMING, LoadPhase.CONFIRMING):
            self._finish(load, LoadPhase.FAILED, f"request {load.request_id}: {closed}")


def _log_release_failure(fut: Future[object]) -> None:
    exc = None if fut.cancelled() else fut.exception()
    if exc is not None:
        log.warning("lease release failed (the lease will expire instead): %s", exc)
