"""``pdserve up --autoscale`` on loopback: a load step makes the planner add a decode worker,
and TTFT/TPOT return under the SLO once it serves.

Everything is real: ``pdserve up`` as a user runs it (router + worker processes,
the tiny model), the planner scraping the router's /metrics, the router learning
the new worker from its workers file, streaming requests from an HTTP client.
Capacity is made scarce on purpose so that one more worker is a real fix on a
small shared machine: each decode worker runs at most 4 sequences at a time
(``--max-num-seqs 4``), so with 6 concurrent streams two of them wait for a slot
(TTFT ~ a fraction of a whole request); with 2 workers nobody waits. The length of
the load step's requests is calibrated from one idle request so that waiting for
a slot breaches the TTFT SLO on a fast machine as on a slow one. Short prompts
are prefilled by the decode worker itself (below the router's disaggregation
threshold), so the decode pool carries both SLOs and no prefill pool is needed.
Routing is round-robin: the default load scorer (``running``, scale 8) is too soft
for 4-slot workers and sometimes puts 5 of the 6 streams on one worker, which
would measure the router's balancing rather than the added capacity.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.local.proc_group import end_group, poll_until, start_group
from pdserve.testing.loopback import all_kv_free, free_port, worker_port_base

# serial: the SLO recovers once the new worker serves, measured in wall-clock TTFT; beside
# another xdist worker's cluster on the 2 cores it read 1.0 s against the 0.7 s SLO.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(480), pytest.mark.serial]

SLO_TTFT_MS = 700.0
SLO_TPOT_MS = 150.0
CALIBRATION_TOKENS = 96
MAX_OUTPUT_TOKENS = 960  # the prompt and this fit --max-model-len 1024
CLIENTS = 6
PROMPT = "The quick brown fox jumps over the lazy dog and keeps on running"

# Per-replica costs for the planner, as `pdserve profile` would store them; the decode batch
# limit is the workers' --max-num-seqs. Step times are rough: the online correction (observed
# over predicted TPOT) adapts them to this machine.
PROFILE = {
    "version": 1,
    "model": "tiny (float32)",
    "hardware": "CPU, 1 thread per worker",
    "prefill": {"chunk_overhead_s": 0.01, "tokens_per_s": 2000.0, "chunk_tokens": 512},
    "decode": {
        "step_base_s": 0.01,
        "step_per_seq_s": 0.002,
        "step_per_kv_token_s": 0.0,
        "max_num_seqs": 4,
        "kv_capacity_tokens": 5859,
    },
}


def autoscaled_up(
    model: Path, tmp_path: Path, decode: int, interval: str, window: str, engine: list[str]
) -> list[str]:
    """``pdserve up --autoscale`` as the tests run it: a decode-only pool of 1..2 CPU workers
    (tcp, round-robin) under the test's SLOs and profile; ``engine``: more worker flags."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    port = free_port()  # workers from 20000-30199: below Linux's ephemeral ports (32768+)
    return [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--model",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--prefill",
        "0",
        "--decode",
        str(decode),
        "--kv-transport",
        "tcp",
        "--picker",
        "round-robin",
        "--worker-port-base",
        str(worker_port_base()),
        "--log-dir",
        str(tmp_path / "logs"),
        *(f"--worker-arg={a}" for a in ["--device", "cpu", "--max-num-seqs", "4", *engine]),
        "--autoscale",
        "--profile",
        str(profile),
        "--autoscale-interval",
        interval,
        "--slo-ttft-ms",
        str(SLO_TTFT_MS),
        "--slo-tpot-ms",
        str(SLO_TPOT_MS),
        "--prefill-min",
        "0",
        "--prefill-max",
        "0",
        "--decode-min",
        "1",
        "--decode-max",
        "2",
        "--scale-down-window",
        window,
    ]


class Up:
    """``pdserve up`` in its own session; its stdout collected by a thread."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = start_group(argv)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        def found() -> re.Match[str] | None:
            match = re.search(pattern, self.text)
            assert match or self.proc.poll() is None, f"pdserve up exited:\n{self.text}"
            return match

        return poll_until(found, timeout, what=lambda: f"{pattern!r} in:\n{self.text}")

    def stop(self) -> int:
        return end_group(self.proc, grace_s=60, whole=False)  # it stops its workers itself


async def one_request(
    client: httpx.AsyncClient, url: str, tokens: int
) -> tuple[float, float, float]:
    """(start, TTFT, TPOT) of one streamed completion of exactly ``tokens`` tokens."""
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    start = time.monotonic()
    first = last = 0.0
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.monotonic()
                first = first or last
    assert first > 0, "no token streamed"
    return start, first - start, (last - first) / (tokens - 1)


def load_step_tokens(idle_tpot_s: float) -> int:
    """Output length at which a request runs ~3 TTFT SLOs at the idle speed of this machine.

    A stream that waits for a slot waits for (part of) a running request, so its TTFT scales
    with the request's length; at batch 4 each step is slower than idle, which only adds margin.
    """
    tokens = int(3 * SLO_TTFT_MS / 1000 / max(idle_tpot_s, 1e-4))
    return max(CALIBRATION_TOKENS, min(MAX_OUTPUT_TOKENS, tokens))


async def closed_loop(
    url: str, clients: int, tokens: int, until: float, out: list[tuple], pace_s: float = 0.0
) -> None:
    """``clients`` users, each sending its next request when the last one ends, and no
    sooner than ``pace_s`` after it started."""
    async with httpx.AsyncClient(timeout=120) as client:

        async def user() -> None:
            while time.monotonic() < until:
                start = time.monotonic()
                out.append(await one_request(client, url, tokens))
                await asyncio.sleep(max(0.0, start + pace_s - time.monotonic()))

        await asyncio.gather(*(user() for _ in range(clients)))


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def workers(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(url + "/workers", timeout=5).json()["workers"])


# One of the suite's slowest (~35 s alone): the planner must see the SLO breached over its
# interval, start a real worker (process start, model load) and see TTFT recover; the next
# test waits out the scale-down window. Shorter phases would measure start-up, not the fix.
async def test_load_step_adds_a_decode_worker_and_slo_recovers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = ["--max-model-len", "1024", "--kv-cache-bytes", "12000000"]
    up = Up(autoscaled_up(tiny_model_dir, tmp_path, 1, "2", "600", engine))
    try:
        url = up.wait_for(r"pdserve is up: (\S+)/v1", 300).group(1)
        up.wait_for(r"autoscaling every", 10)
        await asyncio.sleep(5)  # idle: two intervals, nothing to scale
        assert "started decode-1" not in up.text
        assert [w["worker_id"] for w in workers(url)] == ["decode-0"]

        async with httpx.AsyncClient(timeout=60) as client:  # calibration, and a warm-up
            idle = [await one_request(client, url, CALIBRATION_TOKENS) for _ in range(2)]
        tokens = load_step_tokens(idle[-1][2])
        print(f"idle TPOT {idle[-1][2] * 1000:.1f} ms -> load step of {tokens}-token requests")

        # The load step: 6 concurrent streams against 4 decode slots.
        results: list[tuple] = []
        step_at = time.monotonic()
        load = asyncio.create_task(closed_loop(url, CLIENTS, tokens, step_at + 300, results))
        await asyncio.to_thread(up.wait_for, r"started decode-1", 90)
        started_at = time.monotonic()
        await asyncio.to_thread(up.wait_for, r"decode-1 ready", 180)

        async def routed() -> None:  # the router has the new worker in rotation
            while not any(w["worker_id"] == "decode-1" and w["healthy"] for w in workers(url)):
                await asyncio.sleep(0.5)

        await asyncio.wait_for(routed(), 30)
        await asyncio.sleep(5)  # the new worker's first steps are slow (warm-up)
        ready_at = time.monotonic()
        settle = len(results)
        while len(results) < settle + 30 and not load.done():  # 30 requests on 2 workers
            await asyncio.sleep(0.5)
        if load.done():
            load.result()  # a failed request fails the test with its own error
        # The requests sent before the scale-up, read once they have all ended: those that
        # queued for a slot end last (a planner that scaled 0.8 s into the step had left
        # only the 4 unqueued ones ended at ready_at: p90 27 ms, no breach to see)
        before = [r for r in results if r[0] < started_at]
        after = [r for r in results[settle:] if r[0] >= ready_at]
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)

        print("TTFTs after", sorted(round(r[1] * 1000) for r in after))
        ttft_before = p90([r[1] for r in before]) * 1000
        ttft_after = p90([r[1] for r in after]) * 1000
        tpot_after = p90([r[2] for r in after]) * 1000
        print(
            f"scale-up after {started_at - step_at:.1f}s; worker ready after "
            f"{ready_at - started_at:.1f}s; p90 TTFT before {ttft_before:.0f} ms "
            f"({len(before)} requests), after {ttft_after:.0f} ms, p90 TPOT after "
            f"{tpot_after:.0f} ms ({len(after)} requests)"
        )
        assert ttft_before > SLO_TTFT_MS, "the load step did not breach the TTFT SLO"
        assert len(after) >= 15
        assert ttft_after < SLO_TTFT_MS and tpot_after < SLO_TPOT_MS
        served = {w["worker_id"]: w for w in workers(url)}
        assert set(served) == {"decode-0", "decode-1"}
        await asyncio.to_thread(all_kv_free, [w["url"] for w in served.values()])
    finally:
        code = up.stop()
    assert code == 0, up.text
    assert "all processes stopped" in up.text


async def test_quiet_load_removes_the_extra_worker_and_no_request_fails(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Scale-down under light load: the planner drains and stops decode-1 while a client keeps
    streaming; every request succeeds, the router stops listing the worker, its process
    exits, and the remaining worker's KV pool is free."""
    up = Up(autoscaled_up(tiny_model_dir, tmp_path, 2, "1", "4", ["--kv-cache-bytes", "6000000"]))
    try:
        url = up.wait_for(r"pdserve is up: (\S+)/v1", 300).group(1)
        before = {w["worker_id"]: w["url"] for w in workers(url)}
        assert set(before) == {"decode-0", "decode-1"}
        results: list[tuple] = []
        # Light on any machine: one request at a time, at most 2 a second (a closed loop with
        # no pause ran 18 a second on a quiet machine, which the profile says needs both).
        until = time.monotonic() + 120
        load = asyncio.create_task(closed_loop(url, 1, 16, until, results, pace_s=0.5))
        await asyncio.to_thread(up.wait_for, r"draining and stopping decode-1", 60)
        stopping_at = len(results)

        async def dropped() -> None:  # the router no longer lists decode-1
            while any(w["worker_id"] == "decode-1" for w in workers(url)):
                await asyncio.sleep(0.2)

        await asyncio.wait_for(dropped(), 30)
        while len(results) < stopping_at + 10 and not load.done():  # served by decode-0 alone
            await asyncio.sleep(0.2)
        if load.done():
            load.result()  # a failed request fails the test with its own error
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
        assert len(results) >= stopping_at + 10
        deadline = time.monotonic() + 30
        while True:  # the process is gone: its port no longer answers
            try:
                httpx.get(before["decode-1"] + "/health", timeout=1)
            except httpx.HTTPError:
                break
            assert time.monotonic() < deadline, "decode-1 still answers after its scale-down"
            await asyncio.sleep(0.5)
        assert [w["worker_id"] for w in workers(url)] == ["decode-0"]
        await asyncio.to_thread(all_kv_free, [before["decode-0"]])
        assert "started decode-2" not in up.text  # no flapping back up under the light load
    finally:
        code = up.stop()
    assert code == 0, up.text


async def test_workers_file_is_reread_on_change_and_bad_files_are_refused(tmp_path: Path) -> None:
    from pdserve.router.discovery.file import FileSource, write_workers_file

    path = tmp_path / "workers.json"
    write_workers_file(path, [], ["http://127.0.0.1:8200"])
    source = FileSource(path)
    assert [(e.url, e.role) for e in await source.list()] == [("http://127.0.0.1:8200", "decode")]
    time.sleep(0.02)  # a new mtime
    write_workers_file(path, ["127.0.0.1:8100"], ["http://127.0.0.1:8200", "http://127.0.0.1:8210"])
    got = [(e.url, e.role) for e in await source.list()]
    assert got == [
        ("http://127.0.0.1:8100", "prefill"),
        ("http://127.0.0.1:8200", "decode"),
        ("http://127.0.0.1:8210", "decode"),
    ]
    time.sleep(0.02)
    path.write_text('{"decode": "http://x"}')
    with pytest.raises(ValueError, match=r"workers file .*'decode' must be a list of URLs"):
        await source.list()  # the router's discovery keeps the last good list meanwhile
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"workers file .*workers.json"):
        FileSource(path)  # at start-up: refused with the file's name
