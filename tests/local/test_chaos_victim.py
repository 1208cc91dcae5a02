"""bench/chaos.py picks its decode victim only once the victim's own /stats shows it running
>= 4 of the phase's streams (issue 28 item 8): a full run once killed a worker that held
none, reported ``migrated_streams`` 0 and still passed. Here the workers are scripted
stats (no service: the pick is a pure loop over /stats answers; the full path runs in
test_bench_chaos.py), so the test is fast and shows the kill waits for the load.
"""

from __future__ import annotations

import asyncio
from typing import Any

import chaos
import pytest

pytestmark = pytest.mark.unit


class Workers:
    """/stats of two decode workers whose running counts follow a script, one step per
    poll of ``busiest``; generation_tokens grows so min_new_tokens is met at once."""

    def __init__(self, script: dict[str, list[int]]) -> None:
        self.script, self.step, self.acted = script, 0, []

    def stats(self, url: str) -> dict[str, Any]:
        runs = self.script[url]
        running = runs[min(self.step, len(runs) - 1)]
        return {"running": running, "generation_tokens": 1000 * (self.step + 1)}

    def busiest(self, urls: list[str], counts: tuple[str, ...]) -> tuple[str, dict] | None:
        self.step += 1
        best = max(urls, key=lambda u: self.stats(u)["running"])
        s = self.stats(best)
        return (best, s) if s["running"] else None

    def act(self, url: str) -> bool:
        self.acted.append((url, self.stats(url)["running"]))
        return True


def _pick(monkeypatch, workers: Workers, end_after_s: float) -> tuple[str, list[int]]:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(chaos, "busiest", workers.busiest)
    monkeypatch.setattr(chaos, "stats", workers.stats)

    async def go() -> tuple[str, list[int]]:
        streams = [asyncio.ensure_future(asyncio.sleep(end_after_s))]
        seen: list[int] = []
        victim = await chaos._kill_busiest(
            list(workers.script),
            streams,
            ("running",),
            24,
            workers.act,
            chaos.VICTIM_MIN_STREAMS,
            seen,
        )
        await asyncio.gather(*streams)
        return victim, seen

    return asyncio.run(go())


def test_victim_is_killed_only_once_it_runs_four_streams(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # b is busiest first with 1-3 streams (the old rule killed it then); a reaches 5
    w = Workers({"a": [0, 0, 1, 2, 5, 5, 5, 5], "b": [1, 2, 3, 3, 3, 3, 3, 3]})
    victim, seen = _pick(monkeypatch, w, end_after_s=5.0)
    assert victim == "a" and seen == [5]
    assert w.acted == [("a", 5)], w.acted  # nothing was killed below 4


def test_no_victim_when_no_worker_reaches_four(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The streams end without any worker holding 4: no kill, the victim is "" and the
    phase reports decode_kill_passed False (the bench then exits 1)."""
    w = Workers({"a": [3], "b": [3]})
    victim, seen = _pick(monkeypatch, w, end_after_s=0.3)
    assert victim == "" and seen == [] and w.acted == []
