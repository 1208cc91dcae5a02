"""The engine on its own thread, driven from asyncio.

Requests and commands enter through a queue; the engine thread runs the step
loop and hands each output to the asyncio loop of the request's caller. The
model forward releases the GIL, so the event loop stays responsive.

``hooks`` run on the engine thread after every step and at least every
``idle_interval`` seconds when idle: workers use them to publish KV events,
expire leases and apply lease releases, all without locking the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.os_thread import name_os_thread
from pdserve.engine.request import RequestStatus
from pdserve.protocol.contract import EngineStats
from pdserve.protocol.outputs import EngineDeadError, RequestOutput
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.streams import follow, hand_over

logger = logging.getLogger(__name__)
T = TypeVar("T")
Hook = Callable[[LLMEngine], None]


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        recompute_on_load_failure: bool = True,
        idle_interval: float = 0.02,
    ) -> None:
        self.engine = LLMEngine(config, connector, recompute_on_load_failure)
        self.hooks: list[Hook] = []
        self.idle_interval = idle_interval
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[
            str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]
        ] = {}
        self._stop = False
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    # -- public, any thread ----------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output deltas; raises InvalidParameter before the first.

        Leaving the iteration early (client gone, task cancelled) aborts the request.
        """
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt_token_ids, params, **kwargs)
            self._streams[request_id] = (loop, stream)

        if params.structured is not None:  # compile off the engine thread (then cached)
            await asyncio.to_thread(self.engine.grammars.compile, params.structured)
        await self.call(add)
        async with contextlib.aclosing(follow(stream, request_id, self.abort)) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        self.submit(lambda e: self._abort(e, request_id))

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run ``fn(engine)`` on the engine thread, fire and forget."""
        if not self.alive:
            raise EngineDeadError("engine thread is not running")
        self._commands.put(lambda: fn(self.engine))
        self._wake.set()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread and return its result here."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # handed to the caller, not raised here
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        if not self.alive:
            raise EngineDeadError("engine thread is not running")
        self._commands.put(run)
        self._wake.set()
        return await fut

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # -- engine thread ---------------------------------------------------------
    def _run(self) -> None:
        name_os_thread()  # "pdserve-engine" in top -H and /proc, for profiling and benches
        last_hooks = 0.0
        while not self._stop:
            self._drain_commands()
            stepped = False
            if self.engine.has_work:
                self._step()
                stepped = True
            now = time.monotonic()
            if stepped or now - last_hooks >= self.idle_interval:
                self._run_hooks()
                last_hooks = now
            self._stats = self.engine.stats()
            if not self.engine.has_work:
                self._wake.wait(self.idle_interval)
                self._wake.clear()
            elif not self.engine.scheduler.running and not self.engine.scheduler.waiting:
                # Only transfers in flight: poll them without spinning a core.
                self._wake.wait(0.0005)
                self._wake.clear()
        self._fail_all("engine shut down")

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                cmd()
            except Exception:
                logger.exception("engine command failed")

    def _step(self) -> None:
        self._deliver_all(step_or_fail(self.engine))

    def _run_hooks(self) -> None:
        run_hooks(self.hooks, self.engine)

    def _deliver(self, out: RequestOutput) -> None:
        self._deliver_all([out])

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        hand_over(self._streams, outputs, self.engine.abort)

    def _abort(self, engine: LLMEngine, request_id: str) -> None:
        out = engine.abort(request_id)
        if out is not None:
            self._deliver(out)

    def _fail_all(self, message: str) -> None:
        self._deliver_all(fail_all(self.engine, message))


def step_or_fail(engine: LLMEngine) -> list[RequestOutput]:
    """One engine step's outputs; if the step raises, every unfinished request fails."""
    try:
        return engine.step()
    except Exception as exc:
        logger.exception("engine step failed; failing the running requests")
        return fail_all(engine, f"engine error: {exc}")


def fail_all(engine: LLMEngine, message: str) -> list[RequestOutput]:
    """Finish every unfinished request with an error; their final outputs."""
    return [
        engine.finish(req, RequestStatus.FINISHED_ERROR, [], "", message)
        for req in list(engine.requests.values())
        if not req.status.finished
    ]


def run_hooks(hooks: list[Hook], engine: LLMEngine) -> None:
    """Each hook on the engine's thread; a failing hook is logged, the others still run."""
    for hook in hooks:
        try:
            hook(engine)
        except Exception:
            logger.exception("engine hook %s failed", getattr(hook, "__name__", hook))


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
