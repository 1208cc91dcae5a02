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

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.router import adapters
from pdserve.router.config import RouterConfig
from pdserve.router.discovery.workers import EndpointSource
from pdserve.router.picker.pick import Picker
from pdserve.router.picker.server import ExtProc
from pdserve.router.runtime import Runtime
from pdserve.router.scheduling.snapshot import WorkerView
from pdserve.router.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)


class PickerService:
    def __init__(
        self,
        cfg: RouterConfig,
        source: EndpointSource,
        tokenizer: PromptTokenizer,
        fallbacks: int = 2,
        target: Callable[[WorkerView], str] | None = None,
        gateway_token: str = "",
    ) -> None:
        # --lora: served as models of their names, each hashed now (an unreadable one stops
        # the start), as the built-in router does
        loras = adapters.declared(cfg.loras, (cfg.model_name, cfg.model_dir))
        self.rt = Runtime(cfg, source, tokenizer, loras)
        self.picker = Picker(self.rt, fallbacks, target)
        self.gateway_token = gateway_token  # "": every stream taken (see server.py)
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
        self.port = server.add_insecure_port(address)
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

        app = web.Application()
        app.router.add_get("/metrics", metrics)
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
