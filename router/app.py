"""The router's HTTP app: OpenAI API, health, metrics and the admin worker list.

``create_app(cfg, source)`` builds it; ``pdserve router`` serves it with uvicorn.
Tests build it around fake workers.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.router import adapters, metrics_merge
from pdserve.router.api.lora_admin import add_lora_admin_routes
from pdserve.router.api.responses.serve import serve_responses
from pdserve.router.api.serving import serve
from pdserve.router.api.tokenize_api import detokenize, handle, tokenize
from pdserve.router.config import RouterConfig
from pdserve.router.discovery.workers import EndpointSource
from pdserve.router.errors import APIError
from pdserve.router.peer_budgets import PATH as PEER_PATH
from pdserve.router.runtime import Runtime
from pdserve.router.tokenizer import PromptTokenizer

HOT_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat


class RouterApp(FastAPI):
    """FastAPI with a direct lane for the two hot endpoints.

    POST /v1/completions and /v1/chat/completions skip FastAPI's middleware and
    routing layers: about 1 ms less TTFT per request on a loaded CPU (measured with
    ``bench/routing.py``, see docs/router.md). ``serve`` turns every API error into
    OpenAI's body itself; anything else becomes a logged 500, as FastAPI would.
    Every other path and method goes through FastAPI as usual.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        chat = HOT_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        rt: Runtime | None = getattr(self.state, "runtime", None)
        peers = rt.peers if rt is not None else None
        if peers is not None and scope.get("path") == PEER_PATH and scope.get("method") == "POST":
            await peers.asgi(scope, receive, send)  # another replica's budget call: bare ASGI
            return
        if chat is None or scope.get("method") != "POST" or rt is None:
            await super().__call__(scope, receive, send)
            return
        try:
            response = await serve(rt, Request(scope, receive), chat)
        except Exception as exc:
            response = rt.internal_error(scope["path"], exc)
        await response(scope, receive, send)


def create_app(
    cfg: RouterConfig, source: EndpointSource, tokenizer: PromptTokenizer | None = None
) -> FastAPI:
    tok = tokenizer or PromptTokenizer(cfg.model_dir)
    holder: dict[str, Runtime] = {}
    # --lora: each adapter's files hashed now, so an unreadable one stops the start
    loras = adapters.declared(cfg.loras, (cfg.model_name, cfg.model_dir))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = Runtime(cfg, source, tok, loras)
        holder["rt"] = rt
        app.state.runtime = rt
        await rt.start()
        # --fast-lane: the compiled lane on the public socket (router/fast_lane.py)
        setup = getattr(app.state, "lane_setup", None)
        lane = app.state.lane = setup.start(rt) if setup is not None else None
        freeze_heap()
        try:
            yield
        finally:
            if lane is not None:
                lane.close()
            await rt.close()

    app = RouterApp(title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None)

    def rt() -> Runtime:
        return holder["rt"]

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return rt().error(exc)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return rt().internal_error(request.url.path, exc)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(rt(), request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(rt(), request, chat=True)

    @app.post("/v1/responses")
    async def responses_api(request: Request) -> Response:
        return await serve_responses(rt(), request)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        return await handle(rt(), request, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return await handle(rt(), request, detokenize)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        rt().check_auth(request)
        # "root" is the served name, never the model's directory: a local path is the
        # operator's business, not a tenant's.
        max_len = rt().discovery.snapshot().max_model_len or tok.config_max_len
        card = {
            "id": cfg.model_name,
            "object": "model",
            "created": rt().created,
            "owned_by": "pdserve",
            "root": cfg.model_name,
            "max_model_len": max_len,
        }
        return {
            "object": "list",
            "data": [card, *rt().loras.cards(cfg.model_name, rt().created)],
        }

    @app.get("/livez")
    async def livez() -> JSONResponse:
        # Liveness is the process itself: /health (readiness) is 503 while no decode worker
        # is ready, and failing liveness on that would restart the router, losing its index.
        return JSONResponse({"status": "alive"})

    @app.get("/health")
    async def health() -> JSONResponse:
        snap = rt().discovery.snapshot()
        if not snap.decode:
            return JSONResponse({"status": "no decode worker ready"}, status_code=503)
        if not rt().discovery.synced():  # a replica started late: prefix index catching up
            return JSONResponse({"status": "catching up on workers' KV events"}, status_code=503)
        # The workers' forwards (worker /health): how many are compiled, still compiling
        # in the background (eager meanwhile), or kept eager.
        compile_states = Counter(w.stats.compile or "unknown" for w in snap.workers if w.healthy)
        body = {"status": "ok", "prefill": len(snap.prefill), "decode": len(snap.decode)}
        body["compile"] = compile_summary(compile_states)
        return JSONResponse({**body, "workers_compile": dict(compile_states)})

    # With API keys on, /metrics and /workers are the operator's: an admin key opens them
    # (router/api_keys.py), a tenant's does not. /health and /livez stay open for probes.
    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        rt().require_admin(request)
        page, ports = rt().metrics.render(), cfg.proc_metrics_ports
        server = request.scope.get("server") or ("", 0)
        if ports and server[1] != ports[cfg.proc_index]:  # every process's series, labelled
            page = await metrics_merge.gather(cfg.proc_index, page, ports)
        return Response(page, media_type="text/plain; version=0.0.4")

    @app.get("/workers")
    async def workers(request: Request) -> dict[str, Any]:
        rt().require_admin(request)
        return {"workers": [_worker_json(w) for w in rt().discovery.snapshot().workers]}

    @app.post(PEER_PATH)
    async def budget_call() -> Response:
        """Another replica's budget call reaches this route only on a router without
        --budget-peers: with them ``RouterApp.__call__`` answers it first (``peers.asgi``)."""
        return JSONResponse({"error": "no --budget-peers here"}, status_code=404)

    add_lora_admin_routes(app, rt)
    return app


def compile_summary(states: Counter[str]) -> str:
    """One word for the cluster's forwards: the workers' state when they agree, else
    ``compiling`` while any still compiles, else ``mixed``."""
    if len(states) == 1:
        return next(iter(states))
    return "compiling" if states["compiling"] or states["ready"] else "mixed"


def freeze_heap() -> None:
    """Leave everything alive at start-up (the tokenizer, and torch through the engine's
    modules) out of the garbage collector's full passes: each one walked that whole heap,
    about 15% of the router's CPU per streamed token here (bench/stream_overhead.py)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


# Allocations between two young collections (Python's default: 700). Each request allocates
# hundreds of objects (its tasks, coroutines, messages) and a young collection walks every
# request in flight: at the default, the collector took ~7% of the router's CPU (perf, 64
# streams in flight). The garbage in cycles it frees just waits a little longer.
GC_YOUNG_THRESHOLD = 20_000


def _worker_json(w: Any) -> dict[str, Any]:
    return {
        "role": w.role,
        "url": w.url,
        "worker_id": w.worker_id,
        "healthy": w.healthy,
        "kv_blocks_free": w.stats.kv_blocks_free,
        "kv_blocks_total": w.stats.kv_blocks_total,
        "running": w.stats.running,
        "waiting": w.stats.waiting,
        "inflight": w.inflight,
    }
