"""``pdserve up --kv-shared local``: ``up`` starts a redis-server for the shared KV tier,
every worker (prefill and decode) writes its evicted blocks there, and stops it on exit.

A document prefilled by one prefill worker, then evicted from its small pool (written to
the store), is a shared-tier hit on the other prefill worker, which never saw it; the decode
worker's evicted blocks (pulled through the P/D hand-off) come back from its own host tier.
Every pool is free at the end, and the store's port is closed once ``up`` has stopped.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdserve_up import run_up

from pdserve.local.proc_group import poll_until
from pdserve.testing.loopback import all_kv_free, secret_auth

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

BLOCK_BYTES = 4 * 2 * 16 * 2 * 32 * 4  # the tiny model's float32 KV block
POOL_BLOCKS = 24
DOC = [(i * 37) % 2900 + 50 for i in range(97)]  # 6 full blocks + 1 token


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(url + path, json=body, auth=secret_auth(), timeout=120)
    assert r.status_code == 200, r.text
    return r


def _prefill(url: str, rid: str, prompt: list[int]) -> int:
    """Prefill ``prompt`` on the prefill worker at ``url``, end the lease: cached tokens."""
    body = {"type": "prefill_request", "request_id": rid, "prompt_token_ids": prompt}
    reply = _post(url, "/prefill", {**body, "sampling": {"max_tokens": 2}}).json()
    _post(url, "/release", {"type": "request_ref", "request_id": rid})
    return int(reply["num_cached_tokens"])


def _generate(url: str, rid: str, prompt: list[int]) -> int:
    """Prefill and decode ``prompt`` on the decode worker itself: cached tokens."""
    body = {"type": "generate_request", "request_id": rid, "prompt_token_ids": prompt}
    lines = _post(url, "/generate", {**body, "sampling": {"max_tokens": 2}}).text.splitlines()
    usage = [json.loads(x)["usage"] for x in lines if json.loads(x).get("usage")]
    return int(usage[-1]["cached_tokens"])


def _flood(call: Any, url: str, seed: int) -> None:
    """Fill the worker's pool with other prompts: every cached block is evicted."""
    for i in range(3):
        filler = [(seed * 1000 + i * 131 + j * 7) % 2900 + 60 for j in range(16 * 9)]
        call(url, f"fill-{seed}-{i}", filler)


def _tier_hits(url: str, tier: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = rf'^pdserve_kv_tier_hits_total\{{[^}}]*tier="{tier}"[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def _roles(urls: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for u in urls:
        out[httpx.get(u + "/stats", auth=secret_auth(), timeout=10).json()["role"]].append(u)
    return out


def test_up_runs_the_shared_store_and_every_worker_uses_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    extra = (
        "--prefill=2",
        "--kv-shared=local",
        "--enforce-eager",
        f"--worker-arg=--kv-cache-bytes={POOL_BLOCKS * BLOCK_BYTES}",
        "--worker-arg=--kv-tier-host-bytes=8000000",
        "--worker-arg=--kv-tier-load-timeout=10",
    )
    with run_up(tiny_model_dir, tmp_path, *extra) as up:
        roles = _roles(up.workers)
        (a, b), (d,) = roles["prefill"], roles["decode"]
        assert _prefill(a, "doc-a", DOC) == 0
        _flood(_prefill, a, 1)  # the document leaves a's pool: written to the store
        assert _prefill(b, "doc-b", DOC) == 96  # b never saw it: all but the last token
        assert _tier_hits(b, "shared") >= 6 and _tier_hits(a, "shared") == 0
        # The decode worker's blocks (pulled from a prefill worker through the router's
        # P/D hand-off) leave its pool for its own host tier, and come back from there.
        doc2 = [t + 7 for t in DOC]
        model = httpx.get(up.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": doc2, "max_tokens": 2}
        assert httpx.post(up.url + "/v1/completions", json=body, timeout=120).status_code == 200
        _flood(_generate, d, 2)
        assert _tier_hits(d, "host") == 0
        assert _generate(d, "doc-d", doc2) == 96
        assert _tier_hits(d, "host") >= 6
        all_kv_free(up.workers)
        port = _store_port(d)
        assert _listening(port)
    poll_until(lambda: not _listening(port), 15, what=lambda: f"redis on :{port} stopped")


def _store_port(url: str) -> int:
    """The store's port, from the worker's own command line (``up`` passed it)."""
    pid = httpx.get(url + "/stats", auth=secret_auth(), timeout=10).json()["pid"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    store = argv[argv.index("--kv-tier-shared-url") + 1]
    return int(store.removeprefix("redis://127.0.0.1:").split("/")[0])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
