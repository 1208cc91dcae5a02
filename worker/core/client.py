"""The worker's front end to its engine core, which runs in a child process.

A worker is two processes: this one serves HTTP (parsing, streaming, metrics) and the
child (``pdserve.worker.core.main``) runs the engine and everything that touches its
KV pool (the KV connector, the lease server, KV events) in :class:`CoreLoop`. They talk
over two ZeroMQ ``ipc://`` sockets in a private temporary directory (mode 0700).
Why two processes: the engine step needs the GIL back after every torch op, and the
HTTP loop's Python made it wait (docs/engine.md, "Threads").

The one way a worker serves from its engine: ``generate`` yields a request's output
deltas (a reader that falls behind gets them merged) and raises ``InvalidParameter`` /
``RequestFailed`` before the first; ``abort``; ``stats`` (the latest counters the core
sent); ``alive``; and ``query(name, *args)`` for the role's named questions
(``CoreLoop.queries``).

The core sends something at least every second while its loop runs (a heartbeat,
``CoreLoop``); one silent for ``--core-stall-timeout`` seconds is hung (a deadlock, a
stopped process, a step that never ends): ``responsive`` turns false and ``/health``
answers 503, so the router routes elsewhere and moves the streams that wait on it.
Silent for ``--core-kill-timeout`` (by default four times the stall timeout), it is killed,
which is handled as any death (below): a hung core would otherwise keep its pod unready for
good (liveness only sees the front end).

If the core dies, every open stream ends with an error output (a worker fault: the
router migrates it), pending queries raise :class:`EngineDeadError`, ``alive`` turns
false, ``/health`` answers 503 and ``on_death`` runs (the worker then exits, so that
its supervisor, kubelet or ``pdserve up``, starts it again). If this process dies, the
kernel kills the core (``PR_SET_PDEATHSIG``, set by core_main), or the zygote that forked
it does (``pdserve up``'s cores come from one: worker/core/zygote.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import zmq

from pdserve.protocol.contract import EngineStats
from pdserve.protocol.outputs import EngineDeadError, RequestFailed, RequestOutput
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams
from pdserve.protocol.streams import follow, hand_over, put_all
from pdserve.worker.core.config import CoreConfig
from pdserve.worker.core.zygote import spawn_core

logger = logging.getLogger(__name__)
POLL_MS = 200  # how often the receiver checks that the core still runs
Item = RequestOutput | Exception


class EngineClient:
    def __init__(self, config: CoreConfig) -> None:
        self._dir = tempfile.mkdtemp(prefix="pdserve-core-")  # 0700: this user only
        self._ctx = zmq.Context()
        self._commands = self._socket(zmq.PUSH, "commands")
        self._send_lock = threading.Lock()  # the receiver thread aborts for closed loops
        self._results = self._socket(zmq.PULL, "results")
        try:
            # A new process, or forked by the zygote (worker/core/zygote.py): started alike
            self.proc = spawn_core([self._addr("commands"), self._addr("results")])
            self._send(("init", config))  # a frozen dataclass: pickled as it is
            self.info: dict[str, Any] = self._await_ready()
        finally:
            # Any answer means the core has connected both sockets: their files can go now,
            # so a worker killed hard leaves nothing behind in the temporary directory.
            shutil.rmtree(self._dir, ignore_errors=True)
        self._stats = EngineStats()
        self.stall_s = config.core_stall_timeout
        self.kill_s = config.kill_after_s  # silent this long: killed (--core-kill-timeout)
        self._heard = time.monotonic()  # the last message from the core (the rx thread)
        self._dead: str | None = None
        self.crashed: str | None = None  # why the core died, if it did on its own
        self.on_death: Callable[[], None] | None = None  # called once it has (any thread)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Item]]] = {}
        self._replies: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._ids = itertools.count()
        self._rx = threading.Thread(target=self._receive, name="pdserve-core-rx", daemon=True)
        self._rx.start()

    # -- public (the event loop's thread) --------------------------------------------
    @property
    def alive(self) -> bool:
        return self._dead is None and self.proc.poll() is None

    @property
    def silent_s(self) -> float:
        """Seconds since the core's last message."""
        return time.monotonic() - self._heard

    @property
    def responsive(self) -> bool:
        return self.silent_s < self.stall_s

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output deltas; raises InvalidParameter before the first.

        Leaving the iteration early (client gone, task cancelled) aborts the request.
        """
        self._check_alive()
        if request_id in self._streams:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        stream: asyncio.Queue[Item] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send(("add", request_id, prompt_token_ids, params, kwargs))
        async with contextlib.aclosing(follow(stream, request_id, self.abort)) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        if self.alive:
            self._send(("abort", request_id))

    async def query(self, name: str, *args: Any) -> Any:
        """The core's answer to ``name(*args)`` (its ``queries``); RuntimeError if it failed."""
        self._check_alive()
        query_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[query_id] = (asyncio.get_running_loop(), fut)
        self._send(("query", query_id, name, args))
        return await fut

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self._send(("stop",))
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dead = self._dead or "engine core stopped"
        self._rx.join(2 * POLL_MS / 1000)
        self._ctx.destroy(linger=0)

    # -- setup -------------------------------------------------------------------------
    def _addr(self, name: str) -> str:
        return f"ipc://{Path(self._dir, name)}"

    def _socket(self, kind: int, name: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block: streams are bounded by the engine
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(self._addr(name))
        return sock

    def _send(self, msg: tuple[Any, ...]) -> None:
        raw = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._commands.send(raw)

    def _await_ready(self) -> dict[str, Any]:
        """Block until the core has loaded (and compiled) the model; its info dict."""
        while not self._results.poll(POLL_MS):
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine core exited with {self.proc.returncode} at start-up")
        kind, value = pickle.loads(self._results.recv())
        if kind != "ready":
            self.proc.wait(30)
            raise RuntimeError(f"engine core failed to start:\n{value}")
        return dict(value)

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(self._dead or "engine core is not running")

    # -- the receiver thread ------------------------------------------------------------
    def _receive(self) -> None:
        hung: str | None = None
        while self._dead is None:
            if not self._results.poll(POLL_MS):
                if self.proc.poll() is not None:
                    self._core_died(hung or f"engine core exited with {self.proc.returncode}")
                elif hung is None and self.silent_s > self.kill_s:
                    hung = f"engine core hung (silent {self.silent_s:.0f}s): killed"
                    logger.error("%s", hung)
                    self.proc.kill()  # then handled as a death: streams fail, worker exits
                continue
            try:
                msg = pickle.loads(self._results.recv())
                self._heard = time.monotonic()
                self._dispatch(msg)
            except Exception:
                logger.exception("bad message from the engine core")

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "out":
            self._stats = msg[1]
            self._deliver(msg[2])
        elif kind == "stats":
            self._stats = msg[1]
        elif kind == "rejected":
            _, request_id, why, field, message = msg
            exc = InvalidParameter(field, message) if why == "invalid" else RequestFailed(message)
            self._deliver_one(request_id, exc)
        elif kind == "reply":
            _, query_id, ok, value = msg
            target = self._replies.pop(query_id, None)
            if target is not None:
                result = value if ok else RuntimeError(value)
                target[0].call_soon_threadsafe(_resolve, target[1], result)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        hand_over(self._streams, outputs, self.abort)  # type: ignore[arg-type]

    def _deliver_one(self, request_id: str, item: Item) -> None:
        target = self._streams.pop(request_id, None)
        if target is not None:
            target[0].call_soon_threadsafe(put_all, [(target[1], item)])

    def _core_died(self, reason: str) -> None:
        logger.error("%s: failing its %d streams", reason, len(self._streams))
        self._dead = self.crashed = reason
        for request_id in list(self._streams):
            self._deliver_one(request_id, _error_output(request_id, reason))
        for query_id in list(self._replies):
            loop, fut = self._replies.pop(query_id)
            loop.call_soon_threadsafe(_resolve, fut, EngineDeadError(reason))
        if self.on_death is not None:
            self.on_death()


def _error_output(request_id: str, reason: str) -> RequestOutput:
    return RequestOutput(request_id, [], "", "error", 0, 0, 0, error=reason)


def _resolve(fut: asyncio.Future[Any], result: Any) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)
