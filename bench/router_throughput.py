"""The router's own cost per request, in front of the tests' fake workers.

Starts the fake prefill and decode workers of ``pdserve/testing/router_fakes.py`` in one process
(signed calls and KV events as in the router tests) and ``pdserve router`` in another,
then drives it from this process with ``--concurrency`` streamed completions of
``--prompt-tokens`` token ids (and text prompts of about as many tokens), on three
paths: decode-direct (the prompt is below ``--disagg-threshold``), full P/D (threshold 0:
prefill, KV handle, decode) and full P/D with the decode worker calling the prefill
worker (``pd-chain``: ``--pd-handoff decode``, one worker call per request at the router).
Per path: requests/s of one router process (closed loop),
the router process's CPU per request (utime + stime from /proc/PID/stat around the
phase: the honest figure on a shared, loaded machine, where wall throughput swings with
everyone else's load), and the router's added latency p50/p99 at ~50% of that peak
(paced open loop; the same requests straight to the fake decode worker, signed, are the
base). ``--profile FILE`` runs the router under cProfile (figures are then inflated).

The last stdout line is JSON.

    nice python bench/router_throughput.py            # 2000 requests per phase
    python bench/router_throughput.py --repeat 3      # three interleaved rounds: medians
    python bench/router_throughput.py --floor         # and what the HTTP stack alone costs
    python bench/router_throughput.py --quick         # the test's run (tests/router/)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import figures  # bench/figures.py, beside this script
from lib import flags
from lib.loopback import secret_env, tiny_model
from lib.procfs import thread_cpu_seconds, tree_cpu_seconds
from lib.stats import percentile
from router_client import across_processes, closed_loop, one, session  # beside this script
from spread import spread  # bench/spread.py, beside this script

from pdserve import keys, signing
from pdserve.env import SERVICE_SECRET
from pdserve.local.proc_group import end_group

ROOT = Path(__file__).resolve().parent.parent

# The paths: --disagg-threshold for each (the prompts are 64 tokens), and who calls the
# prefill worker on the P/D path (--pd-handoff: pd-chain has the decode worker call it).
PATHS = {"direct": 100_000, "pd": 0, "pd-chain": 0}
LANES = ("python", "fast")  # the router's lanes: --fast-lane off / on
HANDOFF = {"pd-chain": "decode"}


# --quick (the suite's run) checks that the bench works and the shape of its output, not
# figures: 40 requests a phase (was 200, then 100) and 10 paced ones each way (was 60, 30);
# a path's router CPU is still several 10 ms ticks of /proc (~1-4 ms a request).
QUICK_REQUESTS = 40


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = flags.parser(__doc__, "few requests (the test's run)")
    p.add_argument("--requests", type=int, default=2000, help="per throughput phase")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--latency-requests", type=int, default=400)
    p.add_argument(
        "--paths",
        default="direct,pd,pd-chain",
        help="comma list of: direct, pd, pd-chain (P/D, the decode worker calling "
        "the prefill worker: --pd-handoff decode)",
    )
    p.add_argument("--text", action="store_true", help="also run text prompts (tokenized)")
    p.add_argument(
        "--prompts",
        default="",
        help="comma list of: ids, text (the prompt kinds to run; overrides --text)",
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=0,
        help="run the closed-loop client in this many processes of its own "
        "(bench/router_client.py), --concurrency split between them; 0: in this "
        "process. The wall req/s is then not bounded by this process's event loop",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds, interleaved (every path once per round, a new router each "
        "time); the summary gives each figure's median and range",
    )
    p.add_argument(
        "--lanes",
        default="python",
        help="comma list of: python, fast (the router's --fast-lane, the compiled lane); "
        "both: each path run on each, interleaved, and the fast lane's CPU per request "
        "over the Python lane's printed (lane_cpu_ratio_fast_over_python)",
    )
    p.add_argument("--profile", default="", help="write the router's cProfile stats here")
    p.add_argument("--procs", type=int, default=1, help="router processes (pdserve router --procs)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="fake prefill workers and as many fake decode workers (all in one "
        "process): with more than one per pool the router ranks them with its "
        "scorers, as in a cluster",
    )
    p.add_argument(
        "--router-tree",
        default=str(ROOT),
        help="run the router from this checkout (a before/after comparison: "
        "`git archive REF | tar -x -C DIR`)",
    )
    p.add_argument(
        "--compare-tree",
        default="",
        help="also run every path, in every round, with the router from this "
        "checkout (tagged tree=compare; --router-tree's are tree=main): a "
        "before/after comparison interleaved, with the ratio of medians",
    )
    p.add_argument(
        "--router-python",
        default=sys.executable,
        help="the interpreter the router (and the floors' front) runs under: the "
        "shipped image's is an optimised build (PGO and LTO, python:3.11-slim), "
        "unlike a pyenv one; the packages are this one's (docs/router.md)",
    )
    p.add_argument(
        "--compare-python",
        default="",
        help="also run every path, in every round, with the router under this "
        "interpreter (from --compare-tree, or else the same checkout), tagged "
        "tree=compare: two interpreters compared, interleaved",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also, every round, the same phase against bench/floor_apps.py: the "
        "router's HTTP server set-up with a bare app (floor-bare), and that app "
        "making the P/D path's two worker calls with the router's pool "
        "(floor-calls), and doing pdserve's per-request pieces in one flat "
        "coroutine (floor-lean), the same writing each token to the client as "
        "it comes, as the router does (floor-lean-stream): what the HTTP stack "
        "alone costs per request, and the pieces without the router's "
        "structure",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="the router on the last --procs cores of this process's, this client, "
        "its processes and the fakes on the others (as a router pod with cores of its "
        "own); needs one more core than --procs",
    )
    p.add_argument(
        "--plot",
        default=str(ROOT / "bench" / "out" / "router_throughput.png"),
        help="the PNG of the router's CPU per request by path ('' for none)",
    )
    p.add_argument(
        "--plot-from",
        default="",
        help="draw --plot from this recorded JSON (its last line) and exit",
    )
    p.add_argument(
        "--fakes-procs",
        type=int,
        default=1,
        help="spread the fake workers over this many processes (the same fakes; a "
        "lease held in another process ends by its signed /release call): on a host "
        "with cores to spare, so that the fakes do not bound the wall req/s",
    )
    p.add_argument("--fakes", action="store_true", help=argparse.SUPPRESS)  # the child
    p.add_argument("--token-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # its decode
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.latency_requests, args.text = QUICK_REQUESTS, 10, True
    args.prompts = args.prompts or ("ids,text" if args.text else "ids")
    if not set(args.prompts.split(",")) <= {"ids", "text"}:
        p.error("--prompts: a comma list of ids, text")
    if not args.lanes or not set(args.lanes.split(",")) <= set(LANES):
        p.error("--lanes: a comma list of python, fast")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if not 1 <= args.fakes_procs <= args.workers:
        p.error("--fakes-procs must be between 1 and --workers")
    if args.pin and len(os.sched_getaffinity(0)) <= args.procs:
        p.error(f"--pin needs more than --procs ({args.procs}) cores")
    args.router_cpus, args.client_cpus = pinned_cpus(args.procs) if args.pin else (None, None)
    return args


def pinned_cpus(procs: int) -> tuple[set[int], set[int]]:
    """--pin: (the router's cores, everyone else's): the last ``procs`` of this process's."""
    cpus = sorted(os.sched_getaffinity(0))
    return set(cpus[-procs:]), set(cpus[:-procs])


async def serve_fakes(token_delay_s: float = 0.0, workers: int = 1) -> None:
    """The child: ``workers`` fake prefill workers (each with its KV events) and as many fake
    decode workers, in this one process (the router tests' ``start_fakes``)."""
    import httpx

    from pdserve.signed_httpx import SignedAuth
    from pdserve.testing.router_fakes import SECRET, start_fakes

    leases: dict[str, int] = {}  # every prefill worker's: a decode worker ends any of them
    async with contextlib.AsyncExitStack() as stack:
        fakes = await start_fakes(stack, workers, workers)
        # a lease held by another process's fake prefill worker ends by its /release call
        client = await stack.enter_async_context(httpx.AsyncClient(auth=SignedAuth(SECRET)))
        for st in (*fakes.prefill, *fakes.decode):
            st.keep_records = False  # a long run keeps no record per request
        for pst, dst in zip(fakes.prefill, fakes.decode, strict=True):
            pst.leases = leases
            dst.token_delay_s = token_delay_s
            dst.lease_holder = pst  # leases end without a call: the fakes' cost is not the figure
            dst.client = client
        print(json.dumps({"prefill": fakes.prefill_urls, "decode": fakes.decode_urls}), flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()


async def start_fakes_procs(
    args: argparse.Namespace, env: dict[str, str], stack: contextlib.ExitStack
) -> dict[str, list[str]]:
    """The fake workers, ``--workers`` of each role over ``--fakes-procs`` processes (ended
    with ``stack``): every process's URLs."""
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    k = args.fakes_procs
    for i in range(k):
        n = args.workers // k + (i < args.workers % k)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--fakes", "--workers", str(n)]
        if args.token_delay:
            cmd += ["--token-delay", str(args.token_delay)]
        fakes = stack.enter_context(child(cmd, env))
        assert fakes.stdout is not None
        got = json.loads(await asyncio.to_thread(fakes.stdout.readline))
        urls["prefill"] += got["prefill"]
        urls["decode"] += got["decode"]
    return urls


def cpu_seconds(pid: int) -> float:
    """CPU of the router: the process and, with --procs, its router processes."""
    return tree_cpu_seconds(pid)


def write_calls(pid: int) -> int:
    """Write system calls of the router (``syscw`` of /proc/PID/io: each socket write the
    kernel delivers on loopback inside the call), with --procs its router processes'."""
    with open(f"/proc/{pid}/io") as f:
        own = next(int(line.split()[1]) for line in f if line.startswith("syscw:"))
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return own + sum(write_calls(int(c)) for c in f.read().split())


@contextlib.contextmanager
def child(
    cmd: list[str], env: dict[str, str], cwd: str | Path = ROOT, cpus: set[int] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """``cmd`` in a session of its own (ended with its group); ``cpus``: the cores it and
    every thread it starts may run on."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=cwd,
        preexec_fn=pin,
    )
    try:
        yield proc
    finally:
        end_group(proc)


# The router under cProfile (thread CPU time: a loaded machine preempts it at random) over
# the measured phase only (start-up and imports left out):
# SIGUSR1 starts the profiler on the event loop's thread, SIGUSR2 stops it and writes argv[1].
PROFILED = """
import cProfile, signal, sys, time
from pdserve.cli import main
prof, path = cProfile.Profile(time.thread_time), sys.argv.pop(1)  # CPU, not wall
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
signal.signal(signal.SIGUSR2, lambda *_: (prof.disable(), prof.dump_stats(path)))
sys.exit(main(sys.argv[1:]))
"""


def router_cmd(
    args: argparse.Namespace,
    model: str,
    urls: dict[str, str],
    port: int,
    path: str,
    python: str = "",
    lane: str = "python",
) -> list[str]:
    threshold = PATHS[path]
    python = python or args.router_python
    head = [python, "-c", PROFILED, args.profile] if args.profile else [python, "-m", "pdserve"]
    return [
        *head,
        "router",
        *router_flags(model, urls, port),
        *("--disagg-threshold", str(threshold), "--procs", str(args.procs)),
        *("--pd-handoff", HANDOFF.get(path, "router")),
        *(["--fast-lane"] if lane == "fast" else []),
    ]


def router_flags(model: str, urls: dict[str, Any], port: int) -> list[str]:
    """The router over the fakes at ``urls``: the tiny model served as "tiny", on ``port``,
    quiet."""
    return [
        *("--model", model, "--served-model-name", "tiny", "--port", str(port)),
        *("--log-level", "warning", "--prefill", *urls["prefill"], "--decode", *urls["decode"]),
    ]


async def wait_ready(http: aiohttp.ClientSession, url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + "/health") as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"router at {url} not ready in {timeout} s")


def body(args: argparse.Namespace, rng: random.Random, text: bool) -> dict[str, Any]:
    ids = [rng.randrange(16, 500) for _ in range(args.prompt_tokens)]
    prompt: Any = " ".join(f"w{i}" for i in ids[: args.prompt_tokens // 2]) if text else ids
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }


async def paced(calls: list[Any], rate: float) -> list[float]:
    """Latencies of ``calls`` (coroutine factories) started at ``rate`` per second."""
    t0, tasks = time.perf_counter(), []
    for i, call in enumerate(calls):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(call()))
    return sorted(await asyncio.gather(*tasks))


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of latencies in seconds, as milliseconds to two places."""
    return round(1000 * percentile(xs, q), 2)


def direct_call(
    http: aiohttp.ClientSession,
    decode_url: str,
    ring: keys.KeyRing,
    body_: dict[str, Any],
    n: int,
    prefill: list[str] | None = None,
) -> Any:
    """The base of the added latency: the same stream straight from the fake decode worker
    (``prefill``: a chained request, the decode worker calling the fake prefill worker)."""
    from pdserve.protocol.codec import encode
    from pdserve.protocol.contract import GenerateRequest
    from pdserve.protocol.sampling_params import SamplingParams

    sampling = SamplingParams(max_tokens=body_["max_tokens"], temperature=0.0, ignore_eos=True)
    raw = encode(GenerateRequest(f"base-{n}", body_["prompt"], sampling, prefill=prefill))

    async def call() -> float:
        host = decode_url.split("://", 1)[-1].split("/", 1)[0]  # the Host aiohttp sends
        hdr = {signing.HEADER: signing.sign(ring, "POST", "/generate", raw, host=host)}
        return await one(http, decode_url + "/generate", raw, hdr)

    return call


async def run_path(
    args: argparse.Namespace,
    model: str,
    urls: dict[str, str],
    env: dict[str, str],
    path: str,
    port: int,
    tree: str,
    python: str = "",
    lane: str = "python",
) -> list[dict[str, Any]]:
    """One router process for ``path`` on ``lane``, run from checkout ``tree`` under
    ``python``: its token-id phase, then its text phase."""
    url = f"http://127.0.0.1:{port}"
    cmd = router_cmd(args, model, urls, port, path, python, lane)
    out = []
    with child(cmd, env, tree, args.router_cpus) as router:
        async with session() as http:
            await wait_ready(http, url)
            for text in (kind == "text" for kind in args.prompts.split(",")):
                run = await phase(args, http, url, router.pid, random.Random(f"{path}{text}"), text)
                if args.latency_requests and not text:
                    rng = random.Random(path)
                    run.update(
                        await added_latency(args, http, url, urls, rng, run["rps"] / 2, path)
                    )
                run = {"path": path, **run, **({"lane": lane} if lane != "python" else {})}
                print(json.dumps(run), file=sys.stderr, flush=True)
                out.append(run)
    return out


async def phase(
    args: argparse.Namespace,
    http: aiohttp.ClientSession,
    url: str,
    pid: int,
    rng: random.Random,
    text: bool,
) -> dict[str, Any]:
    """Requests/s (wall) and the router's CPU per request at ``--concurrency`` (closed loop),
    the client in this process or in ``--client-procs`` of its own."""
    warm = [json.dumps(body(args, rng, text)).encode() for _ in range(args.concurrency)]
    bodies = [json.dumps(body(args, rng, text)).encode() for _ in range(args.requests)]
    start: list[float] = []
    threads: dict[str, float] = {}  # the router process's threads' CPU at the start, by name

    def go() -> None:
        if args.profile:
            os.kill(pid, signal.SIGUSR1)
        start.extend((cpu_seconds(pid), write_calls(pid)))
        threads.update(thread_cpu_seconds(pid))

    if args.client_procs:
        conc, procs = args.concurrency, args.client_procs
        wall, errors = await across_processes(url, warm, bodies, procs, conc, go)
    else:
        await closed_loop(http, url, warm, args.concurrency)  # connections, caches
        go()
        wall, errors = await closed_loop(http, url, bodies, args.concurrency)
    cpu, writes = cpu_seconds(pid) - start[0], write_calls(pid) - start[1]
    by_thread = {
        name: round(1e6 * (sec - threads.get(name, 0.0)) / len(bodies), 1)
        for name, sec in thread_cpu_seconds(pid).items()
        if sec - threads.get(name, 0.0) > 0
    }
    if args.profile:
        os.kill(pid, signal.SIGUSR2)
        await asyncio.sleep(1.0)  # the dump
    return {
        "prompt": "text" if text else "ids",
        "requests": len(bodies),
        "errors": errors,
        "procs": args.procs,
        "workers": args.workers,
        "client_procs": args.client_procs,
        "rps": round(len(bodies) / wall, 1),
        # the router's processes' share of a core each over the phase: near 1, the wall
        # req/s is the router's own; well below, the client or the fakes held it back
        "router_busy": round(cpu / wall / args.procs, 2),
        "router_cpu_us_per_req": round(1e6 * cpu / len(bodies), 1),
        "router_writes_per_req": round(writes / len(bodies), 2),
        # the router process's CPU per request by thread (main: the event loop's; the
        # compiled lane's is pdserve-lane; python: the others Python started)
        "router_thread_us": by_thread,
    }


async def added_latency(
    args: argparse.Namespace,
    http: aiohttp.ClientSession,
    url: str,
    urls: dict[str, str],
    rng: random.Random,
    rate: float,
    path: str,
) -> dict[str, Any]:
    """Latency through the router minus straight to the decode worker, at ``rate``/s."""
    ring = keys.KeyRing(keys.HTTP, os.environ[SERVICE_SECRET])
    hdr = {"content-type": "application/json"}
    n = args.latency_requests
    via = [json.dumps(body(args, rng, False)).encode() for _ in range(n)]
    routed = await paced(
        [lambda b=b: one(http, url + "/v1/completions", b, hdr) for b in via], rate
    )
    chained = urls["prefill"][:1] if HANDOFF.get(path) == "decode" else None
    base = await paced(
        [
            direct_call(http, urls["decode"][0], ring, body(args, rng, False), i, chained)
            for i in range(n)
        ],
        rate,
    )
    return {
        "paced_rps": round(rate, 1),
        "added_p50_ms": round(pct(routed, 0.5) - pct(base, 0.5), 2),
        "added_p99_ms": round(pct(routed, 0.99) - pct(base, 0.99), 2),
        "routed_p50_ms": pct(routed, 0.5),
        "direct_p50_ms": pct(base, 0.5),
    }


SUMMARY_KEYS = (
    "router_cpu_us_per_req",
    "rps",
    "router_busy",
    "router_writes_per_req",
    "added_p50_ms",
)


FLOORS = ("bare", "calls", "lean", "lean-stream")


async def run_floor(args: argparse.Namespace, env: dict[str, str]) -> list[dict[str, Any]]:
    """The floor phases (``--floor``): bench/floor_apps.py's front, bare, with the two
    worker calls, and lean, driven as the router is (token ids; no added-latency phase)."""
    from pdserve.testing.loopback import free_port

    args = argparse.Namespace(**{**vars(args), "profile": ""})  # never profiled
    apps = str(Path(__file__).resolve().parent / "floor_apps.py")
    wport = free_port()
    out = []
    with child([sys.executable, apps, "worker", str(wport)], env):
        for mode in FLOORS:
            port = free_port()
            cmd = [args.router_python, apps, "front", str(port), mode, f"http://127.0.0.1:{wport}"]
            url = f"http://127.0.0.1:{port}"
            with child(cmd, env, cpus=args.router_cpus) as front:
                async with session() as http:
                    await wait_ready(http, url)
                    run = await phase(args, http, url, front.pid, random.Random(mode), False)
            out.append({"path": f"floor-{mode}", **run})
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path and prompt kind, over the rounds: each figure's median and [min, max]."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for run in runs:
        key = (run["path"], run["prompt"], run.get("tree", "main"), run.get("lane", "python"))
        groups.setdefault(key, []).append(run)
    out = []
    for (path, prompt, tree, lane), rs in groups.items():
        row: dict[str, Any] = {"path": path, "prompt": prompt, "rounds": len(rs)}
        if tree != "main":
            row["tree"] = tree
        if lane != "python":
            row["lane"] = lane
        for key in SUMMARY_KEYS:
            xs = [r[key] for r in rs if r.get(key) is not None]
            if xs:
                row[key] = spread(xs, digits=2)
        names = sorted({n for r in rs for n in r.get("router_thread_us", {})})
        if names:  # per thread: the median over the rounds
            row["router_thread_us"] = {
                n: spread([r.get("router_thread_us", {}).get(n, 0.0) for r in rs])["median"]
                for n in names
            }
        out.append(row)
    return out


def headline(summary: list[dict[str, Any]], procs: int) -> dict[str, Any]:
    """Issue 47's two figures, medians over the rounds (this tree, not a compared one):
    ``router_cpu_us_pd`` by prompt kind, the default P/D path's router CPU per request,
    and ``wall_req_per_s_per_proc`` by path and prompt kind, the measured requests/s over
    the router processes (with ``router_busy`` beside it: whose limit it was)."""
    out: dict[str, Any] = {}
    for lane in LANES:
        mine = [
            r
            for r in summary
            if "tree" not in r
            and r.get("lane", "python") == lane
            and not r["path"].startswith("floor")
        ]
        if not mine and lane != "python":
            continue
        tail = "" if lane == "python" else f"_{lane}"  # the Python lane's keys as before
        cpu = {r["prompt"]: r["router_cpu_us_per_req"]["median"] for r in mine if r["path"] == "pd"}
        wall = {f"{r['path']}/{r['prompt']}": round(r["rps"]["median"] / procs, 1) for r in mine}
        busy = {f"{r['path']}/{r['prompt']}": r["router_busy"]["median"] for r in mine}
        out[f"router_cpu_us_pd{tail}"] = cpu
        out[f"wall_req_per_s_per_proc{tail}"] = wall
        out[f"router_busy{tail}"] = busy
    rows = {
        (r["path"], r["prompt"], r.get("lane", "python")): r for r in summary if "tree" not in r
    }
    ratio = {
        f"{path}/{prompt}": round(
            row["router_cpu_us_per_req"]["median"]
            / rows[(path, prompt, "python")]["router_cpu_us_per_req"]["median"],
            3,
        )
        for (path, prompt, lane), row in rows.items()
        if lane == "fast" and (path, prompt, "python") in rows
    }
    if ratio:  # below 1: the compiled lane is cheaper
        out["lane_cpu_ratio_fast_over_python"] = ratio
    return out


def compare(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path and prompt kind run from both trees: main's median CPU per request over
    the compared tree's (below 1: main is cheaper)."""
    rows = {
        (r["path"], r["prompt"], r.get("tree", "main")): r
        for r in summary
        if r.get("lane", "python") == "python"
    }
    out = []
    for (path, prompt, tree), row in rows.items():
        other = rows.get((path, prompt, "compare"))
        if tree == "main" and other is not None and other["router_cpu_us_per_req"]["median"]:
            ratio = (
                row["router_cpu_us_per_req"]["median"] / other["router_cpu_us_per_req"]["median"]
            )
            out.append(
                {"path": path, "prompt": prompt, "cpu_ratio_main_over_compare": round(ratio, 3)}
            )
    return out


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.testing.loopback import free_port

    model, env = str(tiny_model()), secret_env()
    if args.pin:  # the fakes (started below) inherit it
        os.sched_setaffinity(0, args.client_cpus)
        pinned = {"router": sorted(args.router_cpus), "client": sorted(args.client_cpus)}
        result_pin = {"pinned": pinned}
    else:
        result_pin = {}
    result: dict[str, Any] = {"load_avg_1m_before": load_avg(), **result_pin, "runs": []}
    with contextlib.ExitStack() as stack:
        urls = await start_fakes_procs(args, env, stack)
        trees = [("main", args.router_tree, args.router_python)]
        if args.compare_tree or args.compare_python:
            trees.append(
                (
                    "compare",
                    args.compare_tree or args.router_tree,
                    args.compare_python or args.router_python,
                )
            )
        compared = len(trees) > 1
        for rnd in range(args.repeat):  # interleaved: a drift of the host hits every path
            lanes = args.lanes.split(",")
            if rnd % 2:  # the lanes alternate first and second across rounds
                lanes.reverse()
            for path in args.paths.split(","):
                for lane in lanes:
                    for tag, tree, python in trees:
                        port = free_port()
                        runs = await run_path(
                            args, model, urls, env, path, port, tree, python, lane
                        )
                        tagged = {"tree": tag} if compared else {}
                        result["runs"] += [{**r, **tagged, "round": rnd} for r in runs]
            if args.floor:
                result["runs"] += [{**r, "round": rnd} for r in await run_floor(args, env)]
    result["summary"] = summarise(result["runs"])
    result.update(headline(result["summary"], args.procs))
    if compared:
        result["compare"] = compare(result["summary"])
    result["python"] = {"router": args.router_python, "compare": args.compare_python or None}
    result["errors"] = sum(r["errors"] for r in result["runs"])
    result["load_avg_1m_after"] = load_avg()
    result["cpu_count"] = os.cpu_count()
    return result


GOAL_US = 500  # issue 26: 2,000 requests/s per router process


def plot(result: dict[str, Any], path: str) -> None:
    """Router CPU per request by path (token-id prompts): the median of the rounds with
    their range, one bar per tree or interpreter compared, the floors beside, the goal."""
    plt = figures.pyplot()
    rows = [r for r in result["summary"] if r["prompt"] == "ids"]
    legs = sorted({r.get("tree", "main") for r in rows}, key=lambda t: t != "main")
    other = (result.get("python") or {}).get("compare")
    names = {
        "main": "this venv's interpreter" if other else "this tree",
        "compare": f"interpreter: {other}" if other else "compared tree",
    }
    paths = [
        p for p in (*PATHS, *(f"floor-{f}" for f in FLOORS)) if any(r["path"] == p for r in rows)
    ]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(legs)
    for k, leg in enumerate(legs):
        got = {r["path"]: r["router_cpu_us_per_req"] for r in rows if r.get("tree", "main") == leg}
        xs = [i + (k - (len(legs) - 1) / 2) * width for i, p in enumerate(paths) if p in got]
        stats = [got[p] for p in paths if p in got]
        mid = [s["median"] for s in stats]
        err = [
            [m - s["range"][0] for m, s in zip(mid, stats, strict=True)],
            [s["range"][1] - m for m, s in zip(mid, stats, strict=True)],
        ]
        ax.bar(xs, mid, width, yerr=err, capsize=3, label=names.get(leg, leg))
    ax.axhline(GOAL_US, ls="--", color="tab:red", label="goal: 2,000 req/s per process")
    ax.set_xticks(range(len(paths)), paths, rotation=15)
    ax.set_ylabel("router CPU per request, µs (median, range)")
    rounds = max((r["rounds"] for r in rows), default=0)
    ax.set_title(f"pdserve router in front of the fake workers, {rounds} rounds")
    ax.legend(fontsize=8)
    figures.save(fig, path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fakes:
        asyncio.run(serve_fakes(args.token_delay, args.workers))
        return 0
    if args.plot_from:
        last = Path(args.plot_from).read_text().strip().splitlines()[-1]
        plot(json.loads(last), args.plot)
        return 0
    result = asyncio.run(main_async(args))
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
