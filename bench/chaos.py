"""Chaos against ``pdserve up --prefill 2 --decode 2`` on the tiny model (issue 9).

Phases, in order, against one running service:

1. bad-input battery: malformed JSON, huge prompt, unknown model, invalid sampling
   values, bad Unicode, deep JSON ... (bench/chaos_inputs.py): every answer must be a 4xx;
2. poison isolation: poison requests sent among concurrent greedy streams, which must
   all complete;
3. disconnect storm: streams and requests dropped by their clients mid-way;
4. overload beyond ``--max-queue``: 429 with Retry-After, never a 5xx;
5. soak: mixed requests (stream / not, chat / completions, sampling on / off), 10%
   cancelled by their clients;
6. ``kill -9`` of the busiest decode worker under streaming load (streams migrate), once
   its own /stats shows it running >= 4 of the phase's streams; the phase fails (exit 1,
   ``failed_phases``) when no stream migrated. Then of the busiest prefill worker under
   load (retry / local prefill);
7. SIGSTOP of the busiest decode worker, whole, under streaming load: a hung worker closes
   nothing, so the router cuts its streams after ``--stall-timeout`` (3 s here) and they
   migrate; SIGCONT once they are done, and it serves again;
8. tenant attacks (bench/chaos_tenants.py): trickled bodies (slowloris), a client that
   stops reading its stream, chat text spelling control tokens, odd ``logit_bias`` keys;
   and grammar attacks (bench/chaos_grammar.py): pathological schemas beside other
   clients' streams, and requests aborted while their grammar compiles;
9. every KV pool free at the end, and ``up`` still running and stopping cleanly;
10. issue 44's probes (bench/chaos_isolation.py): keyless LoRA changes on the router's
    ``--admin-port``, and in process the endpoint picker's abuse battery, merged pod
    policy escapes, symlinks in a sealed cache, abandoned grammar compiles past their
    bound, run-time LoRA loads outside ``--lora-root``, signed worker calls replayed to
    another worker, misused prefill pins and requests over a per-key cap across router
    replicas (``replica_budget_over_cap``), also while one joins
    (``budget_membership_over_cap``).

Prints one JSON line (last); the goals are 0 for every failure count,
``migrated_streams`` >= 1 and ``stalled_streams`` >= 1. Writes a PNG to bench/out/.

    python bench/chaos.py            # soak of 1,000 requests
    python bench/chaos.py --quick    # the same phases, fewer requests (< ~90 s)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import chaos_client as cc
import figures
import httpx
from chaos_grammar import phase_compile_abort, phase_grammar
from chaos_inputs import bad_inputs, poison_bodies
from chaos_isolation import admin_port_changes, in_process_probes
from chaos_service import (
    ROOT,
    Service,
    busiest,
    counter,
    kill9,
    leaked_blocks,
    resume_group,
    stats,
    stop_group,
    wait_all_healthy,
)
from chaos_tenants import (
    phase_control_tokens,
    phase_odd_values,
    phase_slow_reader,
    phase_slowloris,
)
from lib import flags

WORDS = [
    "the",
    "fox",
    "crow",
    "river",
    "stone",
    "light",
    "quick",
    "brown",
    "lazy",
    "dog",
    "jumps",
    "over",
    "under",
    "story",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = flags.parser(__doc__, "fewer requests (a test runs this)")
    p.add_argument("--model", default="", help="model dir (default: write the tiny model)")
    p.add_argument("--soak", type=int, default=1000, help="soak requests")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--kill-streams", type=int, default=12, help="streams in flight at a kill")
    p.add_argument("--kv-transport", default="nixl", choices=("nixl", "tcp"))
    p.add_argument("--port", type=int, default=0, help="router port (default: a free one)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = p.parse_args(argv)
    args.huge_prompt_chars, args.restart_wait_s = 4_000_000, 120.0
    if args.quick:
        # 10 streams over 2 decode workers: one holds >= 5 while all run (VICTIM_MIN_STREAMS);
        # a soak of 40 still draws every kind of request (stream or not, chat or not,
        # sampling, cancels) several times (issue 45: was 120)
        args.soak, args.kill_streams = 40, 10
        args.huge_prompt_chars, args.restart_wait_s = 1_000_000, 90.0
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def phase_bad_inputs(h: httpx.AsyncClient, model: str, chars: int) -> dict[str, Any]:
    cases = bad_inputs(model, huge_prompt_chars=chars)
    results = await asyncio.gather(*(cc.raw(h, path, body) for _, path, body in cases))
    pairs = list(zip(cases, results, strict=True))
    bad = [f"{name}:{r.status}" for (name, _, _), r in pairs if r.server_error]
    accepted = [name for (name, _, _), r in pairs if r.status == 200]
    return {
        "bad_input_cases": len(cases),
        "bad_input_5xx": len(bad),
        "bad_input_5xx_cases": bad,
        "bad_input_accepted": accepted,
    }


def _greedy(model: str, text: str, n: int) -> dict[str, Any]:
    return {"model": model, "prompt": text, "max_tokens": n, "temperature": 0, "ignore_eos": True}


async def phase_poison(h: httpx.AsyncClient, model: str, n: int) -> dict[str, Any]:
    rng = random.Random(1)
    streams = [
        asyncio.ensure_future(
            cc.stream(h, "/v1/completions", _greedy(model, prompt(rng, 8 + 6 * i), 48))
        )
        for i in range(n)
    ]
    await asyncio.sleep(0.3)  # the streams are in the batch
    poison = poison_bodies(model)
    answers = await asyncio.gather(*(cc.stream(h, "/v1/completions", b) for _, b in poison))
    done = await asyncio.gather(*streams)
    failed = [name for (name, _), r in zip(poison, answers, strict=True) if r.server_error]
    return {"poisoned_streams": sum(not r.ok(48) for r in done), "poison_5xx": failed}


async def phase_storm(h: httpx.AsyncClient, model: str, n: int) -> dict[str, Any]:
    rng, tasks = random.Random(2), []
    for i in range(n):
        body = _greedy(model, prompt(rng, rng.randint(3, 60)), 64)
        if i % 2:
            tasks.append(cc.stream(h, "/v1/completions", body, cancel_after=rng.randint(0, 3)))
        else:
            tasks.append(cc.post(h, "/v1/completions", body, cancel_after_s=rng.uniform(0, 0.3)))
    results = await asyncio.gather(*tasks)
    return {"storm_requests": n, "storm_5xx": sum(r.server_error for r in results)}


async def phase_overload(h: httpx.AsyncClient, model: str, n: int) -> dict[str, Any]:
    rng = random.Random(3)
    bodies = [_greedy(model, prompt(rng, 10), 32) for _ in range(n)]
    results = await asyncio.gather(*(cc.post(h, "/v1/completions", b) for b in bodies))
    shed = [r for r in results if r.status == 429]
    return {
        "overload_requests": n,
        "overload_429": len(shed),
        "overload_429_without_retry_after": sum(not r.retry_after for r in shed),
        "overload_5xx": sum(r.server_error for r in results),
        "overload_other_failures": sum(
            r.status not in (200, 429) or (r.status == 200 and not r.ok()) for r in results
        ),
    }


def _soak_request(h: httpx.AsyncClient, model: str, rng: random.Random) -> tuple[Any, bool, int]:
    chat, streamed, sampled = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5
    n = rng.randint(2, 16)
    text = prompt(rng, rng.randint(2, 50))
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": n,
        "ignore_eos": True,
        "temperature": 0.8 if sampled else 0,
    }
    if sampled and rng.random() < 0.5:
        body["seed"] = rng.randint(0, 2**31)
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    path = "/v1/chat/completions" if chat else "/v1/completions"
    cancel = rng.random() < 0.1
    if streamed:
        return cc.stream(h, path, body, rng.randint(0, 3) if cancel else None), cancel, n
    return cc.post(h, path, body, rng.uniform(0.0, 0.2) if cancel else None), cancel, n


async def phase_soak(h: httpx.AsyncClient, model: str, n: int, conc: int) -> dict[str, Any]:
    rng, sem = random.Random(4), asyncio.Semaphore(conc)
    plans = [_soak_request(h, model, rng) for _ in range(n)]

    async def one(coro: Any) -> cc.Result:
        async with sem:
            return await coro  # type: ignore[no-any-return]

    results = await asyncio.gather(*(one(c) for c, _, _ in plans))
    errors = [
        r
        for r, (_, cancel, n) in zip(results, plans, strict=True)
        if (not r.cancelled and not r.ok(n)) or r.server_error
    ]
    return {
        "soak_requests": n,
        "soak_errors": len(errors),
        "soak_cancelled": sum(r.cancelled for r in results),
        "soak_error_samples": [f"{r.status} {r.error[:80]}" for r in errors[:5]],
    }


# The victim must be seen (in its own /stats) running this many of the phase's streams
# before it dies: a kill that lands on an idle worker migrates nothing and proves nothing.
VICTIM_MIN_STREAMS = 4
# Long enough that a victim's streams overlap and are still under way when it dies: at 320
# tokens a loaded host saw all ten of a quick run's streams end in 2 s, never 4 on one worker
# at once. Prompts are <= ~60 tokens, so 800 fits the run's --max-model-len 1024.
KILL_TOKENS = 800
# The hang phase needs one stream on its victim when it stops (_kill_busiest checks just
# before): a stopped worker finishes nothing, so every one of its streams stalls and
# migrates whatever its length (the phase alone, loaded host: 9-13 s, 16-24 s at 800).
HANG_TOKENS = 320


async def phase_kill_decode(h: httpx.AsyncClient, svc: Service, model: str, n: int) -> dict:
    rng, before = random.Random(5), counter(svc.url, "pdserve_router_migrated_streams_total")
    bodies = [_greedy(model, prompt(rng, rng.randint(3, 40)), KILL_TOKENS) for _ in range(n)]
    streams = [asyncio.ensure_future(cc.stream(h, "/v1/completions", b)) for b in bodies]
    # Streams that are decoding, not waiting for their KV: killed then, they must migrate
    # (a waiting one is merely retried, and a kill that finds only those shows no migration).
    seen: list[int] = []
    victim = await _kill_busiest(
        svc.urls("decode"), streams, ("running",), 24, min_load=VICTIM_MIN_STREAMS, seen=seen
    )
    done = await asyncio.gather(*streams)
    migrated = int(counter(svc.url, "pdserve_router_migrated_streams_total") - before)
    # A kill that moved no stream proved nothing (the victim held none of the phase's
    # streams when it died): the phase fails rather than passes.
    return {
        "decode_killed": victim,
        "decode_kill_streams": n,
        "decode_kill_victim_running": seen[-1] if seen else 0,
        "decode_kill_failed_streams": sum(not r.ok(KILL_TOKENS) for r in done),
        "migrated_streams": migrated,
        "decode_kill_passed": bool(victim) and migrated > 0,
    }


async def phase_hang_decode(h: httpx.AsyncClient, svc: Service, model: str, n: int) -> dict:
    await asyncio.to_thread(wait_all_healthy, svc, 120.0)  # the killed ones are back
    name = 'pdserve_router_stalled_streams_total{role="decode"}'
    rng, before = random.Random(7), counter(svc.url, name)
    bodies = [_greedy(model, prompt(rng, rng.randint(3, 40)), HANG_TOKENS) for _ in range(n)]
    streams = [asyncio.ensure_future(cc.stream(h, "/v1/completions", b)) for b in bodies]
    stopped: list[tuple[int, int]] = []

    def stop(url: str) -> bool:
        stopped.append(stop_group(url))
        return bool(stopped[-1][0])

    try:
        victim = await _kill_busiest(svc.urls("decode"), streams, ("running",), 24, stop)
        done = await asyncio.gather(*streams)
    finally:
        for frozen in stopped:
            resume_group(frozen)
    return {
        "decode_hung": victim,
        "hang_streams": n,
        "hang_failed_streams": sum(not r.ok(HANG_TOKENS) for r in done),
        "stalled_streams": int(counter(svc.url, name) - before),
    }


async def phase_kill_prefill(h: httpx.AsyncClient, svc: Service, model: str, n: int) -> dict:
    """``n`` clients send long-prompt requests back to back (remote prefill, each one short,
    so a burst may end before the kill) until the kill is done and each sent 2 more."""
    rng, results, killed = random.Random(6), [], asyncio.Event()

    async def client(i: int) -> None:
        after = 0
        while after < 2:
            body = _greedy(model, prompt(rng, rng.randint(60, 200)), 8)
            call = cc.stream if i % 2 else cc.post
            results.append(await call(h, "/v1/completions", body))
            after += killed.is_set()

    clients = [asyncio.ensure_future(client(i)) for i in range(n)]
    victim = await _kill_busiest(svc.urls("prefill"), clients)
    killed.set()
    await asyncio.gather(*clients)
    return {
        "prefill_killed": victim,
        "prefill_kill_requests": len(results),
        "prefill_kill_failed_requests": sum(not r.ok(8) for r in results),
    }


async def _kill_busiest(
    urls: list[str],
    tasks: list[asyncio.Future[Any]],
    counts: tuple[str, ...] = ("running", "waiting", "held"),
    min_new_tokens: int = 0,
    act: Any = kill9,
    min_load: int = 1,
    seen: list[int] | None = None,
) -> str:
    """``kill -9`` (or ``act``) the busiest of ``urls`` once it has ``min_load`` requests
    ("" if none ever had); ``counts``: which of its requests count (chaos_service.busiest);
    ``min_new_tokens``: first let it generate that many more tokens (its streams are then
    under way), and check its load again just before acting; ``seen`` gets that load."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(t.done() for t in tasks):
        found = await asyncio.to_thread(busiest, urls, counts)
        if found is not None and _load(found[1], counts) >= min_load:
            url, first = found
            await _until_generated(url, first.get("generation_tokens", 0) + min_new_tokens)
            await asyncio.sleep(0.05)  # some tokens are out: the kill is mid-stream
            now = await asyncio.to_thread(stats, url)
            if now is None or _load(now, counts) < min_load:
                continue  # its streams ended meanwhile: look again
            if seen is not None:
                seen.append(_load(now, counts))
            return url if await asyncio.to_thread(act, url) else ""
        await asyncio.sleep(0.01)
    return ""


def _load(s: dict[str, Any], counts: tuple[str, ...]) -> int:
    return sum(int(s.get(field, 0)) for field in counts)


async def _until_generated(url: str, tokens: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = await asyncio.to_thread(stats, url)
        if now is None or now.get("generation_tokens", 0) >= tokens:
            return
        await asyncio.sleep(0.01)


async def phase_admin_port(svc: Service, admin_port: int, model_path: str) -> dict[str, Any]:
    admin = f"http://127.0.0.1:{admin_port}"
    return {
        "admin_port_unauthenticated_changes": await admin_port_changes(svc.url, admin, model_path)
    }


async def run_phases(svc: Service, args: argparse.Namespace, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    timings: dict[str, float] = {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=svc.url, timeout=300, limits=limits) as h:
        phases = [
            ("bad_input", phase_bad_inputs(h, model, args.huge_prompt_chars)),
            ("poison", phase_poison(h, model, args.concurrency)),
            ("storm", phase_storm(h, model, 4 * args.concurrency)),
            ("overload", phase_overload(h, model, 4 * args.max_queue)),
            ("slowloris", phase_slowloris(h, svc, model, 3 * args.max_queue)),
            ("slow_reader", phase_slow_reader(h, svc, model, 4)),
            ("control_tokens", phase_control_tokens(h, model)),
            ("odd_values", phase_odd_values(h, model)),
            ("grammar", phase_grammar(h, model, 4)),
            ("compile_abort", phase_compile_abort(h, svc, model, 8)),
            ("soak", phase_soak(h, model, args.soak, args.concurrency)),
            ("kill_decode", phase_kill_decode(h, svc, model, args.kill_streams)),
            ("kill_prefill", phase_kill_prefill(h, svc, model, args.kill_streams)),
            ("hang_decode", phase_hang_decode(h, svc, model, args.kill_streams)),
            ("admin_port", phase_admin_port(svc, args.admin_port, args.model_path)),
        ]
        for name, coro in phases:
            t0 = time.perf_counter()
            out.update(await coro)
            timings[name] = round(time.perf_counter() - t0, 2)
            print(f"chaos: {name} done in {timings[name]} s", file=sys.stderr, flush=True)
    out["workers_back"] = await asyncio.to_thread(wait_all_healthy, svc, args.restart_wait_s)
    out["leaked_blocks"], out["workers_checked"] = leaked_blocks(svc, 30.0)
    out["up_running"] = svc.running
    out["phase_seconds"] = timings
    out["failed_phases"] = [] if out["decode_kill_passed"] else ["kill_decode"]
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    from pdserve.testing import chaos_figures

    plt = figures.pyplot()

    keys = [
        "bad_input_5xx",
        "poisoned_streams",
        "leaked_blocks",
        "soak_errors",
        "decode_kill_failed_streams",
        "prefill_kill_failed_requests",
        "hang_failed_streams",
        "slowloris_refused_others",
        "slow_reader_harmed_streams",
        "control_token_injected",
        "odd_key_5xx",
        "grammar_5xx",
        "grammar_stalled_others",
        "compile_abort_leaked",
        *chaos_figures.BOUNDARY,
        "migrated_streams",
        "stalled_streams",
    ]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    a.barh(keys, [result[k] for k in keys], color=["C3"] * (len(keys) - 2) + ["C2"] * 2)
    a.set_title("chaos figures (goal: 0; migrated, stalled >= 1)")
    secs = result["phase_seconds"]
    b.barh(list(secs), list(secs.values()))
    b.set_title("phase wall time (s)")
    figures.save(fig, path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pdserve.engine.tiny_model import write_tiny_model

    model = args.model or str(write_tiny_model(ROOT / ".cache" / "models" / "tiny-seed0", "tiny"))
    logs = tempfile.mkdtemp(prefix="pdserve-chaos-")
    args.admin_port, args.model_path = free_port(), model
    svc = Service(
        model,
        logs,
        args.port or free_port(),
        20000 + free_port() % 20000,
        "--prefill",
        "2",
        "--decode",
        "2",
        "--kv-transport",
        args.kv_transport,
        "--disagg-threshold",
        "32",
        "--max-queue",
        str(args.max_queue),
        "--worker-arg=--max-model-len",
        "--worker-arg=1024",
        "--router-arg=--stall-timeout=3",
        "--router-arg=--stream-write-timeout=2",
        f"--router-arg=--admin-port={args.admin_port}",
        "--router-arg=--max-waiting=16",
    )  # overload still sheds
    t0 = time.perf_counter()
    try:
        svc.start()
        startup_s = round(time.perf_counter() - t0, 1)
        result = asyncio.run(run_phases(svc, args, Path(model).name))
        result["startup_s"] = startup_s
    finally:
        code = svc.stop()
    result.update(in_process_probes(Path(model)))
    result.update(
        up_exit_code=code, quick=args.quick, wall_s=round(time.perf_counter() - t0, 1), logs=logs
    )
    plot(result, Path(args.out) / f"chaos{'-quick' if args.quick else ''}.png")
    print(json.dumps(result))
    return 1 if result["failed_phases"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
