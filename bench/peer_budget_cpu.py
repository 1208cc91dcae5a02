"""CPU per request of the per-key budget calls between router replicas (router/peer_budgets.py;
issue 47, issue 44 item 6), both ends together, in one process on loopback.

Two replicas' budget owners, each behind a real uvicorn server on loopback answering on the
router's bare-ASGI lane (``PeerBudgets.asgi``), as ``pdserve router`` does; one of them
makes ``--requests`` requests' budget calls in turn for one key the other owns (``remote``)
and for one it owns itself (``local``, no call), and the remote key's again
``CONCURRENT`` at a time (``remote_x16``: give-backs share calls); ``time.process_time``
over the whole process (caller, owner, the give-backs it waits for) divided by the
requests is the figure: CPU seconds, meaningful on a shared host where wall time is not.

The named baseline, ``calls``: the same requests made as the router made them before one
``acquire`` (issue 47): the requests bucket, the count in flight and the tokens bucket as
three calls whatever limits were set, each give-back its own call, on this transport.
``--old-module FILE`` (e.g. ``git show 1fc8093:router/peer_budgets.py > old.py``) adds
the old module as a second baseline (its aiohttp client and a FastAPI route).
``--before FILE`` (e.g. ``git show main:router/peer_budgets.py > before.py``) measures an
earlier module the way this one is (one ``acquire``, its bare-ASGI lane, its tokens call
or lease): ``now / before`` (the tpm lease: ``remote_cap_rpm_tpm_calls`` 2 → 1).

Last stdout line: JSON with CPU-µs per request for each (case, limits), the owner's
calls answered per request (``..._calls``), and the ratios
``now / calls`` (and ``now / old``).

    python bench/peer_budget_cpu.py --requests 500
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import time
from types import ModuleType
from typing import Any

os.environ.setdefault("PDSERVE_SERVICE_SECRET", "bench")

from fastapi import FastAPI, Request
from lib.output import emit

from pdserve import keys
from pdserve.router import peer_budgets
from pdserve.router.ratelimit import RateLimiter
from pdserve.testing.loopback import free_port
from pdserve.testing.peer_replicas import _app
from pdserve.testing.router_fakes import serve

CONCURRENT = 16  # requests of the key at once in the concurrent case


def _old_app(budgets: Any) -> FastAPI:
    app = FastAPI()

    @app.post(peer_budgets.PATH)
    async def call(request: Request) -> Any:
        return await budgets.handle(request)

    return app


async def _one(way: str, b: Any, client: str, tpm: bool) -> None:
    if way in ("now", "before"):
        await b.acquire(client)
        if tpm:
            await b.take_tokens(client, 10)
    else:  # the calls before one acquire: three, whatever the limits
        await b.take_request(client)
        await b.enter(client)
        await b.take_tokens(client, 10)
    b.leave(client)


async def _measure(way: str, pb: ModuleType, n: int) -> dict[str, float]:
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    ring = keys.KeyRing(keys.ROUTER_PEER, "bench")
    budgets = [pb.PeerBudgets(u, urls, RateLimiter(10**9, 10**12), 64, ring) for u in urls]
    out: dict[str, float] = {}
    async with contextlib.AsyncExitStack() as stack:
        for b, url in zip(budgets, urls, strict=True):
            app = _old_app(b) if way == "old" else _app(b)
            await stack.enter_async_context(serve(app, int(url.rsplit(":", 1)[1])))
        me, peers = budgets[0], sorted(urls)

        def key(local: bool) -> str:
            return next(
                c
                for i in range(1000)
                if (pb.owner_of(pb.budget_id(c := f"key:{i}"), peers) == me.self_url) == local
            )

        owner = budgets[1]
        calls = [0]
        answer = owner.answer

        async def counted(*a: Any) -> Any:
            calls[0] += 1
            return await answer(*a)

        owner.answer = counted
        cases = [("remote", key(False), 1), ("local", key(True), 1)]
        cases.append((f"remote_x{CONCURRENT}", key(False), CONCURRENT))
        for case, client, together in cases:
            for tpm in (False, True):
                for _ in range(30):  # connections open, code warm
                    await _one(way, me, client, tpm)
                while me._tasks:
                    await asyncio.sleep(0.001)
                start, calls[0] = time.process_time(), 0

                async def run(k: int, client: str = client, tpm: bool = tpm) -> None:
                    for _ in range(k):
                        await _one(way, me, client, tpm)

                await asyncio.gather(*(run(n // together) for _ in range(together)))
                while me._tasks:
                    await asyncio.sleep(0.001)
                done = n // together * together
                limits = "cap_rpm_tpm" if tpm else "cap_rpm"
                out[f"{case}_{limits}"] = round((time.process_time() - start) / done * 1e6, 1)
                out[f"{case}_{limits}_calls"] = round(calls[0] / done, 2)
        for b in budgets:
            await b.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--old-module", default="", help="an older router/peer_budgets.py")
    ap.add_argument(
        "--before", default="", help="an earlier router/peer_budgets.py, measured as now"
    )
    args = ap.parse_args()
    if args.requests < 1:
        ap.error("--requests: at least 1")
    ways: dict[str, ModuleType] = {"now": peer_budgets, "calls": peer_budgets}
    for way, flag, path in (
        ("old", "--old-module", args.old_module),
        ("before", "--before", args.before),
    ):
        if not path:
            continue
        spec = importlib.util.spec_from_file_location(f"{way}_peer_budgets", path)
        if spec is None or spec.loader is None:
            ap.error(f"{flag}: cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ways[way] = module
    us = {way: asyncio.run(_measure(way, pb, args.requests)) for way, pb in ways.items()}
    ratios = {
        f"now_over_{base}": {k: round(us["now"][k] / v, 3) for k, v in us[base].items() if v}
        for base in ways
        if base != "now"
    }
    load = os.getloadavg()[0]
    emit(
        {
            "bench": "peer_budget_cpu",
            "cpu_us_per_request": us,
            "ratios": ratios,
            "requests": args.requests,
            "loadavg_1m": round(load, 2),
            "baseline": "calls",
        }
    )


if __name__ == "__main__":
    main()
