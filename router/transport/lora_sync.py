"""Adapters follow workers that join late: after each health round, a healthy worker whose
``/stats`` ``lora_known`` lacks an adapter of the router's table (a scale-up, a restarted
worker, one that missed a run-time load) is told to load it, from the path the router
has for it (``--lora``, ``spec.adapters`` or the admin load), at most once per
``RETRY_S`` per worker and adapter. A worker that answers another hash, or an adapter
unloaded meanwhile, is unloaded there again: no worker serves weights the router does
not list. With ``--procs``, process 0 alone does it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from pdserve.router.adapters import Adapter, AdapterTable
from pdserve.router.errors import APIError
from pdserve.router.scheduling.snapshot import Snapshot
from pdserve.router.transport import lora_fanout

log = logging.getLogger(__name__)
RETRY_S = 30.0


class LoraSync:
    def __init__(
        self,
        table: AdapterTable,
        snapshot: Callable[[], Snapshot],
        client: aiohttp.ClientSession,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table, self.snapshot, self.client, self.clock = table, snapshot, client, clock
        self._tried: dict[tuple[str, str], float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def check(self) -> None:
        """After a health round (Discovery.after_refresh): start the loads that are due."""
        if not len(self.table):
            return
        now = self.clock()
        for w in self.snapshot().workers:
            if not w.healthy or not w.stats.worker_id:  # not polled yet: its list is unknown
                continue
            for a in self.table.adapters():
                key = (w.url, a.name)
                if a.name in w.stats.lora_known or now - self._tried.get(key, -RETRY_S) < RETRY_S:
                    continue
                self._tried[key] = now
                task = asyncio.get_running_loop().create_task(self._load(w.url, a))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _load(self, url: str, a: Adapter) -> None:
        try:
            digest = await lora_fanout.load(self.client, [url], a.name, a.path)
        except APIError as exc:
            log.warning(
                "LoRA adapter %s not loaded on %s (retried in %.0f s): %s",
                a.name,
                url,
                RETRY_S,
                exc.message,
            )
            return
        if self.table.get(a.name) != a or digest != a.hash:  # unloaded or replaced meanwhile
            log.warning(
                "LoRA adapter %s on %s: unloading it there again (hash %s, the router's %s)",
                a.name,
                url,
                digest,
                a.hash,
            )
            await lora_fanout.unload(self.client, [url], a.name, quiet=True)
            return
        log.info("LoRA adapter %s loaded on %s, which did not know it", a.name, url)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
