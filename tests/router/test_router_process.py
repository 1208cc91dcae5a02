"""``pdserve router`` as a real process (uvicorn, CLI parsing, SIGTERM), in front of fakes.

The fake workers (pdserve/testing/router_fakes.py) stand in for the real workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import httpx
import openai
import pytest
import zmq
import zmq.asyncio

from pdserve.testing.loopback import free_port, start_router
from pdserve.testing.router_fakes import FakeState, decode_app, prefill_app, serve

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


async def test_router_process_serves_and_stops(tiny_model_dir: Path, tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pst = FakeState("prefill", "p0")
    pst.kv_events = f"tcp://0.0.0.0:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    dst = FakeState("decode", "d0")
    keyfile = tmp_path / "keys"
    keyfile.write_text("k1\n")
    async with serve(prefill_app(pst, pub)) as purl, serve(decode_app(dst)) as durl:
        port, admin_port = free_port(), free_port()
        proc = await start_router(
            *("--model", str(tiny_model_dir), "--port", str(port)),
            *("--prefill", purl, "--decode", durl, "--disagg-threshold", "8"),
            *("--api-key-file", str(keyfile), "--admin-api-key", "adm"),
            *("--admin-port", str(admin_port)),
        )
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=url) as h:
                for _ in range(300):
                    with contextlib.suppress(httpx.HTTPError):
                        if (await h.get("/health")).status_code == 200:
                            break
                    await asyncio.sleep(0.1)
                cl = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
                model = (await cl.models.list()).data[0].id
                assert model == tiny_model_dir.name
                out = await cl.completions.create(model=model, prompt="hello " * 30, max_tokens=3)
                assert out.choices[0].text.startswith("<")
                workers = (await h.get("/workers", headers={"Authorization": "Bearer adm"})).json()
                assert {w["role"] for w in workers["workers"]} == {"prefill", "decode"}
                admin = f"http://127.0.0.1:{admin_port}"  # no key needed there
                assert (await h.get(admin + "/metrics")).status_code == 200
        finally:
            proc.terminate()
            output = (await asyncio.wait_for(proc.communicate(), 30))[0].decode()
        # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status says why
        assert proc.returncode in (0, -15), output
        assert "Traceback" not in output, output
        assert pst.kv_blocks_free == dst.kv_blocks_free == 1000
    pub.close(0)
    ctx.term()


@pytest.mark.parametrize("end", ["sigterm", "one-process-dies"])
async def test_router_procs_share_one_port(tiny_model_dir: Path, end: str) -> None:
    """--procs 2: two processes on one port (SO_REUSEPORT) serve the requests between them,
    and one scrape of the admin port returns both processes' series (label ``proc``) whose
    sum counts every request. SIGTERM stops both (status 0); a process that dies takes the
    other down and the router exits non-zero (the pod restarts whole)."""
    from prometheus_client.parser import text_string_to_metric_families

    pst, dst = FakeState("prefill", "p0"), FakeState("decode", "d0")
    async with serve(prefill_app(pst)) as purl, serve(decode_app(dst)) as durl:
        port, admin_port = free_port(), free_port()
        proc = await start_router(
            *("--model", str(tiny_model_dir), "--port", str(port)),
            *("--prefill", purl, "--decode", durl, "--procs", "2"),
            *("--admin-port", str(admin_port)),
        )
        url, n = f"http://127.0.0.1:{port}", 24
        try:
            admin = f"http://127.0.0.1:{admin_port}/metrics"
            for _ in range(600):  # both processes up: each one's series is in the scrape
                with contextlib.suppress(httpx.HTTPError):
                    page = httpx.get(admin).text
                    if httpx.get(url + "/health").status_code == 200 and all(
                        f'proc="{i}"' in page for i in (0, 1)
                    ):
                        break
                await asyncio.sleep(0.1)
            body = {"model": tiny_model_dir.name, "prompt": "hello", "max_tokens": 2}
            for _ in range(n):  # a new connection each: the kernel picks a process for each
                async with httpx.AsyncClient() as h:
                    assert (await h.post(url + "/v1/completions", json=body)).status_code == 200
            page = httpx.get(admin).text
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            assert len(children) == 2, children
            if end == "one-process-dies":
                os.kill(int(children[1]), signal.SIGKILL)
                await asyncio.wait_for(proc.wait(), 60)
        finally:
            proc.terminate() if proc.returncode is None else None
            output = (await asyncio.wait_for(proc.communicate(), 60))[0].decode()
        assert (proc.returncode == 0) == (end == "sigterm"), output
        if end == "sigterm":
            assert "Traceback" not in output, output
        assert not any(Path(f"/proc/{c}").exists() for c in children), "a process was left"
        with pytest.raises(httpx.ConnectError):  # no process is left on the port
            httpx.get(url + "/health")
    served: dict[str, float] = {}
    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            if s.name == "pdserve_router_requests_total" and s.labels.get("code") == "200":
                served[s.labels["proc"]] = served.get(s.labels["proc"], 0) + s.value
    assert sum(served.values()) == n, page
    assert set(served) == {"0", "1"} and min(served.values()) > 0, served


async def test_a_per_key_cap_is_the_replicas_over_its_processes(tiny_model_dir: Path) -> None:
    """Issue 44 item 6: ``--procs 3 --max-concurrency-per-key 1``: of 9 concurrent
    requests, each on a connection of its own (the kernel spreads them over the
    processes), exactly one is admitted. Before, each process enforced ceil(1/3) = 1 of
    its own, so the replica admitted one per process reached (up to 3)."""
    pst, dst = FakeState("prefill", "p0"), FakeState("decode", "d0", token_delay_s=0.4)
    async with serve(prefill_app(pst)) as purl, serve(decode_app(dst)) as durl:
        port = free_port()
        proc = await start_router(
            *("--model", str(tiny_model_dir), "--port", str(port)),
            *("--prefill", purl, "--decode", durl, "--procs", "3"),
            *("--max-concurrency-per-key", "1"),
        )
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health").status_code == 200:
                        break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # the other processes' discovery too
            body = {"model": tiny_model_dir.name, "prompt": "hello", "max_tokens": 6}

            async def one() -> int:
                async with httpx.AsyncClient(timeout=30) as h:
                    return (await h.post(url + "/v1/completions", json=body)).status_code

            codes = await asyncio.gather(*(one() for _ in range(9)))
        finally:
            proc.terminate()
            output = (await asyncio.wait_for(proc.communicate(), 60))[0].decode()
        assert sorted(codes) == [200] + [429] * 8, (codes, output[-2000:])
