"""Real worker processes on loopback for the worker tests.

Every cluster here is real: ``python -m pdserve prefill-worker`` and
``decode-worker`` processes, a real model from disk, KV moved over NIXL (or the
tcp transport). Helpers talk to the workers' internal HTTP API.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from pdserve.local.proc_group import poll_until, signal_group
from pdserve.local.processes import ClusterSpec, LocalCluster, Proc
from pdserve.protocol.codec import to_dict
from pdserve.protocol.contract import GenerateRequest, PrefillRequest, RequestRef
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.signed_httpx import SignedAuth
from pdserve.testing.loopback import SMALL_WORKER_ARGS, worker_port_base

SECRET = "worker-tests-secret"  # the clusters' service secret: every internal call sends it
AUTH = SignedAuth(SECRET)  # calls to the workers' internal API are signed

WORKER_ARGS = SMALL_WORKER_ARGS


@contextlib.contextmanager
def worker_cluster(
    model_dir: Path,
    tmp_path: Path,
    transport: str = "nixl",
    prefill_args: tuple[str, ...] = (),
    decode_args: tuple[str, ...] = (),
    num_prefill: int = 1,
    num_decode: int = 1,
    core_zygote: bool = True,
) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model_dir=str(model_dir),
        num_prefill=num_prefill,
        num_decode=num_decode,
        dtype="float32",
        kv_transport=transport,
        worker_args=WORKER_ARGS,
        prefill_args=prefill_args,
        decode_args=decode_args,
        log_dir=str(tmp_path / "logs"),
        secret=SECRET,
        # Away from the default 8100 that other suites on this machine start at the same time,
        # and below the ephemeral range (32768+) where UCX and clients take their ports.
        worker_port_base=worker_port_base(),
        core_zygote=core_zygote,
    )
    cluster = LocalCluster(spec)
    try:
        cluster.start_workers()
        cluster.wait_healthy(timeout=240)
        yield cluster
    finally:
        cluster.stop()


def proc(cluster: LocalCluster, role: str) -> Proc:
    return next(p for p in cluster.procs if p.role == role)


def children(pid: int) -> list[int]:
    """The processes ``pid`` started that still run (or wait to be reaped)."""
    return [
        int(c)
        for t in Path(f"/proc/{pid}/task").iterdir()
        for c in (t / "children").read_text().split()
    ]


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1])


def gone(pid: int, timeout: float = 15.0) -> bool:
    """Whether ``pid`` exits (a zombie counts: exited, not yet reaped) within ``timeout``."""

    def exited() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
        except (FileNotFoundError, ProcessLookupError):  # reaped before, or while, read
            return True

    try:
        return poll_until(exited, timeout, 0.05)
    except TimeoutError:
        return False


_CORES: dict[int, int] = {}  # a worker's pid -> its engine core's, asked while it answers


def kill(p: Proc, sig: int = signal.SIGKILL) -> None:
    """``sig`` to the worker's process group; SIGSTOP and SIGCONT also to its engine core,
    which a core zygote forked outside that group (a frozen worker is frozen whole)."""
    assert p.popen is not None
    core = 0
    if sig in (signal.SIGSTOP, signal.SIGCONT):
        core = _CORES.get(p.popen.pid) or int(stats(p.url)["core_pid"])
        _CORES[p.popen.pid] = core
    signal_group(p.popen, sig)
    if core and os.getpgid(core) != os.getpgid(p.popen.pid):
        os.kill(core, sig)
    if sig == signal.SIGKILL:
        p.popen.wait(10)


def stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/stats", timeout=10, auth=AUTH).json()  # type: ignore[no-any-return]


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text  # open: no secret needed
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def assert_all_free(*urls: str, timeout: float = 15.0) -> None:
    """Every KV block of every worker is free again (leases released or expired)."""
    snaps: dict[str, dict[str, Any]] = {}

    def free() -> bool:
        snaps.update({u: stats(u) for u in urls})
        return all(
            s["kv_blocks_free"] == s["kv_blocks_total"] and not s["held"] for s in snaps.values()
        )

    poll_until(free, timeout, what=lambda: f"KV blocks all free (last: {snaps})")


def sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def abort(client: httpx.AsyncClient, url: str, rid: str) -> bool:
    body = to_dict(RequestRef(rid))
    resp = await client.post(url + "/abort", json=body, auth=AUTH, timeout=10)
    return bool(resp.json()["aborted"])


async def prefill(
    client: httpx.AsyncClient, url: str, rid: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """The reply's codec form (a dict, so tests can forge handles from it)."""
    body = to_dict(PrefillRequest(rid, prompt, sampling(max_tokens)))
    resp = await client.post(url + "/prefill", json=body, auth=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


async def decode(
    client: httpx.AsyncClient,
    url: str,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    handle: dict[str, Any] | None = None,
    first_token_id: int | None = None,
) -> tuple[int, list[dict[str, Any]]]:
    """POST /generate; returns (status, lines) — one line for a non-200 reply. ``handle``
    in its codec form, forged or not, is sent as given."""
    body = to_dict(GenerateRequest(rid, prompt, sampling(max_tokens)))
    body.update(kv_handle=handle, first_token_id=first_token_id)
    async with client.stream("POST", url + "/generate", json=body, auth=AUTH, timeout=60) as resp:
        if resp.status_code != 200:
            return resp.status_code, [json.loads(await resp.aread())]
        return 200, [json.loads(line) async for line in resp.aiter_lines() if line]


def tokens_of(lines: list[dict[str, Any]]) -> list[int]:
    return [t for line in lines for t in line.get("token_ids", [])]


async def handoff(
    client: httpx.AsyncClient, p_url: str, d_url: str, rid: str, prompt: list[int], tokens: int
) -> tuple[list[int], int]:
    """One greedy request prefilled at ``p_url``, its KV handed off to ``d_url`` that
    decodes the rest: (every token id, the first one included; the blocks handed off).
    A request its first token already ends (``tokens`` 1) is not handed off (0 blocks)."""
    r = await prefill(client, p_url, rid, prompt, tokens)
    if r["kv_handle"] is None:
        assert r["finish_reason"] == "length" and tokens == 1, r
        return [r["first_token_id"]], 0
    first = r["first_token_id"]
    status, lines = await decode(client, d_url, rid, prompt, tokens, r["kv_handle"], first)
    assert status == 200, lines
    assert lines[-1]["finish_reason"] == "length"
    assert lines[-1]["usage"]["completion_tokens"] == tokens
    return [first, *tokens_of(lines)], len(r["kv_handle"]["block_ids"])
