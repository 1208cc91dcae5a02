"""Output streams between an engine and its asyncio callers.

An engine (its own thread, or a core process behind a socket) hands each request's
output deltas to a queue on the caller's event loop; the caller reads them with
:func:`follow`. Torch-free, so the worker front ends share it with the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from pdserve.protocol.outputs import RequestOutput

Streams = dict[str, tuple[asyncio.AbstractEventLoop, "asyncio.Queue[Any]"]]


async def follow(
    stream: asyncio.Queue[Any], request_id: str, abort: Callable[[str], Any]
) -> AsyncGenerator[RequestOutput, None]:
    """A request's output deltas from its stream until it finishes. Deltas a slow reader
    fell behind on come as one; an exception in the stream (the request was refused) is
    raised; leaving the iteration early aborts the request."""
    finished = False
    try:
        while not finished:
            out = await stream.get()
            if isinstance(out, Exception):
                finished = True  # refused: nothing to abort
                raise out
            while not out.finished and not stream.empty():  # fell behind: one delta
                out = out.then(stream.get_nowait())
            finished = out.finished
            yield out
    finally:
        if not finished:
            abort(request_id)


def hand_over(streams: Streams, outputs: list[RequestOutput], abort: Callable[[str], Any]) -> None:
    """Hand outputs to their streams with one wake-up per event loop, not one per request
    (each wake-up is a write to the loop's self-pipe and a GIL hand-off). A finished
    request's stream is forgotten; ``abort`` ends a request whose caller's loop has closed
    (nobody is listening)."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
    for out in outputs:
        target = streams.get(out.request_id)
        if target is None:
            continue
        if out.finished:
            del streams[out.request_id]
        batches.setdefault(target[0], []).append((target[1], out))
    for loop, items in batches.items():
        try:
            loop.call_soon_threadsafe(put_all, items)
        except RuntimeError:  # the caller's loop is closed
            for _stream, item in items:
                abort(item.request_id)


def put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)
