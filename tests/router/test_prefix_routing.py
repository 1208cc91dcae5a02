"""Prefix-aware routing end to end through the router, with the fakes' real KV events.

The fake prefill workers (pdserve/testing/router_fakes.py) stand in for the real ones and
publish ``stored`` events over ZeroMQ like them.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from tests.router.test_api import client

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GROUPS = [f"System prompt number {g}: " + f"rule {g} says be exact. " * 60 for g in range(3)]


async def _run_groups(c, per_group: int = 4) -> tuple[dict[int, set[str]], int]:
    """Which prefill workers served each group, and how many requests hit the cache."""
    cl = client(c.url)
    hits = 0
    for r in range(per_group):
        for system in GROUPS:  # interleaved: g0 g1 g2 g0 g1 g2 ...
            out = await cl.completions.create(
                model="tiny", prompt=system + f"question {r}", max_tokens=2
            )
            hits += out.usage.prompt_tokens_details.cached_tokens > 0
    where: dict[int, set[str]] = defaultdict(set)
    for st in c.prefill:
        for req in st.requests:
            ids = req.prompt_token_ids
            g = next(
                i for i, s in enumerate(GROUPS) if ids[:40] == c.runtime.tokenizer.encode(s)[:40]
            )
            where[g].add(st.worker_id)
    return where, hits


async def test_groups_stick_to_one_prefill_worker(cluster_factory) -> None:
    async with cluster_factory(n_prefill=2, disagg_threshold=16) as c:
        where, hits = await _run_groups(c)
        assert all(len(ws) == 1 for ws in where.values()), where
        assert hits == 3 * 3  # all but each group's first request
        # the index learnt the blocks from the workers' own events as well
        await asyncio.sleep(0.3)
        assert c.runtime.subscriber.num_events >= 1
        assert c.runtime.index.workers() <= {"p0", "p1"}
        await c.settle()


async def test_round_robin_spreads_groups(cluster_factory) -> None:
    async with cluster_factory(n_prefill=2, disagg_threshold=16, picker="round-robin") as c:
        where, hits = await _run_groups(c)
        assert all(len(ws) == 2 for ws in where.values()), where
        assert hits == 3 * 2  # each group missed once on each worker
        await c.settle()
