"""The engine core's loop, in a process of its own (the worker's front end is another).

The front end (``pdserve.worker.core.client``) sends commands over one ZeroMQ socket
and reads what this loop sends back over another. Between steps the loop takes every
waiting command without blocking, steps the engine, and sends the step's outputs as one
message with the latest counters. The HTTP loop, its parsing and its streaming run in
the other process, so the step never waits for the GIL on their account (measured: a
busy Python thread beside the engine thread cut its steps/s ~6×, docs/engine.md).

Commands (pickled tuples, front end → core):
    ("add", request_id, prompt_token_ids, params, kwargs)
    ("abort", request_id)
    ("query", query_id, name, args)    answered by ("reply", query_id, ok, value)
    ("stop",)
Messages (core → front end):
    ("out", stats, [RequestOutput, ...])   one step's outputs (or an abort's)
    ("stats", stats)                       counters changed without outputs, or a
                                           second passed without any message (a
                                           heartbeat: the front end's /health)
    ("rejected", request_id, kind, field, message)   add refused (kind: invalid | failed)
    ("reply", query_id, ok, value)
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import zmq

from pdserve.engine.compile_guard import AbandonedCompiles
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import tenant_of
from pdserve.engine.step_fault import retry_probe, step_or_fail
from pdserve.protocol.contract import EngineStats
from pdserve.protocol.outputs import RequestFailed, RequestOutput
from pdserve.protocol.sampling_params import InvalidParameter

logger = logging.getLogger(__name__)
Hook = Callable[[LLMEngine], None]
Query = Callable[..., Any]
IDLE_S = 0.02  # poll interval when idle: hooks (leases, KV events) run at least this often
TRANSFER_POLL_S = 0.0005  # only transfers in flight: poll them without spinning a core
HEARTBEAT_S = 1.0  # the longest the front end goes without a message while the loop runs


@dataclass
class Compiling:
    """An add waiting for its grammar: the compile, the add command, when it started."""

    future: Future[Any]
    cmd: tuple[Any, ...]
    since: float


class CoreLoop:
    def __init__(
        self,
        engine: LLMEngine,
        commands: zmq.Socket[bytes],
        results: zmq.Socket[bytes],
        hooks: list[Hook] | None = None,
        queries: dict[str, Query] | None = None,
    ) -> None:
        self.engine = engine
        self.commands = commands
        self.results = results
        self.hooks = hooks or []
        self.queries = queries or {}
        self.stopped = False
        self._poller = zmq.Poller()
        self._poller.register(commands, zmq.POLLIN)
        # Grammars compile off the loop (xgrammar, up to seconds); the add follows.
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
        self._compiling: list[Compiling] = []  # the one compile running (one thread)
        # Adds waiting for the compile thread, per tenant; the tenant with the fewest
        # compiles started since the queue was last empty goes next, so one key's burst
        # of schemas cannot hold another key's one behind it.
        self._queued: OrderedDict[str, deque[tuple[Any, ...]]] = OrderedDict()
        self._started: Counter[str] = Counter()
        self.compile_timeout_s = engine.config.grammar_compile_timeout_s
        self.abandoned = AbandonedCompiles()  # timed-out compiles: bounded, keys backed off
        self._stats: EngineStats | None = None
        self._sent_at = 0.0

    def run(self) -> None:
        last_hooks = 0.0
        while not self.stopped:
            self._take_commands()
            self._add_compiled()
            stepped = self.engine.has_work
            if stepped:
                self._step()
            else:  # idle turns: the compiled forward swapped in, a faulted engine re-probed
                self.engine.maybe_swap()
                retry_probe(self.engine)
            now = time.monotonic()
            if stepped or now - last_hooks >= IDLE_S:
                self._run_hooks()
                last_hooks = now
            self._send_stats()
            self._wait()
        self._fail_all("engine shut down")
        self._compiler.shutdown(wait=False, cancel_futures=True)

    # -- commands ----------------------------------------------------------------
    def _take_commands(self) -> None:
        while not self.stopped:
            try:
                raw = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._command(pickle.loads(raw))
            except Exception:
                logger.exception("engine core command failed")

    def _command(self, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        if kind == "add":
            params = cmd[3]
            if params.structured is not None:
                tenant = tenant_of(cmd[4].get("cache_salt"))
                if self.abandoned.backing_off(tenant):
                    field = str(params.structured.get("param") or "structured")
                    self._send(
                        ("rejected", cmd[1], "invalid", field, self.abandoned.refusal(field))
                    )
                    return
                self._queued.setdefault(tenant, deque()).append(cmd)
                self._start_compile()
            else:
                self._add(cmd)
        elif kind == "abort":
            if self._drop_compiling(cmd[1]):
                return
            out = self.engine.abort(cmd[1])
            if out is not None:
                self._send_outputs([out])
        elif kind == "query":
            self._query(cmd[1], cmd[2], cmd[3])
        elif kind == "stop":
            self.stopped = True

    def _add(self, cmd: tuple[Any, ...]) -> None:
        _, request_id, prompt, params, kwargs = cmd
        try:
            self.engine.add_request(request_id, prompt, params, **kwargs)
        except InvalidParameter as exc:
            self._send(("rejected", request_id, "invalid", exc.field, str(exc)))
        except RequestFailed as exc:
            self._send(("rejected", request_id, "failed", None, str(exc)))
        except Exception as exc:  # a bug: this request fails alone, with an answer
            logger.exception("adding request %s failed", request_id)
            with contextlib.suppress(Exception):
                self.engine.abort(request_id)  # whatever it took before it failed
            self._send(
                (
                    "rejected",
                    request_id,
                    "failed",
                    None,
                    f"internal error adding the request: {type(exc).__name__}",
                )
            )

    def _add_compiled(self) -> None:
        pending = []
        now = time.monotonic()
        for entry in self._compiling:
            future, cmd = entry.future, entry.cmd
            if not future.done():
                if now - entry.since < self.compile_timeout_s:
                    pending.append(entry)
                else:
                    self._compile_timed_out(entry)
                continue
            exc = future.exception()
            if isinstance(exc, InvalidParameter):
                self._send(("rejected", cmd[1], "invalid", exc.field, str(exc)))
            elif exc is not None:
                self._send(("rejected", cmd[1], "failed", None, f"grammar: {exc}"))
            else:
                self._add(cmd)
        self._compiling = pending
        self._start_compile()

    def _start_compile(self) -> None:
        """The next tenant's oldest waiting add starts compiling, if none is running and
        fewer than the bound of abandoned compiles still run."""
        if self._compiling or (self._queued and self.abandoned.full()):
            return
        if not self._queued:
            self._started.clear()
            return
        tenant = min(self._queued, key=self._started.__getitem__)  # ties: the first come
        cmds = self._queued[tenant]
        cmd = cmds.popleft()
        if not cmds:
            del self._queued[tenant]
        self._started[tenant] += 1
        future = self._compiler.submit(self.engine.grammars.compile, cmd[3].structured)
        self._compiling.append(Compiling(future, cmd, time.monotonic()))

    def _drop_compiling(self, request_id: str) -> bool:
        """An abort that comes while the request's grammar compiles: the request is never
        added (it would decode to max_tokens for nobody); its stream ends as aborted."""
        entry = next((e for e in self._compiling if e.cmd[1] == request_id), None)
        if entry is not None:
            self._compiling.remove(entry)
            cmd = entry.cmd
        else:
            found = [(t, c) for t, q in self._queued.items() for c in q if c[1] == request_id]
            if not found:
                return False
            tenant, cmd = found[0]
            self._queued[tenant].remove(cmd)
            if not self._queued[tenant]:
                del self._queued[tenant]
        self._send_outputs([RequestOutput(request_id, [], "", "abort", len(cmd[2]), 0, 0)])
        self._start_compile()
        return True

    def _compile_timed_out(self, entry: Compiling) -> None:
        """A compile past its deadline (counted from its start, not its wait in the queue):
        the request is refused naming the field, and later compiles go to a fresh thread
        (xgrammar cannot be interrupted: the old one finishes on its own, unused; at most
        a bound of them run, and the key behind it is backed off: engine/compile_guard.py)."""
        params = entry.cmd[3]
        field = str(params.structured.get("param") or "structured")
        msg = (
            f"{field}: the grammar did not compile within {self.compile_timeout_s:g} s "
            "(--grammar-compile-timeout)"
        )
        self._send(("rejected", entry.cmd[1], "invalid", field, msg))
        self.abandoned.add(tenant_of(entry.cmd[4].get("cache_salt")), entry.future)
        self._compiler.shutdown(wait=False)
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")

    def _query(self, query_id: int, name: str, args: tuple[Any, ...]) -> None:
        fn = self.queries.get(name)
        try:
            if fn is None:
                raise KeyError(f"no query {name!r}")
            value, ok = fn(*args), True
        except Exception as exc:
            value, ok = f"{type(exc).__name__}: {exc}", False
        self._send(("reply", query_id, ok, value))

    # -- the engine --------------------------------------------------------------
    def _step(self) -> None:
        outputs = step_or_fail(self.engine)
        if outputs:
            self._send_outputs(outputs)

    def _run_hooks(self) -> None:
        run_hooks(self.hooks, self.engine)

    def _wait(self) -> None:
        if self._compiling or self._queued:  # a compile runs, or waits for the bound
            timeout = TRANSFER_POLL_S
        elif not self.engine.has_work:
            timeout = IDLE_S
        elif not self.engine.has_runnable:
            timeout = TRANSFER_POLL_S
        else:
            return
        self._poller.poll(max(1, round(timeout * 1000)))

    def _fail_all(self, message: str) -> None:
        outputs = self.engine.fail_all(message)
        if outputs:
            self._send_outputs(outputs)

    # -- results -----------------------------------------------------------------
    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        self._stats = self.engine.stats()
        self._send(("out", self._stats, outputs))

    def _send_stats(self) -> None:
        stats = self.engine.stats()
        if stats != self._stats or time.monotonic() - self._sent_at >= HEARTBEAT_S:
            self._stats = stats
            self._send(("stats", stats))

    def _send(self, msg: tuple[Any, ...]) -> None:
        self.results.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        self._sent_at = time.monotonic()


def run_hooks(hooks: list[Hook], engine: LLMEngine) -> None:
    """Each hook on the engine's thread; a failing hook is logged, the others still run."""
    for hook in hooks:
        try:
            hook(engine)
        except Exception:
            logger.exception("engine hook %s failed", getattr(hook, "__name__", hook))
