"""``n`` > 1: the prompt is prefilled, and its KV transferred, once for all choices.

Choice 0 runs the usual plan (remote prefill → decode worker). Once its first token
from the decode worker arrives, its prompt KV sits in that worker's prefix cache (the
blocks are registered there once the transfer is verified), and choices 1..n-1 start
on the same worker as local prefills: their full prompt blocks are prefix-cache hits,
shared by reference count, and only the last partial block (fewer than block_size
tokens) is recomputed per choice instead of copied. All n then decode in the same
batch. A seeded request gives choice i the seed ``seed + i``.

With ``--pd-handoff decode`` the decode worker streams the prefill's first token before it
pulls the KV, so there choices 1..n-1 start at choice 0's second token (or its end):
started at the first, they could find no block there (all three or one of three, by
timing, in the tests) and prefilled the prompt again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from pdserve.protocol.sampling_params import SEED_MAX, SEED_MIN
from pdserve.router.scheduling import disagg
from pdserve.router.scheduling.routing import RoutePlan
from pdserve.router.transport.dispatch import Delta, Dispatcher, RequestState

_END = object()


def _kv_on_decode(rs: RequestState) -> bool:
    """Choice 0's prompt KV is in its decode worker's prefix cache: a token came from that
    worker after the pull (a chained request's first token is the prefill worker's)."""
    return rs.decode_worker is not None and (not rs.chained or len(rs.output_ids) >= 2)


class Choices:
    def __init__(self, dispatcher: Dispatcher, rs0: RequestState, plan: RoutePlan, n: int):
        self.dispatcher = dispatcher
        self.plan = plan
        self.n = n
        self.states = [rs0]

    async def events(self) -> AsyncGenerator[tuple[int, Delta], None]:
        """(choice index, delta) as they arrive; closing it aborts every choice."""
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(0, self.plan, queue))]
        running, started = 1, self.n == 1
        try:
            while running or not started:
                if not running:  # choice 0 ended before reaching a decode worker
                    running += self._start_rest(queue, tasks)
                    started = True
                    continue
                i, item = await queue.get()
                if item is _END:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield i, item
                if not started and _kv_on_decode(self.states[0]):
                    running += self._start_rest(queue, tasks)
                    started = True
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _start_rest(self, queue: asyncio.Queue[tuple[int, Any]], tasks: list[Any]) -> int:
        rs0 = self.states[0]
        decode = (rs0.decode_worker,) if rs0.decode_worker is not None else self.plan.decode
        plan = RoutePlan(disagg.LOCAL_PREFILL, (), tuple(decode), 0)
        for i in range(1, self.n):
            sampling = rs0.sampling
            if sampling.seed is not None:  # wraps within the 64-bit range torch accepts
                span = SEED_MAX - SEED_MIN + 1
                sampling = replace(sampling, seed=(sampling.seed + i - SEED_MIN) % span + SEED_MIN)
            rs = RequestState(
                f"{rs0.request_id}-{i}",
                rs0.prompt_ids,
                sampling,
                cache_salt=rs0.cache_salt,
                lora=rs0.lora,
            )
            self.states.append(rs)
            tasks.append(asyncio.create_task(self._pump(i, plan, queue)))
        return self.n - 1

    async def _pump(self, i: int, plan: RoutePlan, queue: asyncio.Queue[tuple[int, Any]]) -> None:
        events = self.dispatcher.run(self.states[i], plan)
        try:
            async for d in events:
                await queue.put((i, d))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((i, exc))
        finally:
            await events.aclose()
            await queue.put((i, _END))

    @property
    def completion_tokens(self) -> int:
        return sum(rs.completion_tokens for rs in self.states)
