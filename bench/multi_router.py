"""Active-active router replicas: does prefix routing through 3 replicas match one router?

Real workers (``pdserve.local.processes``: 2 prefill + 1 decode, each prefill KV cache
sized to hold half the groups' prefixes) and the routing benchmark's shared-prefix
workload (``bench/routing.py``: G groups x R requests sharing a long system prompt,
interleaved). Phases, each with fresh system prompts:

1. ``one``: every request through one router;
2. ``three``: through 3 router replicas, a round-robin client (request i to replica
   i mod 3): each replica sees a third of every group and knows where the others sent
   the rest only from the workers' KV events;
3. ``late``: a 4th replica started as the last repeat begins, while the others serve
   (KV events keep coming while it catches up); once its ``/health`` says ready (prefix
   index caught up from each prefill worker's ``GET /kv_blocks`` snapshot plus the
   events after it), that repeat's three-replica groups' next requests (fresh suffixes)
   for ``--late-window`` seconds (5), in turn through it and through a replica that saw
   everything (the control), beside the running phases: its hit ratio against the
   control's.

Phases 1 and 2 run interleaved, round by round (a round: each group once), so both see
the same machine load (a shared 2-core box swings by 2x within a minute); each workload
has its own groups, and the prefill caches are sized for half of both workloads' groups
and a quarter more (the routing benchmark's sizing, doubled, with headroom; see
``parse_args``). ``--repeats`` runs more such pairs. TTFT p50
is over all of a kind's requests. Hit ratio =
cached prompt tokens / prompt tokens (from each response's usage). The last stdout line
is JSON: ``prefix_hit_ratio_1``, ``prefix_hit_ratio_3``, ``hit_ratio_3_over_1``,
``ttft_p50_ms_1``, ``ttft_p50_ms_3``, ``ttft_p50_3_over_1``, ``late_hit_ratio``,
``late_control_hit_ratio``, ``late_over_control``, ``late_ready_s`` (start to ready),
``late_requests``, ``loadavg`` (1, 5, 15 min, at the end).

    python bench/multi_router.py            # small preset, 8 x 16 requests per phase
    python bench/multi_router.py --quick    # tiny preset, 4 x 8, one repeat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import routing  # bench/routing.py, beside this script: its workload and client

from pdserve.local.processes import LocalCluster, Proc

REPLICAS = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    routing.add_workload_arguments(p)
    p.add_argument("--repeats", type=int, default=2, help="one/three phase pairs")
    p.add_argument("--late-window", type=float, default=5.0, help="seconds after ready")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.groups, args.per_group, args.repeats = "tiny", 4, 8, 1
    # routing.py's sizing (the two caches hold the working set once) for both workloads,
    # plus a quarter: replicas place a new group without seeing each other's placements of
    # the same instant (the events come after the prefill), so a first round may put one
    # more group on a worker than one router would; with no headroom at all that one group
    # would thrash both workloads' caches for the whole run (measured: ratio 0.56-0.82
    # from run to run with both kinds), which is the cache's sizing, not routing
    args.cache_groups = args.groups * 1.25
    return args


async def run_phase(
    h: httpx.AsyncClient,
    urls: list[str],
    prompts: list[tuple[int, list[int]]],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Prompts in arrival order, request i to ``urls[i % len(urls)]`` (the round-robin
    client), at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(args.concurrency)

    async def one(i: int, g: int, ids: list[int]) -> dict[str, Any]:
        async with sem:
            url = urls[i % len(urls)]
            return {"group": g, **await routing.via_router(h, url, "bench", ids, args.max_tokens)}

    tasks = []
    for i, (g, ids) in enumerate(prompts):
        tasks.append(asyncio.create_task(one(i, g, ids)))
        await asyncio.sleep(0)  # keep arrival order
    return list(await asyncio.gather(*tasks))


def hit_ratio(results: list[dict[str, Any]]) -> float:
    return sum(r["cached"] for r in results) / max(sum(r["prompt"] for r in results), 1)


async def wait_ready(h: httpx.AsyncClient, url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await h.get(url + "/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout:.0f}s")
        await asyncio.sleep(0.05)


async def late_phase(
    h: httpx.AsyncClient,
    late: Proc,
    old: str,
    prompts: list[tuple[int, list[int]]],
    args: argparse.Namespace,
) -> dict[str, float]:
    """``late`` was just started, while the other replicas serve; once it is ready, the
    groups' next requests for ``late_window`` seconds, in turn through it and through a
    replica that saw everything (``old``, the control: the same groups at the same
    moments, so the same ratio if the late one caught up). Sequential: the client does
    not outrun the window."""
    t0 = time.monotonic()
    await wait_ready(h, late.url)
    ready_s = time.monotonic() - t0
    end = time.monotonic() + args.late_window
    results: dict[str, list[dict[str, Any]]] = {"late": [], "control": []}
    for i, (_, ids) in enumerate(prompts):
        if time.monotonic() > end:
            break
        kind, url = ("late", late.url) if i % 2 == 0 else ("control", old)
        results[kind].append(await routing.via_router(h, url, "bench", ids, args.max_tokens))
    return {
        "late_ready_s": ready_s,
        "late_hit_ratio": hit_ratio(results["late"]),
        "late_control_hit_ratio": hit_ratio(results["control"]),
        "late_requests": float(len(results["late"])),
    }


def fresh_suffixes(
    prompts: list[tuple[int, list[int]]], args: argparse.Namespace, vocab: int
) -> list[tuple[int, list[int]]]:
    """The same groups' system prompts with new suffixes (their next requests)."""
    rng = random.Random(7)
    return [
        (g, ids[: args.system_tokens] + [rng.randrange(16, vocab) for _ in range(12)])
        for g, ids in prompts
    ]


async def measure(
    cluster: LocalCluster,
    one: str,
    three: list[str],
    vocab: int,
    common: list[str],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    limits = httpx.Limits(max_connections=64)
    runs: dict[str, list[dict[str, Any]]] = {"one": [], "three": []}
    async with httpx.AsyncClient(timeout=600, limits=limits, auth=cluster.auth) as h:
        for url in [one, *three]:  # warm every router's and worker's code paths
            for _, ids in routing.workload(args, vocab, seed=1)[:2]:
                await routing.via_router(h, url, "bench", ids[:200], args.max_tokens)
        seed = 10
        g = args.groups
        late_task = None
        for rep in range(args.repeats):
            seed += 2
            work = {
                "one": routing.workload(args, vocab, seed),
                "three": routing.workload(args, vocab, seed + 1),
            }
            if rep == args.repeats - 1:  # mid-run: catching up while the others serve
                late = cluster.start_router(0, "router-late", common)
                later = fresh_suffixes(work["three"], args, vocab)
                late_task = asyncio.create_task(late_phase(h, late, three[0], later, args))
            sent = {"one": 0, "three": 0}  # the round-robin client's position
            for r in range(args.per_group):  # round by round, the two kinds in turn
                for kind, urls in (("one", [one]), ("three", three)):
                    rnd = work[kind][r * g : (r + 1) * g]
                    rotated = urls[sent[kind] % len(urls) :] + urls[: sent[kind] % len(urls)]
                    runs[kind] += await run_phase(h, rotated, rnd, args)
                    sent[kind] += len(rnd)
        assert late_task is not None
        late_result = await late_task
    ttft = {k: routing.pct([r["ttft"] for r in v], 0.5) for k, v in runs.items()}
    summary: dict[str, Any] = {
        "prefix_hit_ratio_1": hit_ratio(runs["one"]),
        "prefix_hit_ratio_3": hit_ratio(runs["three"]),
        "ttft_p50_ms_1": ttft["one"],
        "ttft_p50_ms_3": ttft["three"],
        "ttft_p99_ms_1": routing.pct([r["ttft"] for r in runs["one"]], 0.99),
        "ttft_p99_ms_3": routing.pct([r["ttft"] for r in runs["three"]], 0.99),
        "requests_per_kind": len(runs["one"]),
        **late_result,
    }
    summary["hit_ratio_3_over_1"] = summary["prefix_hit_ratio_3"] / summary["prefix_hit_ratio_1"]
    summary["ttft_p50_3_over_1"] = ttft["three"] / ttft["one"]
    summary["late_over_control"] = summary["late_hit_ratio"] / max(
        summary["late_control_hit_ratio"], 1e-9
    )
    return summary, runs


def plot(runs: dict[str, list[dict[str, Any]]], summary: dict[str, Any], path: Path) -> None:
    plt = routing.figures.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in (("1 router", runs["one"]), (f"{REPLICAS} replicas", runs["three"])):
        xs = sorted(r["ttft"] * 1000 for r in res)
        a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    a.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT")
    a.legend()
    names = ["1 router", f"{REPLICAS} replicas", "late replica\n(first 5 s)"]
    vals = [summary["prefix_hit_ratio_1"], summary["prefix_hit_ratio_3"], summary["late_hit_ratio"]]
    b.bar(names, vals, color=["C0", "C1", "C2"])
    b.set(ylim=(0, 1), title="prefix-cache hit ratio (tokens)")
    fig.suptitle(
        f"hit ratio 3/1 = {summary['hit_ratio_3_over_1']:.3f}, TTFT p50 3/1 = "
        f"{summary['ttft_p50_3_over_1']:.2f}, late replica ready in "
        f"{summary['late_ready_s']:.1f} s"
    )
    routing.figures.save(fig, path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = routing.ensure_model(args)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    cache_bytes = routing.prefill_cache_bytes(args, model_dir, args.cache_groups)
    spec = routing.cluster_spec(args, model_dir, cache_bytes, "multi-router-logs")
    common = ["--disagg-threshold", "64", "--max-queue", "1024"]
    with LocalCluster(spec) as cluster:
        cluster.start_workers()
        one = cluster.start_router(0, "router-one", common)
        three = [cluster.start_router(0, f"router-{i}", common) for i in range(REPLICAS)]
        cluster.wait_healthy(600, on_ready=lambda p, s: print(f"{p.name} ready ({s:.1f}s)"))
        for proc in (one, *three):
            cluster.wait_routed(proc)
        summary, runs = asyncio.run(
            measure(cluster, one.url, [p.url for p in three], vocab, common, args)
        )
    summary.update(
        groups=args.groups,
        per_group=args.per_group,
        repeats=args.repeats,
        system_tokens=args.system_tokens,
        prefill_cache_bytes=cache_bytes,
        quick=args.quick,
        loadavg=[round(x, 2) for x in os.getloadavg()],
    )
    name = "multi_router-quick.png" if args.quick else "multi_router.png"
    plot(runs, summary, Path(args.out) / name)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
