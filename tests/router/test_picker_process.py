"""``pdserve router --mode endpoint-picker`` as a process: it becomes ready on gRPC health
once a decode worker is, picks for the Envoy-side client, serves its metrics on
``--admin-port``, and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.router.picker.prefill_header import PREFILL_HEADER, endpoint_of
from pdserve.testing.loopback import free_port, start_router
from pdserve.testing.picker import Envoy
from pdserve.testing.router_fakes import FakeState, decode_app, prefill_app, serve

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


async def _wait_ready(channel: grpc.aio.Channel, proc: asyncio.subprocess.Process) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service="readiness")
    for _ in range(1200):  # the start-up imports take long on a loaded machine
        assert proc.returncode is None, "the picker exited at start-up"
        try:
            reply = await health.Check(request, timeout=1)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("the picker never became ready")


async def test_picker_process_picks_and_stops(tiny_model_dir: Path) -> None:
    pst, dst = FakeState("prefill", "p0"), FakeState("decode", "d0")
    async with serve(prefill_app(pst)) as purl, serve(decode_app(dst)) as durl:
        port, front, admin = free_port(), free_port(), free_port()
        proc = await start_router(
            *("--mode", "endpoint-picker", "--model", str(tiny_model_dir)),
            *("--grpc-port", str(port), "--target-port", str(front), "--admin-port", str(admin)),
            *("--prefill", purl, "--decode", durl, "--disagg-threshold", "8"),
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await _wait_ready(channel, proc)
                env = Envoy(ep_grpc.ExternalProcessorStub(channel))
                body = {"model": tiny_model_dir.name, "prompt": "hello " * 30, "max_tokens": 3}
                routed = await env.request("/v1/completions", json.dumps(body).encode())
                await env.response(routed.endpoints[0], [b"data: [DONE]\n\n"])
                env.close()
            async with httpx.AsyncClient() as h:  # the picker's own series on --admin-port
                metrics = (await h.get(f"http://127.0.0.1:{admin}/metrics")).text
            assert 'pdserve_router_routing_decisions_total{kind="remote_prefill"} 1.0' in metrics
        finally:
            proc.terminate()
            output = (await asyncio.wait_for(proc.communicate(), 30))[0].decode()
        assert proc.returncode == 0, output
        assert "Traceback" not in output, output
        assert routed.endpoints == [f"127.0.0.1:{front}"]  # the decode pod, at --target-port
        assert routed.set_headers[PREFILL_HEADER] == endpoint_of(purl)
