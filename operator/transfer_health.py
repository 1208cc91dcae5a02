"""Make a silent KV-transfer fallback visible: a Warning Event when decode recomputes too often.

A decode worker whose NIXL read fails recomputes the prompt (``onTransferFailure:
recompute``): requests still succeed, only slower, so a blocked port range or a broken
RDMA path goes unnoticed. Every ``interval`` the operator scrapes each decode pod's
``/metrics`` (the headless ``<name>-decode`` Service resolves to every pod: no API
request) and compares ``pdserve_kv_transfer_failures_total`` with the completed transfers
(``pdserve_kv_transfer_seconds_count``). Above ``threshold`` of the interval's transfers
(and at least ``min_failures``), it posts ``Warning KVTransferFallback`` on the LLMService.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from pdserve.operator import naming as n

FAILURES = "pdserve_kv_transfer_failures_total"
COMPLETED = "pdserve_kv_transfer_seconds_count"


@dataclass(frozen=True)
class Counts:
    failures: float = 0.0
    completed: float = 0.0

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.failures - other.failures, self.completed - other.completed)


def parse(text: str) -> Counts:
    """Sum the two counters over all label sets of one /metrics page."""
    failures = completed = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (FAILURES, COMPLETED):
            value = float(line.rsplit(" ", 1)[1])
            failures += value if name == FAILURES else 0.0
            completed += value if name == COMPLETED else 0.0
    return Counts(failures, completed)


def assess(delta: Counts, threshold: float, min_failures: int) -> str:
    """The Warning message for one interval, or "" when transfers are healthy."""
    total = delta.failures + delta.completed
    if delta.failures < min_failures or total <= 0 or delta.failures / total <= threshold:
        return ""
    share = delta.failures / total
    return (
        f"{share:.0%} of KV transfers failed in the last interval ({delta.failures:.0f} of "
        f"{total:.0f}); decode recomputed those prompts. Check the NetworkPolicy and "
        "kvTransfer.ucxTcpPortRange (UCX over TCP) or the RDMA devices."
    )


async def resolve(host: str) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, n.HTTP_PORT, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


async def scrape(session: aiohttp.ClientSession, urls: list[str], timeout_s: float = 5.0) -> Counts:
    total = Counts()
    for url in urls:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                c = parse(await r.text())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            continue  # a pod that is starting or going: the next interval sees it
        total = Counts(total.failures + c.failures, total.completed + c.completed)
    return total


def decode_urls(name: str, namespace: str) -> Callable[[], Awaitable[list[str]]]:
    host = f"{n.pool_service_name(name, 'decode')}.{namespace}.svc"

    async def urls() -> list[str]:
        try:
            return [f"http://{ip}:{n.HTTP_PORT}/metrics" for ip in await resolve(host)]
        except OSError:
            return []  # no ready decode pod (or not in a cluster)

    return urls
