"""The real side of sim_vs_real.py: ``pdserve up --autoscale`` and a trace replayed on it.

Requests are sent at their trace times (streamed completions of exactly the trace's
output length, prompts of random token ids); TTFT is measured at the client. The
worker count comes from ``pdserve up``'s own log: +1 at ``started``, -1 at
``draining and stopping`` (the simulator also stops a pod the moment it is removed);
a worker's start-up time is from ``started`` to ``ready``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from sim_vs_real_cpu import CpuSampler, Sample, autogroup_enabled, cpu_between, nice_of

from pdserve import env
from pdserve.local.proc_group import end_group, start_group
from pdserve.planner.sim.replay import Trace

# one request at a time on the idle service before the trace: the serving path's own
# latency (HTTP hops client -> router -> prefill worker -> router -> client) beside the
# engine's prefill, which the profile times alone
PROBE_LENGTHS = (64, 256, 512, 64, 256, 512, 64, 256, 512)  # recordings before 2026-12-04 17:10
# since: 7 of each, the path fit on each length's median (sim_vs_real_host._path_fit). With
# 3 of each and a least-squares fit, one slow 512-token probe made the per-token slope
# 2.6-49 us in four runs of one hour, and the predicted TTFT p90 error 0.05-0.41 by which
# calibration a scored run was predicted from (2026-12-04 16:36-16:51 recordings)
PROBE_REPEATS = 7
PROBE_NOW = PROBE_LENGTHS[:3] * PROBE_REPEATS  # what run_real probes, recorded with it
EVENT = re.compile(
    r"autoscaler: (?:\w+: )?(started|draining and stopping) (\S+)|autoscaler: (\S+) ready"
)
TIMED = re.compile(r"autoscaler: (\S+) ready after ([0-9.]+)s")  # the pools' own timing


@dataclass
class RealRun:
    ttft: np.ndarray
    replica_s: float
    times: list[float] = field(default_factory=list)  # worker count changes (trace clock)
    workers: list[int] = field(default_factory=list)
    startup_s: float | None = None
    startup_source: str = ""
    failed: int = 0
    peak: int = 0
    errors: list[str] = field(default_factory=list)  # the first few failures, as raised
    cpu: dict[str, float] = field(default_factory=dict)  # CPU s per process over the trace
    ttft_all: np.ndarray = field(default_factory=lambda: np.empty(0))  # trace order, nan: failed
    probe: list[float] = field(default_factory=list)  # idle TTFTs of PROBE_LENGTHS
    nice_up: int = 0  # niceness of `pdserve up` and so of every worker and the router


class Up:
    """``pdserve up`` in its own session; each stdout line stamped on arrival."""

    def __init__(self, argv: list[str], log: Path, zygote: bool = False) -> None:
        # at nice 10 like other benchmarks on the shared cores, however this one was started
        # (`nice -n 10 python bench/sim_vs_real.py` would otherwise put it at 19)
        nice = ["nice", "-n", str(max(0, 10 - os.nice(0)))]
        # ``zygote``: the cores fork from pdserve up's core zygote, as shipped (the CPU
        # sampler names each by its worker's /stats, signed with ``secret``); else
        # --no-core-zygote, each core its worker's child with its own imports (a pod's
        # start-up; the recordings before 2026-12-04)
        self.secret = secrets.token_hex(16)
        cmd = [
            *nice,
            sys.executable,
            "-m",
            "pdserve",
            "up",
            *([] if zygote else ["--no-core-zygote"]),
            *argv,
        ]
        environ = {k: v for k, v in os.environ.items() if k != "PDSERVE_CORE_ZYGOTE"}
        environ[env.SERVICE_SECRET] = self.secret
        self.proc = start_group(cmd, env=environ)
        self.lines: list[tuple[float, str]] = []
        self.launched = time.monotonic()
        self.log = log
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.log.open("w") as f:
            for line in self.proc.stdout:
                self.lines.append((time.monotonic(), line))
                f.write(line)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for _, line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = "".join(line for _, line in self.lines[-30:])
                raise RuntimeError(f"pdserve up did not print {text!r}:\n{tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        end_group(self.proc, grace_s=60, whole=False)  # it stops its workers itself


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], out: int) -> float:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": out,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.monotonic()
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        first = None
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {") and first is None:
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    first = time.monotonic() - start
    if first is None:
        raise RuntimeError("no token streamed")
    return first


async def _probe(url: str, lengths: tuple[int, ...], seed: int) -> list[float]:
    """TTFT of one request at a time on the idle service (one per prompt length)."""
    rng = np.random.default_rng(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        out = []
        for n in lengths:
            out.append(await _one(session, url, rng.integers(10, 3000, n).tolist(), 2))
            await asyncio.sleep(0.2)
        return out


async def _replay(url: str, trace: Trace, seed: int) -> tuple[list[float], list[str], float]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, 3000, int(n)).tolist() for n in trace.prompt]
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.monotonic()

        async def at(i: int) -> float:
            await asyncio.sleep(max(0.0, t0 + trace.arrival[i] - time.monotonic()))
            return await _one(session, url, prompts[i], int(trace.output[i]))

        got = await asyncio.gather(
            *(at(i) for i in range(trace.arrival.size)), return_exceptions=True
        )
    ttft = [g if isinstance(g, float) else float("nan") for g in got]  # in trace order
    errors = [f"{type(g).__name__}: {g}"[:200] for g in got if not isinstance(g, float)]
    return ttft, errors, t0


def run_real(
    flags: list[str],
    port: int,
    trace: Trace,
    drain_s: float,
    work: Path,
    polite: bool = True,
    zygote: bool = False,
) -> RealRun:
    """``polite``: our sessions' autogroups lowered to our nice (CpuSampler); ``zygote``:
    the workers' cores fork from a core zygote, as ``pdserve up`` ships (Up)."""
    up = Up(flags, work / "up.log", zygote=zygote)
    sampler = CpuSampler(up.proc.pid, polite=polite, secret=up.secret).start()
    try:
        up.wait_for("autoscaling every", timeout=300)
        nice_up = nice_of(up.proc.pid)  # `nice` has exec'd python by now
        probe = asyncio.run(_probe(f"http://127.0.0.1:{port}", PROBE_NOW, 2))
        ttft, errors, t0 = asyncio.run(_replay(f"http://127.0.0.1:{port}", trace, 1))
        time.sleep(max(0.0, t0 + trace.duration_s + drain_s - time.monotonic()))
        end = time.monotonic()
    finally:
        sampler.stop()
        up.stop()
    every = np.array(ttft)
    run = _account(
        up.lines, up.launched, t0, end, every[~np.isnan(every)], len(errors), added_only=zygote
    )
    run.errors = errors[:5]
    run.ttft_all, run.probe, run.nice_up = every, probe, nice_up
    run.cpu = cpu_between(sampler.samples, t0, end)
    _dump(work / "real.json", run, sampler.samples, up.lines, t0, zygote)
    return run


def _dump(path: Path, run: RealRun, samples: list[Sample], lines, t0: float, zygote: bool) -> None:  # type: ignore[no-untyped-def]
    """Everything measured, on the trace clock, for a closer look than the JSON line."""
    data = {
        "ttft": [None if np.isnan(x) else float(x) for x in run.ttft_all],  # unrounded: --replay
        "probe": run.probe,
        "probe_lengths": list(PROBE_NOW),
        "cpu": [
            {"t": round(s.t - t0, 2), "machine": s.machine_s, "client": s.client_s, **s.procs}
            for s in samples
        ],
        # the other jobs, per sample: [pid, CPU s since the previous sample, nice,
        # autogroup id, autogroup nice]
        "others": [
            [
                round(s.t - t0, 2),
                [[pid, round(c, 3), *rest] for pid, (c, *rest) in s.others.items()],
            ]
            for s in samples
        ],
        # our processes' autogroup nice per sample (role -> nice), and whether the kernel
        # schedules by autogroup at all (planner/sim/host.py)
        "groups": [[round(s.t - t0, 2), s.groups] for s in samples],
        "autogroup": autogroup_enabled(),
        "nice": {"up": run.nice_up, "client": nice_of(os.getpid())},
        "cores": len(os.sched_getaffinity(0)),  # what the processes could run on
        # the cores forked from a zygote: the first workers' start-ups waited on its imports
        # (counted nowhere), the added ones' did not (sim_vs_real_host.measure_host)
        "core_zygote": zygote,
        "log": [(round(w - t0, 2), line.rstrip()) for w, line in lines if "autoscaler" in line],
    }
    path.write_text(json.dumps(data))


def _account(
    lines,
    launched: float,
    t0: float,
    end: float,
    ttft,
    failed,  # type: ignore[no-untyped-def]
    added_only: bool = False,
) -> RealRun:
    """Worker-seconds over [t0, end] from the log's start/stop events (2 at t0); start-up
    times as ``pdserve up`` timed them (spawn to /health 200: what its planner learns),
    else from ``started`` (the first two workers: from launch) to ``ready`` in the log.
    ``added_only``: the start-ups of the workers the planner added, where there are any
    (with a core zygote the first two also wait for its imports; the simulator's
    start-ups are the added workers')."""
    run = RealRun(ttft, 0.0, [0.0], [2], failed=failed, peak=2)
    started: dict[str, float] = {"prefill-0": launched, "decode-0": launched}
    startups, timed, added = [], [], set()
    for when, line in lines:
        t = TIMED.search(line)
        if t and when <= end:
            timed.append((t.group(1), float(t.group(2))))
        m = EVENT.search(line)
        if not m or when > end:
            continue
        if m.group(3):  # "<name> ready"
            if m.group(3) in started:
                startups.append(when - started.pop(m.group(3)))
            continue
        if m.group(1) == "started":
            started[m.group(2)] = when
            added.add(m.group(2))
        if when < t0:
            continue
        run.times.append(when - t0)
        run.workers.append(run.workers[-1] + (1 if m.group(1) == "started" else -1))
        run.peak = max(run.peak, run.workers[-1])
    edges = [*run.times, end - t0]
    spans = zip(run.workers, edges, edges[1:], strict=False)  # edges: one more than workers
    run.replica_s = float(sum(n * (b - a) for n, a, b in spans))
    later = [x for name, x in timed if name in added]
    if added_only and later:
        run.startup_s = float(np.mean(later))
        run.startup_source = (
            f"pdserve up's pools: spawn to /health 200, mean of the {len(later)} added"
        )
    elif timed:
        run.startup_s = float(np.mean([x for _, x in timed]))
        run.startup_source = f"pdserve up's pools: spawn to /health 200, mean of {len(timed)}"
    elif startups:
        run.startup_s = float(np.mean(startups))
        run.startup_source = f"log: started (or launch) to ready, mean of {len(startups)}"
    return run
