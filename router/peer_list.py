"""``--budget-peers @FILE``: the router replicas' URLs in a file, re-read when it changes.

For deployments without the router Service's endpoints (``kubernetes``) whose membership
still changes: whoever adds or removes a replica rewrites the file on each of them
(comma-, space- or line-separated URLs, ``#`` comments), best by writing a new file and
renaming it over the old (a file read half-written is a list nobody meant; one with no
URL is refused). Each replica reads it every
``POLL_S`` and hands a changed list to ``PeerBudgets.set_peers`` (router/peer_budgets.py),
whose hand-over keeps every key's cap through the change. A list that does not parse is
logged and the last good one is kept; a replica not in the list owns no key (it asks the
others for every one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from pdserve.router.file_watch import WatchedFile
from pdserve.router.peer_budgets import base_url

log = logging.getLogger(__name__)
POLL_S = 0.2
PREFIX = "@"


def read_peers(path: str | Path) -> tuple[str, ...]:
    """The URLs in ``path`` (ValueError for one that is not http://HOST:PORT)."""
    words: list[str] = []
    for line in Path(path).read_text().splitlines():
        words += line.split("#", 1)[0].replace(",", " ").split()
    if not words:  # a file caught while it is written, most likely
        raise ValueError("no URL in it")
    return tuple(base_url(w) for w in words)


class PeerFile:
    """Watches ``path``; calls ``listener`` with each new list."""

    def __init__(self, path: str, listener: Callable[[tuple[str, ...]], None]) -> None:
        self.path, self.listener = path, listener
        self._file = WatchedFile(path, read_peers)
        self._task: asyncio.Task[None] | None = None

    def check(self) -> None:
        """Re-read the file if it changed (its mtime or size)."""
        try:
            peers = self._file.changed()
        except (OSError, ValueError) as exc:
            log.warning("--budget-peers %s%s: %s (the last list is kept)", PREFIX, self.path, exc)
            return
        if peers is not None:
            self.listener(peers)

    def start(self) -> None:
        async def run() -> None:
            while True:
                await asyncio.sleep(POLL_S)
                try:
                    self.check()
                except Exception:  # a failed change must not stop the next ones
                    log.exception("--budget-peers %s%s: the new list failed", PREFIX, self.path)

        self._task = asyncio.get_running_loop().create_task(run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
