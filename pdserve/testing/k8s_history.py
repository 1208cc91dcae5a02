"""resourceVersion semantics for the emulator: list at a version, watch from a version, 410 Gone.

kmock 0.8 lists with ``resourceVersion: "..."`` and, on every watch, replays all objects
as ADDED and then streams what comes next; it ignores ``labelSelector``, ``resourceVersion``
and ``timeoutSeconds``. For the resources named in ``ApiServer.versioned`` (EndpointSlices:
the router's discovery) this module does what a real API server (etcd's watch cache) does:

- a LIST answers the objects matching ``labelSelector`` and the current resourceVersion;
- a WATCH from resourceVersion R streams every later event that matches, in order, from a
  bounded history; when R is older than that history (compacted), it sends one ERROR event
  with a ``Status`` of code 410 (reason ``Expired``) and ends, as the API server does;
- ``timeoutSeconds`` ends a watch after that long (the client resumes from its last version);
- a DELETED event carries a new resourceVersion.
Other resources keep kmock's behaviour (the operator's kopf tests were written against it).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

_IN = re.compile(r"^\s*([^\s!=]+)\s+in\s+\(([^)]*)\)\s*$")


def _split_selector(selector: str) -> list[str]:
    """Split on the commas outside parentheses (``a=b,c in (d,e)``)."""
    parts, depth, cur = [], 0, ""
    for ch in selector:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p for p in [*parts, cur] if p.strip()]


def _in(key: str, values: set[str], labels: Mapping[str, str]) -> bool:
    return labels.get(key) in values


def _ne(key: str, value: str, labels: Mapping[str, str]) -> bool:
    return labels.get(key) != value


def _eq(key: str, value: str, labels: Mapping[str, str]) -> bool:
    return labels.get(key) == value


def label_matcher(selector: str) -> Callable[[Mapping[str, str]], bool]:
    """The equality (``k=v``, ``k==v``, ``k!=v``) and set (``k in (a,b)``) selector forms."""
    tests: list[Callable[[Mapping[str, str]], bool]] = []
    for part in _split_selector(selector or ""):
        if m := _IN.match(part):
            key, values = m[1], {v.strip() for v in m[2].split(",")}
            tests.append(functools.partial(_in, key, values))
        elif "!=" in part:
            key, value = (s.strip() for s in part.split("!=", 1))
            tests.append(functools.partial(_ne, key, value))
        elif "=" in part:
            key, value = (s.strip() for s in part.replace("==", "=").split("=", 1))
            tests.append(functools.partial(_eq, key, value))
        else:
            raise ValueError(f"unsupported label selector {part!r}")
    return lambda labels: all(t(labels) for t in tests)


def matches(obj: Mapping[str, Any], namespace: str | None, selector: str) -> bool:
    meta = obj.get("metadata") or {}
    if namespace is not None and meta.get("namespace") != namespace:
        return False
    return label_matcher(selector)(meta.get("labels") or {})


def rv_of(obj: Mapping[str, Any]) -> int:
    return int((obj.get("metadata") or {}).get("resourceVersion") or 0)


class History:
    """The last ``size`` events of one resource, in resourceVersion order, for watches."""

    def __init__(self, size: int = 1000) -> None:
        self.events: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(maxlen=size)
        self.compacted = 0  # a watch from a version below this one is answered 410
        self.cond = asyncio.Condition()

    @property
    def last(self) -> int:
        """The version a LIST answers: every event up to it is in (or compacted from) here."""
        return self.events[-1][0] if self.events else max(self.compacted, 1)

    async def put(self, rv: int, event: dict[str, Any]) -> None:
        async with self.cond:
            if len(self.events) == self.events.maxlen:
                self.compacted = self.events[0][0]
            self.events.append((rv, event))
            self.cond.notify_all()

    def compact(self, rv: int) -> None:
        """Forget everything up to ``rv`` (what etcd compaction does to old versions)."""
        self.compacted = max(self.compacted, rv)
        while self.events and self.events[0][0] <= rv:
            self.events.popleft()

    def after(self, rv: int) -> list[tuple[int, dict[str, Any]]]:
        return [(v, e) for v, e in self.events if v > rv]


def gone(rv: int) -> dict[str, Any]:
    message = f"too old resource version: {rv}"
    status = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": "Expired",
        "code": 410,
    }
    return {"type": "ERROR", "object": status}


async def watch_from(
    history: History, rv: int, namespace: str | None, selector: str, timeout_s: float
) -> AsyncIterator[Any]:
    """The stream of one watch request (kmock renders each dict as one JSON line)."""
    yield b""  # send the headers now, even if nothing happens for a while
    if rv < history.compacted:
        yield gone(rv)
        return
    deadline = time.monotonic() + timeout_s
    while True:
        async with history.cond:
            batch = history.after(rv)
            if not batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                try:
                    await asyncio.wait_for(history.cond.wait(), left)
                except TimeoutError:
                    return
                continue
        for version, event in batch:
            rv = version
            if matches(event["object"], namespace, selector):
                yield event
