"""One /metrics page for a router of several processes (``pdserve router --procs N``).

Every process keeps its own registry; the one a scrape lands on fetches the others' pages
from their loopback metrics ports and returns all of them as one exposition, each sample
labelled ``proc`` with its process index. Counters and histograms then add up the way
Prometheus (and the planner, planner/metrics.py, which sums over labels) expects, and a
dashboard can still show each process. A process that does not answer within the timeout
is left out of that scrape (its series reappear on the next), never failing the scrape.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PROC_LABEL = "proc"
FETCH_TIMEOUT_S = 2.0


class _Pages:
    """A collector over already-rendered pages, one per process index."""

    def __init__(self, pages: Sequence[tuple[int, str]]) -> None:
        self.pages = pages

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for index, page in self.pages:
            for fam in text_string_to_metric_families(page):
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    labels = {**s.labels, PROC_LABEL: str(index)}
                    out.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
        return list(merged.values())


def merge(pages: Sequence[tuple[int, str]]) -> bytes:
    """The pages of several processes as one exposition, samples labelled by process."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Pages(pages))  # type: ignore[arg-type]
    return generate_latest(registry)


async def gather(own_index: int, own_page: bytes, ports: Sequence[int]) -> bytes:
    """This process's page and those of the processes at ``ports`` (loopback), merged."""

    async def fetch(session: aiohttp.ClientSession, index: int, port: int) -> tuple[int, str]:
        try:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                if resp.status != 200:
                    return index, ""
                return index, await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return index, ""

    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        others = await asyncio.gather(
            *(fetch(session, i, p) for i, p in enumerate(ports) if i != own_index)
        )
    pages = [(own_index, own_page.decode()), *(p for p in others if p[1])]
    return merge(sorted(pages))
