"""The decode side of the KV hand-off: ``KVConnector`` over a registry transport.

The engine thread only queues work (``start_load``, ``cancel``) and drains results
(``poll``, ``unquarantined``); a transfer thread does everything that waits. One load:

    handshake (once per peer) ─▶ claim the lease ─▶ READ ─▶ done: the peer confirms the
    lease held the blocks throughout ─▶ LoadResult(ok)

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
from dataclasses import dataclass

import torch

from pdserve.engine.kv_connector import KVConnector, LoadResult
from pdserve.env import service_secret
from pdserve.keys import secrets_from_env
from pdserve.transfer.base import LeaseRef, PeerInfo, PeerUnreachable, ReadOp, State
from pdserve.transfer.layout import PoolGeometry
from pdserve.transfer.messages import (
    CompatRecord,
    HandshakeReply,
    KVHandle,
    LeaseClaim,
    LeaseDone,
    LeaseDoneAck,
)
from pdserve.transfer.registry import DEFAULT_TRANSFER_TIMEOUT, new_agent_name, transport_class
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
    claimed: bool = False  # the peer granted our claim: we must end the lease
    cancelled: bool = False
    release_lease: bool = True  # False once the peer looks gone
    step: Future[object] | None = None  # the side-channel call in flight (claim or done)
    num_bytes: int = 0
    seconds: float = 0.0


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
        self.secret = _secrets("the KV connector") if secret is None else secret
        kind = transport_class(transport)
        self.transport = kind(pool, compat, self.agent_name, initiator=True, secret=self.secret)
        self._num_blocks = PoolGeometry.of(pool).num_blocks
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._done: queue.Queue[LoadResult] = queue.Queue()
        self._peers: dict[str, PeerInfo] = {}  # by side-channel address
        self._handshakes: dict[str, Future[HandshakeReply]] = {}
        self._waiting: dict[str, _Load] = {}  # loads waiting for their peer's handshake
        self._calling: dict[str, _Load] = {}  # loads waiting for a claim or done reply
        self._active: dict[str, _Load] = {}  # loads with a read in flight
        self._stopping: dict[str, _Load] = {}  # quarantined: aborted reads not yet stopped
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

    def unquarantined(self) -> list[str]:
        out = []
        while not self._lifted.empty():
            out.append(self._lifted.get_nowait())
        return out

    def quarantined(self) -> int:
        """Reads reported failed that may still write their blocks (any thread, approximate)."""
        return len(self._stopping)

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
        if self._active or self._waiting or self._stopping or self._calling:
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
                self.secret,
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
            self._finish(load, f"request {load.request_id}: {err}")
            return
        h = load.handle
        self._call(load, LeaseClaim(h.request_id, h.nonce, self.agent_name))

    def _call(self, load: _Load, msg: object) -> None:
        addr = load.handle.side_channel
        load.step = self._calls.submit(call, addr, msg, self.transfer_timeout, self.secret)
        self._calling[load.request_id] = load

    def _gone(self, load: _Load, error: str) -> None:
        """The peer did not answer: forget it (the next load re-handshakes); its lease
        times out there."""
        self._forget_peer(load.handle.side_channel)
        load.release_lease = False
        self._finish(load, error)

    def _read(self, load: _Load) -> None:
        peer = self._peers.get(load.handle.side_channel)
        if peer is None:  # forgotten meanwhile (another read from it failed)
            self._finish(load, f"request {load.request_id}: the KV peer went away")
            return
        lease = LeaseRef(load.handle.request_id, load.handle.nonce, self.agent_name)
        try:
            load.read_started = time.monotonic()
            load.op = self.transport.start_read(lease, peer, load.remote_ids, load.local_ids)
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
                load.num_bytes = load.op.num_bytes
                load.seconds = time.monotonic() - load.read_started
                h = load.handle
                self._call(load, LeaseDone(h.request_id, h.nonce, self.agent_name, True))
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
        self._progress_calls(now)
        self._progress_stopping()

    def _progress_calls(self, now: float) -> None:
        """Claims granted start their read; confirmed dones end their load."""
        for rid, load in list(self._calling.items()):
            assert load.step is not None
            if not load.step.done() and now <= load.deadline:
                continue
            del self._calling[rid]
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
                self._finish(load, f"request {rid}: {exc}")
                continue
            if not load.claimed:
                load.claimed = True
                if load.cancelled:
                    self._finish(load, f"request {rid}: cancelled")
                else:
                    self._read(load)
            elif isinstance(reply, LeaseDoneAck) and reply.intact:
                load.claimed = False  # the done ended the lease
                self._finish(load, "", load.num_bytes, load.seconds)
            else:
                load.claimed = False
                err = getattr(reply, "error", "") or "the peer did not confirm the read"
                self._finish(load, f"request {rid}: {err}; its blocks are not used")

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
                for ld in waiting:  # never claimed: the lease times out on the peer
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
        elif rid in self._calling:  # ends when its call returns
            self._calling[rid].cancelled = True

    def _abort(self, load: _Load, error: str) -> None:
        assert load.op is not None
        if self._try_abort(load.op):
            self._finish(load, error)
        else:  # it may still write the local blocks: report it, keep them out of use
            log.error("KV read %s could not be stopped; its blocks are quarantined", load.op)
            self._stopping[load.request_id] = load
            self._finish(load, f"{error} (the read could not be stopped)", quarantined=True)

    def _try_abort(self, op: ReadOp) -> bool:
        try:
            return self.transport.abort(op)
        except Exception as exc:
            log.warning("abort of KV read %s: %s", op.request_id, exc)
            return False

    def _progress_stopping(self) -> None:
        """Quarantines end only when the transport says the read stopped, never by a timer."""
        for rid, load in list(self._stopping.items()):
            assert load.op is not None
            if self._try_abort(load.op):
                log.warning("quarantined KV read %s stopped; its blocks are free again", rid)
                del self._stopping[rid]
                self._lifted.put(rid)

    def _finish(
        self,
        load: _Load,
        error: str,
        num_bytes: int = 0,
        seconds: float = 0.0,
        quarantined: bool = False,
    ) -> None:
        ok = not error
        res = LoadResult(load.request_id, ok, error, num_bytes if ok else 0, seconds, quarantined)
        self._done.put(res)
        if load.claimed and load.release_lease:  # we hold the lease: let the peer free it now
            h = load.handle
            msg = LeaseDone(h.request_id, h.nonce, self.agent_name, False)
            fut = self._releases.submit(
                call, h.side_channel, msg, self.release_timeout, self.secret
            )
            fut.add_done_callback(_log_release_failure)

    def _shutdown(self) -> None:
        for rid in list(self._active):
            self._abort(self._active.pop(rid), f"request {rid}: connector closed")
        for rid in list(self._waiting):
            self._finish(self._waiting.pop(rid), f"request {rid}: connector closed")
        for rid in list(self._calling):
            self._finish(self._calling.pop(rid), f"request {rid}: connector closed")


def _log_release_failure(fut: Future[object]) -> None:
    exc = None if fut.cancelled() else fut.exception()
    if exc is not None:
        log.warning("lease release failed (the lease will expire instead): %s", exc)


def _secrets(role: str) -> tuple[str, ...]:
    """The service secret and, while it rotates, the one also accepted (pdserve/keys.py)."""
    return secrets_from_env() if service_secret(role) else ()
