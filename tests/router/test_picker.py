"""The endpoint picker (router/picker/) against a client that plays Envoy's side of ext_proc.

``Envoy`` below speaks the protocol as the proxy does: request headers (with the
``protocol_config`` of its processing mode and, optionally, the subset hint), the body
in chunks, then the response's headers (with the served endpoint) and body chunks. The
workers are the tests' fakes (pdserve/testing/router_fakes.py), which publish real KV events.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.lora_files import adapter_hash
from pdserve.protocol.hashing import block_hashes, salt_root
from pdserve.router.picker.prefill_header import PREFILL_HEADER, SIGNATURE_HEADER, endpoint_of
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.testing.picker import completion, start_picker
from tests.router.lora_fakes import write_adapter

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture
def picker_factory(router_tokenizer: PromptTokenizer, tiny_model_dir: Path):
    def make(**kw: Any):
        return start_picker(router_tokenizer, tiny_model_dir, **kw)

    return make


async def test_destination_header_and_metadata_agree(picker_factory) -> None:
    async with picker_factory(disagg_threshold=32) as pc:
        env = pc.envoy()
        body = completion(list(range(10, 90)))
        routed = await env.request("/v1/completions", body, chunks=4)
        env.close()
        assert routed.status == 0, routed.error
        assert routed.metadata == ",".join(routed.endpoints)  # one value, both ways
        assert sorted(routed.endpoints) == sorted(pc.endpoint(i) for i in range(2))
        assert routed.body_back == body  # full duplex: the body goes on unchanged
        prefill = routed.set_headers[PREFILL_HEADER]  # 80 uncached tokens: remote prefill
        assert prefill in {endpoint_of(u) for u in pc.prefill_urls}
        assert routed.set_headers[SIGNATURE_HEADER]
        await pc.settle()


@pytest.mark.parametrize("picker", ["max-score", "round-robin"])
async def test_prefix_affinity_is_visible(picker_factory, picker: str) -> None:
    """Requests sharing a long prefix are sent to one prefill worker (the router's prefix
    index learns the pick at once), where rotation (the baseline) spreads each prefix
    over both; a short prompt prefills on the decode worker."""
    groups = [list(range(10 + g, 138 + g)) for g in (0, 300, 600)]
    async with picker_factory(disagg_threshold=32, picker=picker) as pc:
        where: dict[int, set[str]] = {g: set() for g in range(len(groups))}
        for r in range(4):
            for g, prefix in enumerate(groups):  # interleaved: g0 g1 g2 g0 g1 g2 ...
                env = pc.envoy()
                routed = await env.request("/v1/completions", completion([*prefix, 500 + r]))
                env.close()
                where[g].add(routed.set_headers[PREFILL_HEADER])
        spread = {g: len(s) for g, s in where.items()}
        assert spread == ({0: 1, 1: 1, 2: 1} if picker == "max-score" else {0: 2, 1: 2, 2: 2})
        env = pc.envoy()
        short = await env.request("/v1/completions", completion([11, 12, 13]))
        env.close()
        assert PREFILL_HEADER not in short.set_headers
        assert PREFILL_HEADER in short.removed and SIGNATURE_HEADER in short.removed
        await pc.settle()


async def test_large_body_comes_back_whole(picker_factory) -> None:
    """A 300 KB body (JSON with room to breathe): picked on, and sent back to the proxy in
    pieces, unchanged; a prompt over the context is refused naming the field."""
    async with picker_factory() as pc:
        env = pc.envoy()
        body = completion("hello")[:-1] + b" " * 300_000 + b"}"
        routed = await env.request("/v1/completions", body, chunks=7)
        env.close()
        assert routed.status == 0, routed.error
        assert routed.body_back == body
        env = pc.envoy()
        routed = await env.request("/v1/completions", completion("lorem ipsum " * 2_000))
        env.close()
        assert routed.status == 400 and routed.error["error"]["param"] == "prompt"
        assert routed.error["error"]["code"] == "context_length_exceeded"
        await pc.settle()


async def test_chat_body_in_one_chunk_buffered_mode(picker_factory) -> None:
    async with picker_factory() as pc:
        env = pc.envoy(duplex=False)
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        routed = await env.request("/v1/chat/completions", body.encode(), chunks=1)
        assert routed.status == 0 and routed.endpoints and routed.body_back == b""
        passed = await env.response(routed.endpoints[0], [b'{"id": "x"}'])
        assert passed == [b'{"id": "x"}']
        env.close()
        await pc.settle()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "tiny", "prompt": ', None),  # not JSON
        (completion("hi", max_tokens=-1), "max_tokens"),
        (completion("hi", temperature="hot"), "temperature"),
        (completion(None), "prompt"),
    ],
)
async def test_bad_body_is_an_immediate_400(picker_factory, body: bytes, param: str) -> None:
    async with picker_factory() as pc:
        env = pc.envoy()
        routed = await env.request("/v1/completions", body, chunks=2)
        env.close()
        assert routed.status == 400, routed
        assert routed.error["error"]["type"] == "invalid_request_error"
        if param:
            assert routed.error["error"]["param"] == param
        await pc.settle()


async def test_subset_hint_is_obeyed(picker_factory) -> None:
    async with picker_factory() as pc:
        only = pc.endpoint(1)
        env = pc.envoy()
        routed = await env.request("/v1/completions", completion("hello"), subset=[only])
        env.close()
        assert routed.endpoints == [only]
        env = pc.envoy()
        routed = await env.request("/v1/completions", completion("hello"), subset=["10.9.9.9:1"])
        env.close()
        assert routed.status == 503 and routed.error["error"]["code"] == "no_worker"
        await pc.settle()


async def test_request_without_body_is_routed_by_load(picker_factory) -> None:
    async with picker_factory() as pc:
        env = pc.envoy()
        routed = await env.request("/v1/models", None)
        env.close()
        assert routed.status == 0 and routed.endpoints[0] in {pc.endpoint(0), pc.endpoint(1)}
        await pc.settle()


async def test_served_fallback_takes_the_failed_primary_out(picker_factory) -> None:
    """The proxy walked to the fallback: the primary failed, so the next pick leaves it
    out (until a health check passes again), and the in-flight count follows the fallback."""
    async with picker_factory(busy=[1], health_interval_s=30.0) as pc:
        env = pc.envoy()
        routed = await env.request("/v1/completions", completion("hello"))
        assert routed.endpoints == [pc.endpoint(0), pc.endpoint(1)]  # d1 is busier
        await env.response(pc.endpoint(1), [b"data: 1\n\n", b"data: [DONE]\n\n"])
        env.close()
        env = pc.envoy()
        again = await env.request("/v1/completions", completion("hello"))
        env.close()
        assert again.endpoints == [pc.endpoint(1)]
        pc.decode[1].active.pop("busy")
        await pc.settle()


async def test_proxy_going_away_frees_the_in_flight_count(picker_factory) -> None:
    """The proxy drops the stream mid-response (a client that left): the pick's in-flight
    count on the decode worker ends with it."""
    async with picker_factory() as pc:
        env = pc.envoy()
        routed = await env.request("/v1/completions", completion("hello"))
        snap = pc.service.rt.discovery.snapshot()
        assert sum(w.inflight for w in snap.decode) == 1
        env.call.cancel()
        await pc.settle()
        assert routed.endpoints


async def test_health_service(picker_factory) -> None:
    """Liveness is the process; readiness (and the ext_proc service's) follows whether a
    decode worker is ready."""
    async with picker_factory() as pc:
        health = health_pb2_grpc.HealthStub(pc.channel)

        async def status(name: str) -> int:
            return (await health.Check(health_pb2.HealthCheckRequest(service=name))).status

        serving = health_pb2.HealthCheckResponse.SERVING
        for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert await status(name) == serving, name
        for st in pc.decode:
            st.healthy = False
        for _ in range(100):
            if await status("readiness") != serving:
                break
            await asyncio.sleep(0.05)
        assert await status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status("liveness") == serving
        env = pc.envoy()
        routed = await env.request("/v1/completions", completion("hello"))
        env.close()
        assert routed.status == 503 and routed.error["error"]["code"] == "no_worker"


async def test_api_keys_are_checked(picker_factory) -> None:
    async with picker_factory(api_keys=("k1",)) as pc:
        env = pc.envoy()
        routed = await env.request("/v1/completions", completion("hello"))
        env.close()
        assert routed.status == 401
        env = pc.envoy()
        headers = {"authorization": "Bearer k1"}
        routed = await env.request("/v1/completions", completion("hello"), headers=headers)
        env.close()
        assert routed.status == 0 and routed.endpoints
        await pc.settle()


async def test_adapter_requests_follow_the_adapters_own_prefix(
    picker_factory, tmp_path: Path
) -> None:
    """An adapter (``--lora``) is served by its name, and its prompt's blocks are hashed
    under the adapter as its workers store them: with the base model's blocks on p0 and
    the adapter's on p1, the adapter's request prefills on p1 and the base model's on p0
    (before the picker knew adapters: a 404, and unkeyed hashes)."""
    sql = write_adapter(tmp_path, "sql", 1)
    prompt = list(range(10, 138))  # 8 blocks of 16; 4 of them held: 64 uncached tokens
    async with picker_factory(disagg_threshold=32, loras=(("sql", str(sql)),)) as pc:
        index = pc.service.rt.index
        index.stored("p0", block_hashes(prompt[:64], 16))
        index.stored("p1", block_hashes(prompt[:64], 16, salt_root(None, adapter_hash(sql))))
        for model, want in (("sql", 1), ("tiny", 0), ("sql", 1)):
            env = pc.envoy()
            routed = await env.request("/v1/completions", completion(prompt, model=model))
            env.close()
            assert routed.status == 0, routed.error
            assert routed.set_headers[PREFILL_HEADER] == endpoint_of(pc.prefill_urls[want])
        env = pc.envoy()
        missing = await env.request("/v1/completions", completion(prompt, model="nope"))
        env.close()
        assert missing.status == 404 and missing.error["error"]["code"] == "model_not_found"
        await pc.settle()


async def test_only_the_gateway_speaks_ext_proc(picker_factory) -> None:
    """Issue 44 item 2: with --gateway-token-file a pod that reaches :9002 without the
    gateway's credential picks nothing, and its forged ``served`` metadata (naming the
    fallback, as if the primary had failed) takes no worker out. Before, any stream was
    taken, and one forged reply marked a healthy decode worker as failed."""
    from pdserve.router.picker.server import GATEWAY_TOKEN_KEY

    async with picker_factory(busy=[1], health_interval_s=30.0, gateway_token="gw-1") as pc:
        for metadata in ((), ((GATEWAY_TOKEN_KEY, "guessed"),)):
            env = pc.envoy(metadata=metadata)
            env.close()  # its first message would race the refusal; the status is the point
            assert await env.call.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not pc.service.rt.discovery.failed_check(pc.decode_urls[0])
        env = pc.envoy(metadata=((GATEWAY_TOKEN_KEY, "gw-1"),))  # the gateway itself
        routed = await env.request("/v1/completions", completion("hello"))
        assert routed.endpoints == [pc.endpoint(0), pc.endpoint(1)]
        await env.response(pc.endpoint(0), [b"data: [DONE]\n\n"])
        env.close()
        pc.decode[1].active.pop("busy")
        await pc.settle()
