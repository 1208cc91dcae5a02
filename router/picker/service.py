"""The endpoint picker as a process: the router's runtime plus a gRPC server.

``PickerService`` starts discovery (and with it the prefix index's KV-event
subscriptions), serves ext_proc and gRPC health on one port, and marks itself ready
once a decode worker is: the protocol's health services are ``liveness`` (the process
answers), ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` (a decode
worker is ready to be picked), plus the overall ``""`` like readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve import signing
from pdserve.router import adapters
from pdserve.router.config import RouterConfig
from pdserve.router.discovery.workers import EndpointSource
from pdserve.router.peer_budgets import PATH as PEER_PATH
from pdserve.router.picker.pick import Picker
from pdserve.router.picker.server import ExtProc
from pdserve.router.runtime import Runtime
from pdserve.router.scheduling.snapshot import WorkerView
from pdserve.router.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)


@dataclass(frozen=True)
class ExtProcTLS:
    """Mutual TLS on the ext_proc port (``--ext-proc-tls-cert/-key/-client-ca``): the
    picker's certificate and key, and the CA that signs the gateway's client certificate.
    A client without a certificate from that CA fails the handshake: it never reaches
    ext_proc, so it can neither pick nor send ``served`` metadata (issue 44 item 2)."""

    cert_pem: bytes
    key_pem: bytes
    client_ca_pem: bytes

    @classmethod
    def from_files(cls, cert: str, key: str, client_ca: str) -> ExtProcTLS:
        given = {"--ext-proc-tls-cert": cert, "--ext-proc-tls-key": key}
        given["--ext-proc-client-ca"] = client_ca
        missing = [name for name, path in given.items() if not path]
        if missing:
            raise ValueError(
                f"{', '.join(missing)} missing: mutual TLS needs the certificate, its key "
                "and the client CA together"
            )
        pems = []
        for name, path in given.items():
            try:
                with open(path, "rb") as f:
                    pem = f.read()
            except OSError as exc:
                raise ValueError(f"{name}: {exc}") from exc
            if b"-----BEGIN" not in pem:
                raise ValueError(f"{name}: {path} holds no PEM block")
            pems.append(pem)
        return cls(pems[0], pems[1], pems[2])

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=self.client_ca_pem,
            require_client_auth=True,
        )


class PickerService:
    def __init__(
        self,
        cfg: RouterConfig,
        source: EndpointSource,
        tokenizer: PromptTokenizer,
        fallbacks: int = 2,
        target: Callable[[WorkerView], str] | None = None,
        gateway_token: str = "",
        tls: ExtProcTLS | None = None,
    ) -> None:
        # --lora: served as models of their names, each hashed now (an unreadable one stops
        # the start), as the built-in router does
        loras = adapters.declared(cfg.loras, (cfg.model_name, cfg.model_dir))
        self.rt = Runtime(cfg, source, tokenizer, loras)
        self.picker = Picker(self.rt, fallbacks, target)
        self.gateway_token = gateway_token  # "": every stream taken (see server.py)
        self.tls = tls  # None: plaintext gRPC (the NetworkPolicy and the token guard it)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._ready = False
        self._metrics: web.AppRunner | None = None

    async def start(self, host: str, port: int, metrics_port: int = 0) -> int:
        """Serve on ``host:port`` (0: any free port); returns the port. ``metrics_port``:
        where ``GET /metrics`` answers (the router's series: decisions, prefix matches,
        the index's size; 0: nowhere)."""
        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(
            ExtProc(self.picker, self.gateway_token), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self.tls is None:
            self.port = server.add_insecure_port(address)
        else:
            self.port = server.add_secure_port(address, self.tls.credentials())
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        for name in READY_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self.server = server
        self.rt.discovery.after_refresh.append(self._on_refresh)
        await self.rt.start()
        await self._set_ready()
        if metrics_port:
            await self._serve_metrics(host, metrics_port)
        return self.port

    async def _serve_metrics(self, host: str, port: int) -> None:
        async def metrics(_: web.Request) -> web.Response:
            body = self.rt.metrics.render()
            return web.Response(body=body, content_type="text/plain", charset="utf-8")

        async def health(request: web.Request) -> web.Response:
            # The kubelet's gRPC probes speak no TLS: with mTLS on the ext_proc port the
            # pod is probed here (liveness: the process answers; readiness: a decode
            # worker is ready), as the gRPC health services say.
            ready = self._ready or request.path == "/livez"
            return web.Response(status=200 if ready else 503, text="ok" if ready else "no")

        async def budget(request: web.Request) -> web.Response:
            """Another picker replica's call on a key this one keeps (--budget-peers)."""
            peers = self.rt.peers
            if peers is None:
                return web.json_response({"error": "no --budget-peers here"}, status=404)
            status, body, headers = await peers.answer(
                request.headers.get(signing.HEADER),
                request.headers.get("Host", ""),
                request.path,
                request.content.iter_chunked(1024),
            )
            return web.json_response(body, status=status, headers=headers)

        app = web.Application()
        app.router.add_post(PEER_PATH, budget)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/livez", health)
        app.router.add_get("/health", health)
        self._metrics = web.AppRunner(app, access_log=None)
        await self._metrics.setup()
        await web.TCPSite(self._metrics, host, port).start()

    def _on_refresh(self) -> None:
        asyncio.get_running_loop().create_task(self._set_ready())

    async def _set_ready(self) -> None:
        ready = bool(self.rt.discovery.snapshot().decode)
        if ready == self._ready:
            return
        self._ready = ready
        codes = health_pb2.HealthCheckResponse
        status = codes.SERVING if ready else codes.NOT_SERVING
        for name in READY_SERVICES:
            await self.health.set(name, status)

    async def close(self) -> None:
        if self._metrics is not None:
            await self._metrics.cleanup()
            self._metrics = None
        if self.server is not None:
            await self.server.stop(grace=2.0)
            self.server = None
        await self.rt.close()


async def serve_forever(
    service: PickerService, host: str, port: int, metrics_port: int = 0
) -> None:
    """Run until SIGTERM/SIGINT (a pod's stop), then close."""
    bound = await service.start(host, port, metrics_port)
    log.info("endpoint picker (ext_proc) listening on %s:%d", host, bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await service.close()
