"""The router's LoRA tests' fake workers: pdserve/testing/router_fakes.py's, plus the workers' LoRA
endpoints (worker/lora_api.py's bodies and errors) and ``loras`` / ``lora_known`` in
their ``/stats``; prefill KV events hashed under the request's adapter, as the engine does.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdserve.engine.lora_files import CONFIG_FILE, WEIGHTS_FILE, adapter_hash
from pdserve.protocol.codec import decode
from pdserve.protocol.contract import PrefillRequest
from pdserve.protocol.hashing import block_hashes, salt_root
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.testing.router_fakes import (
    BLOCK,
    Fakes,
    FakeState,
    _error,
    _stats,
    decode_app,
    prefill_app,
    serve,
    stored_event,
)
from tests.router.conftest import Cluster, start_cluster


def write_adapter(root: Path, name: str, seed: int = 0) -> Path:
    """A directory with the two files an adapter is hashed from (their bytes only: the
    router and these fakes never read the weights)."""
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": 4, "seed": seed}))
    (out / WEIGHTS_FILE).write_bytes(bytes(range(seed % 200, seed % 200 + 50)))
    return out


@dataclass
class LoraFake:
    """One fake worker's adapters: known (name → hash) and resident now."""

    known: dict[str, str] = field(default_factory=dict)
    resident: list[str] = field(default_factory=list)
    refuse: str = ""  # "" | "400": refuse every load (the engine found the adapter bad)
    hash_override: str = ""  # answer this hash (other files at the same path)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (endpoint, lora_name)


def add_lora(app: FastAPI, st: FakeState, lf: LoraFake) -> None:
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", "") != "/stats"]

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {**_stats(st), "loras": list(lf.resident), "lora_known": list(lf.known)}

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> Any:
        body = json.loads(await request.body())
        lf.calls.append(("load", body["lora_name"]))
        if lf.refuse == "400":
            err = _error(400, "adapter 'x': DoRA (use_dora) is not supported")
            return JSONResponse(
                {"error": {**json.loads(bytes(err.body))["error"], "param": "lora_path"}}, 400
            )
        try:
            digest = lf.hash_override or adapter_hash(body["lora_path"])
        except OSError:
            return JSONResponse(
                {"error": {"message": "lora_path is not a directory", "param": "lora_path"}}, 400
            )
        lf.known[body["lora_name"]] = digest
        return {"name": body["lora_name"], "hash": digest}

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> Any:
        name = json.loads(await request.body())["lora_name"]
        lf.calls.append(("unload", name))
        if lf.known.pop(name, None) is None:
            return JSONResponse(
                {
                    "error": {
                        "message": "not loaded",
                        "param": "lora_name",
                        "code": "lora_not_found",
                    }
                },
                404,
            )
        if name in lf.resident:
            lf.resident.remove(name)
        return {"name": name}


def keyed_prefill(app: FastAPI, st: FakeState, pub: zmq.asyncio.Socket) -> None:
    """Before the fake's own /prefill: publish the prompt's blocks hashed under its adapter
    and salt (the engine's keyed hashes), as a real prefill worker's KV events are."""

    @app.middleware("http")
    async def publish(request: Request, call_next: Any) -> Any:
        if request.url.path == "/prefill":
            body = decode(await request.body(), PrefillRequest)
            extra = body.lora.hash if body.lora is not None else None
            hashes = block_hashes(body.prompt_token_ids, BLOCK, salt_root(body.cache_salt, extra))
            await pub.send_multipart([b"kv", stored_event(st, hashes)])
        return await call_next(request)


@contextlib.asynccontextmanager
async def lora_cluster(
    tokenizer: PromptTokenizer, model_dir: Path, **kw: Any
) -> AsyncIterator[tuple[Cluster, list[LoraFake]]]:
    """A router before LoRA-aware fakes (the LoraFakes: prefill first, then decode); the
    router's ``loras`` (``--lora``) are known to every fake, as ``pdserve up`` passes them;
    ``kw``: ``start_cluster``'s (n_prefill, n_decode, the router's config)."""
    known = {n: adapter_hash(p) for n, p in kw.get("loras", ())}
    fakes: list[LoraFake] = []

    async def make(stack: contextlib.AsyncExitStack, n_prefill: int, n_decode: int) -> Fakes:
        ctx = zmq.asyncio.Context()
        stack.callback(ctx.term)  # last: after the servers and their sockets
        f = Fakes([], [], [], [])
        for role, n in (("prefill", n_prefill), ("decode", n_decode)):
            for i in range(n):
                st = FakeState(role, f"{role[0]}{i}")
                if role == "prefill":
                    pub = ctx.socket(zmq.PUB)
                    port = pub.bind_to_random_port("tcp://127.0.0.1")
                    st.kv_events = f"tcp://127.0.0.1:{port}"
                    stack.callback(pub.close, 0)
                    app = prefill_app(st, None)
                    keyed_prefill(app, st, pub)
                else:
                    app = decode_app(st)
                lf = LoraFake(dict(known))
                add_lora(app, st, lf)
                fakes.append(lf)
                getattr(f, role).append(st)
                getattr(f, f"{role}_urls").append(await stack.enter_async_context(serve(app)))
        return f

    # the protocol uvicorn picks (these tests ran on it before start_cluster served them)
    async with start_cluster(tokenizer, model_dir, http="auto", fakes=make, **kw) as cluster:
        yield cluster, fakes
