"""An endpoint picker over fake workers on loopback, and Envoy's half of its ext_proc
streams: what the picker tests (tests/router/test_picker*.py, test_abuse_both_modes.py)
and bench/chaos_isolation.py drive. Real sockets and gRPC; the workers are
pdserve.testing.router_fakes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from pdserve.router.config import RouterConfig
from pdserve.router.discovery.workers import StaticSource
from pdserve.router.picker import envoy_msgs as msgs
from pdserve.router.picker.prefill_header import endpoint_of
from pdserve.router.picker.service import ExtProcTLS, PickerService
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.testing.router_fakes import TOTAL_BLOCKS, FakeState, start_fakes


@dataclass
class Routed:
    """What the picker answered for one request (or its immediate response)."""

    endpoints: list[str] = field(default_factory=list)
    metadata: str = ""
    set_headers: dict[str, str] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    body_back: bytes = b""  # full duplex: the body as the picker sent it back
    status: int = 0  # an immediate response's HTTP status
    error: dict[str, Any] = field(default_factory=dict)


class Envoy:
    """Envoy's half of one ext_proc stream (one HTTP request)."""

    def __init__(
        self,
        stub: ep_grpc.ExternalProcessorStub,
        duplex: bool = True,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.queue: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()
        self.duplex = duplex
        self.call = stub.Process(self._requests(), metadata=metadata or None)

    async def _requests(self) -> AsyncIterator[ep.ProcessingRequest]:
        while (msg := await self.queue.get()) is not None:
            yield msg

    async def recv(self) -> ep.ProcessingResponse:
        out = await asyncio.wait_for(self.call.read(), 10)
        assert out is not grpc.aio.EOF, "the picker closed the stream"
        return out

    def close(self) -> None:
        self.queue.put_nowait(None)

    async def request(
        self,
        path: str,
        body: bytes | None,
        chunks: int = 3,
        subset: Sequence[str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Routed:
        mode = msgs.FULL_DUPLEX if self.duplex else msgs.BUFFERED
        first = ep.ProcessingRequest(
            request_headers=_headers(
                {
                    ":method": "POST" if body else "GET",
                    ":path": path,
                    "content-type": "application/json",
                    **(headers or {}),
                },
                end=body is None,
            ),
            protocol_config=ep.ProtocolConfiguration(
                request_body_mode=mode, response_body_mode=mode
            ),
        )
        if subset is not None:
            first.metadata_context.filter_metadata[msgs.SUBSET_NAMESPACE].update(
                {msgs.SUBSET: list(subset)}
            )
        self.queue.put_nowait(first)
        if body is not None:
            if not self.duplex:  # buffered: the headers are answered before the body is sent
                resp = await self.recv()
                assert resp.WhichOneof("response") == "request_headers"
                assert not resp.request_headers.response.header_mutation.set_headers
            step = max(1, -(-len(body) // chunks))
            parts = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
            for i, part in enumerate(parts):
                end = i == len(parts) - 1
                chunk = ep.HttpBody(body=part, end_of_stream=end)
                self.queue.put_nowait(ep.ProcessingRequest(request_body=chunk))
        return await self._routed(body)

    async def _routed(self, body: bytes | None) -> Routed:
        resp = await self.recv()
        kind = resp.WhichOneof("response")
        if kind == "immediate_response":
            im = resp.immediate_response
            return Routed(status=im.status.code, error=json.loads(im.body))
        common = (resp.request_headers if kind == "request_headers" else resp.request_body).response
        assert common.clear_route_cache
        sets = {
            h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
        }
        lb = resp.dynamic_metadata.fields[msgs.LB_NAMESPACE].struct_value
        out = Routed(
            sets[msgs.DESTINATION].split(","),
            lb.fields[msgs.DESTINATION].string_value,
            sets,
            list(common.header_mutation.remove_headers),
        )
        if body is not None and self.duplex:  # the body back, in pieces, the last one marked
            assert kind == "request_headers" and sets["content-length"] == str(len(body))
            end = False
            while not end:
                msg = await self.recv()
                streamed = msg.request_body.response.body_mutation.streamed_response
                out.body_back += streamed.body
                end = streamed.end_of_stream
        return out

    async def response(self, served: str, chunks: Sequence[bytes]) -> list[bytes]:
        """The upstream's answer through the picker; what the proxy would pass on."""
        msg = ep.ProcessingRequest(
            response_headers=_headers({":status": "200", "content-type": "text/event-stream"})
        )
        if served:
            msg.metadata_context.filter_metadata[msgs.LB_NAMESPACE].update({msgs.SERVED: served})
        self.queue.put_nowait(msg)
        assert (await self.recv()).WhichOneof("response") == "response_headers"
        passed = []
        for i, chunk in enumerate(chunks):
            end = i == len(chunks) - 1
            part = ep.HttpBody(body=chunk, end_of_stream=end)
            self.queue.put_nowait(ep.ProcessingRequest(response_body=part))
            resp = (await self.recv()).response_body.response
            if self.duplex:
                streamed = resp.body_mutation.streamed_response
                assert streamed.end_of_stream == end
                passed.append(streamed.body)
            else:  # buffered/streamed: the proxy passes its own chunk on
                assert not resp.HasField("body_mutation")
                passed.append(chunk)
        return passed


def _headers(values: dict[str, str], end: bool = False) -> ep.HttpHeaders:
    hs = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs), end_of_stream=end)


@dataclass
class PickerCluster:
    service: PickerService
    stub: ep_grpc.ExternalProcessorStub
    channel: grpc.aio.Channel
    prefill: list[FakeState]
    decode: list[FakeState]
    prefill_urls: list[str]
    decode_urls: list[str]
    target: dict[str, str]  # decode worker URL -> the endpoint the gateway dials

    def envoy(self, duplex: bool = True, metadata: tuple[tuple[str, str], ...] = ()) -> Envoy:
        return Envoy(self.stub, duplex, metadata)

    def endpoint(self, i: int) -> str:
        return self.target.get(self.decode_urls[i], endpoint_of(self.decode_urls[i]))

    async def settle(self, timeout: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.free():
            assert loop.time() < deadline, "KV or in-flight counts not freed"
            await asyncio.sleep(0.02)

    def free(self) -> bool:
        fakes_free = all(st.kv_blocks_free == TOTAL_BLOCKS for st in self.prefill + self.decode)
        snap = self.service.rt.discovery.snapshot()
        return fakes_free and all(w.inflight == 0 for w in snap.workers)


@contextlib.asynccontextmanager
async def start_picker(
    tokenizer: PromptTokenizer,
    model_dir: Path,
    n_prefill: int = 2,
    n_decode: int = 2,
    target: dict[str, str] | None = None,
    busy: Sequence[int] = (),
    gateway_token: str = "",
    tls: ExtProcTLS | None = None,
    client_tls: grpc.ChannelCredentials | None = None,
    metrics_port: int = 0,
    **cfg: Any,
) -> AsyncIterator[PickerCluster]:
    """Fake workers, and a picker over them on a free port; ``busy`` decode fakes report
    one running request (so the others rank first). ``tls``: the picker serves mutual
    TLS; ``client_tls``: the test's channel credentials (the gateway's)."""
    async with contextlib.AsyncExitStack() as stack:
        f = await start_fakes(stack, n_prefill, n_decode, busy=busy)
        cfg.setdefault("health_interval_s", 0.2)
        config = RouterConfig(model_dir=str(model_dir), served_model_name="tiny", **cfg)
        targets = dict(target or {})
        source = StaticSource(f.prefill_urls, f.decode_urls)
        service = PickerService(
            config,
            source,
            tokenizer,
            target=lambda w: targets.get(w.url, endpoint_of(w.url)),
            gateway_token=gateway_token,
            tls=tls,
        )
        port = await service.start("127.0.0.1", 0, metrics_port)
        stack.push_async_callback(service.close)
        if client_tls is None:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        else:
            channel = grpc.aio.secure_channel(f"127.0.0.1:{port}", client_tls)
        stack.push_async_callback(channel.close)
        await _synced(service, n_prefill + n_decode)
        yield PickerCluster(
            service,
            ep_grpc.ExternalProcessorStub(channel),
            channel,
            f.prefill,
            f.decode,
            f.prefill_urls,
            f.decode_urls,
            targets,
        )


async def _synced(service: PickerService, workers: int, timeout: float = 15.0) -> None:
    """Every worker healthy and its KV feed synced (its ``/kv_blocks`` snapshot applied), so
    a test's own entries in the index are not replaced by a snapshot that lands later."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    discovery = service.rt.discovery
    while True:
        healthy = sum(w.healthy for w in discovery.snapshot().workers)
        if healthy == workers and discovery.synced():
            return
        assert loop.time() < deadline, f"{healthy}/{workers} workers healthy and synced"
        await asyncio.sleep(0.02)


def completion(prompt: Any, max_tokens: int = 4, stream: bool = True, **extra: Any) -> bytes:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    return json.dumps({**body, **extra}).encode()


def forged_served_messages(body: bytes, served: str) -> list[ep.ProcessingRequest]:
    """What a pod that is not the gateway would send to take a decode worker out: one
    request (headers with a full-duplex protocol config, the body), then response headers
    whose ``served`` metadata names ``served`` as if the primary had failed."""
    first = ep.ProcessingRequest(
        request_headers=_headers({":method": "POST", ":path": "/v1/completions"}),
        protocol_config=ep.ProtocolConfiguration(
            request_body_mode=msgs.FULL_DUPLEX, response_body_mode=msgs.FULL_DUPLEX
        ),
    )
    resp = ep.ProcessingRequest(response_headers=_headers({":status": "200"}))
    resp.metadata_context.filter_metadata[msgs.LB_NAMESPACE].update({msgs.SERVED: served})
    whole = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
    return [first, whole, resp]
