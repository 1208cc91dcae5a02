"""LoRA affinity in routing: the router's own ``plan_route`` over a simulated pool.

Each request names one of ``adapters`` adapters (Zipf popularity); each worker of both
pools keeps ``capacity`` adapters resident (``--max-cpu-loras``, least recently used out:
what its ``/stats`` ``loras`` lists), and runs each request for an exponential time, so
load scores matter too. A request routed to a worker that holds its adapter is a *hit*
(no read from disk before its first step); a miss loads it there, evicting the least
recently used. The same arrivals are routed twice: with the default scorers
(``lora-affinity`` on) and with it removed (off). Pure: no processes, no clock.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol.contract import WorkerStats
from pdserve.router.config import DECODE_SCORERS, PREFILL_SCORERS, RouterConfig
from pdserve.router.scheduling.route_request import RouteRequest
from pdserve.router.scheduling.routing import plan_route
from pdserve.router.scheduling.snapshot import Snapshot, WorkerView


@dataclass
class SimWorker:
    role: str
    worker_id: str
    resident: OrderedDict[str, None] = field(default_factory=OrderedDict)
    busy_until: list[float] = field(default_factory=list)  # one end time per running request

    def view(self, now: float, known: list[str]) -> WorkerView:
        self.busy_until = [t for t in self.busy_until if t > now]
        stats = WorkerStats(
            role=self.role,
            worker_id=self.worker_id,
            running=len(self.busy_until),
            kv_blocks_free=1000,
            kv_blocks_total=1000,
            loras=list(self.resident),
            lora_known=known,
        )
        return WorkerView(f"http://{self.worker_id}", self.role, stats=stats)

    def serve(self, name: str, now: float, hold: float, capacity: int) -> bool:
        hit = name in self.resident
        self.resident[name] = None
        self.resident.move_to_end(name)
        while len(self.resident) > capacity:
            self.resident.popitem(last=False)
        self.busy_until.append(now + hold)
        return hit


def _config(affinity: bool) -> RouterConfig:
    if affinity:  # the defaults
        return RouterConfig(model_dir="/m", disagg_threshold=0)
    return RouterConfig(
        model_dir="/m",
        disagg_threshold=0,
        scorers=tuple(p for p in PREFILL_SCORERS if p[0] != "lora"),
        decode_scorer_weights=tuple(p for p in DECODE_SCORERS if p[0] != "lora"),
    )


def simulate(
    affinity: bool,
    *,
    workers: int = 4,
    adapters: int = 32,
    capacity: int = 8,
    requests: int = 4000,
    zipf_s: float = 1.0,
    busy: float = 6.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Hit ratios per pool and the decode pool's load spread, for one routing setting.
    ``busy``: requests running per worker on average (arrivals 1 per time unit)."""
    rng = random.Random(seed)
    names = [f"lora{i}" for i in range(adapters)]
    weights = [1.0 / (i + 1) ** zipf_s for i in range(adapters)]
    pools = {
        role: [SimWorker(role, f"{role[0]}{i}") for i in range(workers)]
        for role in ("prefill", "decode")
    }
    cfg, route_rng = _config(affinity), random.Random(seed + 1)
    hits = {"prefill": 0, "decode": 0}
    spread: list[float] = []
    now = 0.0
    for _ in range(requests):
        now += rng.expovariate(1.0)
        name = rng.choices(names, weights)[0]
        snap = Snapshot(tuple(w.view(now, names) for role in pools for w in pools[role]))
        plan = plan_route(snap, RouteRequest(64, lora=name), cfg, route_rng)
        hold = rng.expovariate(1.0 / (busy * workers))
        for role, view in (("prefill", plan.prefill[0]), ("decode", plan.decode[0])):
            worker = next(w for w in pools[role] if w.worker_id == view.worker_id)
            hits[role] += worker.serve(name, now, hold if role == "decode" else 1.0, capacity)
        running = [len(w.busy_until) for w in pools["decode"]]
        if sum(running):
            spread.append(max(running) / (sum(running) / len(running)))
    return {
        "prefill_hit_ratio": hits["prefill"] / requests,
        "decode_hit_ratio": hits["decode"] / requests,
        "decode_max_over_mean_running": sum(spread) / max(len(spread), 1),
    }


def compare(**kw: Any) -> dict[str, Any]:
    """Affinity on vs off over the same arrivals, flattened for the bench's JSON line."""
    on, off = simulate(True, **kw), simulate(False, **kw)
    out: dict[str, Any] = {f"routing_{k}_affinity_on": v for k, v in on.items()}
    out.update({f"routing_{k}_affinity_off": v for k, v in off.items()})
    out["routing_setup"] = {
        "workers_per_pool": kw.get("workers", 4),
        "adapters": kw.get("adapters", 32),
        "resident_per_worker": kw.get("capacity", 8),
        "requests": kw.get("requests", 4000),
        "zipf_s": kw.get("zipf_s", 1.0),
    }
    return out
