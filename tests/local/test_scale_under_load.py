"""Planned scale-down and scale-up under a steady stream of requests, real processes on
loopback (tiny model, KV over tcp, round-robin, every prompt prefilled remotely).

The fault is injected by slowing the router down: it re-reads its workers file only every
2 s (``--health-interval 2``), as a loaded router does late. A worker stopped as soon as it
is out of the file and momentarily idle (what ``remove_worker`` did) is then still sent
requests for seconds; each one fails on it and is retried elsewhere, or fails the client.
What must hold instead, with 1 prefill + 1 decode worker going to 2 + 2 and back to 1 + 1:

- every request succeeds, long streams that were running on a removed worker included;
- the router never saw a worker fail (``pdserve_router_worker_failures_total`` stays 0)
  and moved no stream (``pdserve_router_migrated_streams_total`` 0): no fail-over needed;
- the added workers get requests only once ready, then do get them;
- keep-alive: a connection idle for longer than uvicorn's default 5 s is still open
  on the router and on a worker (it was the other failure under changing load);
- every remaining worker's KV pool is free at the end.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import time
from pathlib import Path

import httpx
import pytest

from pdserve.local.autoscale import LocalPools
from pdserve.local.drain import router_lists
from pdserve.local.processes import ClusterSpec, LocalCluster
from pdserve.testing.loopback import all_kv_free, free_port, secret_auth, worker_port_base

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.timeout(180),
]  # starting 4 workers: most of it

WORKER_ARGS = ("--device", "cpu", "--cpu-threads", "1", "--max-model-len", "512")
ROUTER_ARGS = ("--picker", "round-robin", "--disagg-threshold", "0", "--health-interval", "2")
CLIENTS = 2


async def completion(client: httpx.AsyncClient, rng: random.Random, max_tokens: int) -> str:
    """One streamed completion; '' when it finished cleanly, else what went wrong."""
    prompt = [rng.randrange(10, 3000) for _ in range(rng.randrange(24, 96))]
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            text = (await resp.aread()).decode()
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    if resp.status_code != 200 or any("error" in c for c in chunks) or "length" not in finish:
        return f"HTTP {resp.status_code}: {text[-300:]}"
    return ""


class Load:
    """``CLIENTS`` loops of short streamed requests until stopped; every outcome kept."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client, self.stop = client, asyncio.Event()
        self.ok, self.errors = 0, []  # type: ignore[var-annotated]
        self.tasks = [asyncio.create_task(self._loop(i)) for i in range(CLIENTS)]

    async def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            self.record(await completion(self.client, rng, rng.randrange(4, 12)))

    def record(self, error: str) -> None:
        if error:
            self.errors.append(error)
        else:
            self.ok += 1

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


def idle_connection(url: str) -> socket.socket:
    """A keep-alive connection to ``url`` after one request on it."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    assert get_livez(sock).startswith(b"HTTP/1.1 200")
    return sock


def get_livez(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /livez HTTP/1.1\r\nHost: pdserve\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(4096)
        if not data:
            return head  # closed by the server
        head += data
    length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))  # type: ignore[union-attr]
    while len(head.split(b"\r\n\r\n", 1)[1]) < length:
        head += sock.recv(4096)
    return head


def counter(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


async def scenario(cluster: LocalCluster, router_url: str) -> None:
    pools = LocalPools(cluster, drain_timeout_s=20.0, listed=router_lists(router_url))
    async with httpx.AsyncClient(base_url=router_url, timeout=60) as client:
        load = Load(client)
        # scale up under load: prefill-1 and decode-1 start, and serve once ready
        await pools.scale("prefill", 2)
        await pools.scale("decode", 2)
        await asyncio.to_thread(cluster.wait_healthy, 120.0)  # the load runs on meanwhile
        await routed(client, cluster)
        await asyncio.sleep(1.0)
        for url in cluster.urls("prefill")[1:] + cluster.urls("decode")[1:]:
            stats = httpx.get(url + "/stats", auth=secret_auth()).json()
            assert stats["prompt_tokens"] + stats["generation_tokens"] > 0, (url, stats)
        # long streams, started last: round-robin spreads them over both decode workers
        rng = random.Random(7)
        long = [asyncio.create_task(completion(client, rng, 120)) for _ in range(4)]
        await streaming_on(cluster.urls("decode")[1])  # it is stopped while it streams
        await pools.scale("prefill", 1)  # the newest go: prefill-1, then decode-1
        await pools.scale("decode", 1)
        assert [p.name for p in cluster.procs if p.role != "router"] == ["prefill-0", "decode-0"]
        for error in await asyncio.gather(*long):
            load.record(error)
        await load.finish()
    assert load.errors == [], load.errors
    assert load.ok > 20, load.ok


async def streaming_on(url: str, timeout: float = 30.0) -> None:
    """Until the worker at ``url`` runs a request (a loaded machine takes a while to get
    a long stream through prefill and KV transfer to it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = httpx.get(url + "/stats", auth=secret_auth()).json()
        if stats["running"] > 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"no request running on {url} after {timeout:g}s")


async def routed(client: httpx.AsyncClient, cluster: LocalCluster) -> None:
    want = set(cluster.urls("prefill") + cluster.urls("decode"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        listed = (await client.get("/workers")).json()["workers"]
        if want <= {w["url"] for w in listed if w["healthy"]}:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"router does not route to all of {want}")


# One of the suite's slowest (~80 s alone): four real workers start (two of them while the
# load runs) and two drain, and the router re-reads its workers file only every 2 s, which
# is the fault under test; a cheaper variant (fakes, or no load) would not exercise it.
def test_planned_scale_down_and_up_under_load_cost_no_request(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = ClusterSpec(
        model_dir=str(tiny_model_dir),
        num_prefill=1,
        num_decode=1,
        dtype="float32",
        kv_transport="tcp",
        served_model_name="tiny",
        worker_args=WORKER_ARGS,
        log_dir=str(tmp_path),
        worker_port_base=worker_port_base(),  # < 32768:
    )  # (the kernel's ephemeral ports start there; one could take a worker's)
    with LocalCluster(spec) as cluster:
        cluster.start_workers()
        router = cluster.start_router(port=free_port(), args=ROUTER_ARGS, dynamic=True)
        cluster.wait_healthy(timeout=120)
        cluster.wait_routed(router)
        idle = [idle_connection(router.url), idle_connection(cluster.urls("decode")[0])]
        start = time.monotonic()
        asyncio.run(scenario(cluster, router.url))
        assert time.monotonic() - start > 6  # longer than uvicorn's default keep-alive
        for sock in idle:  # still open: the server did not close it while idle
            assert get_livez(sock).startswith(b"HTTP/1.1 200"), "idle connection was closed"
            sock.close()
        metrics = httpx.get(router.url + "/metrics").text
        assert counter(metrics, "pdserve_router_worker_failures_total") == 0, metrics
        assert counter(metrics, "pdserve_router_migrated_streams_total") == 0
        all_kv_free(cluster.urls("prefill") + cluster.urls("decode"))
