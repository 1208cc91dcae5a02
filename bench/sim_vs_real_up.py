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
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from sim_replay import Trace

EVENT = re.compile(
    r"autoscaler: (?:\w+: )?(started|draining and stopping) (\S+)|autoscaler: (\S+) ready"
)


@dataclass
class RealRun:
    ttft: np.ndarray
    replica_s: float
    times: list[float] = field(default_factory=list)  # worker count changes (trace clock)
    workers: list[int] = field(default_factory=list)
    startup_s: float | None = None
    failed: int = 0
    peak: int = 0
    errors: list[str] = field(default_factory=list)  # the first few failures, as raised


class Up:
    """``pdserve up`` in its own session; each stdout line stamped on arrival."""

    def __init__(self, argv: list[str], log: Path) -> None:
        cmd = ["nice", "-n", "10", sys.executable, "-m", "pdserve", "up", *argv]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # it stops its workers itself
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


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
    ttft = [g for g in got if isinstance(g, float)]
    errors = [f"{type(g).__name__}: {g}"[:200] for g in got if not isinstance(g, float)]
    return ttft, errors, t0


def run_real(flags: list[str], port: int, trace: Trace, drain_s: float, work: Path) -> RealRun:
    up = Up(flags, work / "up.log")
    try:
        up.wait_for("autoscaling every", timeout=300)
        ttft, errors, t0 = asyncio.run(_replay(f"http://127.0.0.1:{port}", trace, 1))
        time.sleep(max(0.0, t0 + trace.duration_s + drain_s - time.monotonic()))
        end = time.monotonic()
    finally:
        up.stop()
    run = _account(up.lines, up.launched, t0, end, np.array(ttft), len(errors))
    run.errors = errors[:5]
    return run


def _account(lines, launched: float, t0: float, end: float, ttft, failed) -> RealRun:  # type: ignore[no-untyped-def]
    """Worker-seconds over [t0, end] from the log's start/stop events (2 at t0); start-up
    times from ``started`` (the first two workers: from launch) to ``ready``."""
    run = RealRun(ttft, 0.0, [0.0], [2], failed=failed, peak=2)
    started: dict[str, float] = {"prefill-0": launched, "decode-0": launched}
    startups = []
    for when, line in lines:
        m = EVENT.search(line)
        if not m or when > end:
            continue
        if m.group(3):  # "<name> ready"
            if m.group(3) in started:
                startups.append(when - started.pop(m.group(3)))
            continue
        if m.group(1) == "started":
            started[m.group(2)] = when
        if when < t0:
            continue
        run.times.append(when - t0)
        run.workers.append(run.workers[-1] + (1 if m.group(1) == "started" else -1))
        run.peak = max(run.peak, run.workers[-1])
    edges = [*run.times, end - t0]
    spans = zip(run.workers, edges, edges[1:], strict=False)  # edges: one more than workers
    run.replica_s = float(sum(n * (b - a) for n, a, b in spans))
    run.startup_s = float(np.mean(startups)) if startups else None
    return run
