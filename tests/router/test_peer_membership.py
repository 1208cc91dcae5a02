"""A per-key cap through a change of the router replicas (issue 44; router/peer_budgets.py):
three real ``pdserve router`` processes on loopback, each reading its peer list from a
file (``--budget-peers @FILE``) that the test rewrites at run time, one replica at a time
and seconds apart, as a slow watch would see it, while requests of one key with a cap of 1
race through all three. The key moves to the replica that joins.

Before the hand-over (calls under another list refused, the new owner admitting nothing
until the old one, on the new list, hands its counts over) the new owner admitted the key
``ADOPT_WAIT_S`` after it saw the change while the old owner, on the old list, still
admitted it for the others: two in flight at the decode worker. Now never more than one;
the requests caught in the window get a 503 with Retry-After, and once every replica sees
the new list the key is served again."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.router.peer_budgets import budget_id, owner_of
from pdserve.testing.loopback import free_port, start_router, wait_healthy
from pdserve.testing.router_fakes import FakeState, decode_app, serve

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]
SKEW_S = 3.0  # the joiner sees the new list this long before the others (> ADOPT_WAIT_S)


class InFlight:
    """The decode fake's ``/generate`` calls at once, each from its arrival until its last
    line leaves (the router ends a request, and gives its count back, only after that):
    ``most`` is a lower bound of the key's requests admitted at once across replicas."""

    def __init__(self, app: Any) -> None:
        self.app, self.now, self.most = app, 0, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate":
            return await self.app(scope, receive, send)
        self.now += 1
        self.most = max(self.most, self.now)
        done = False

        async def last_line_leaves(message: Any) -> None:
            nonlocal done
            body = message.get("body", b"") if message["type"] == "http.response.body" else None
            if (
                body is not None
                and not done
                and (b'"length"' in body or not message.get("more_body"))
            ):
                done = True
                self.now -= 1
            await send(message)

        try:
            await self.app(scope, receive, last_line_leaves)
        finally:
            if not done:
                self.now -= 1


def _write(path: Path, urls: list[str]) -> None:
    """The peer file replaced whole (a new file renamed over it), as an operator would."""
    tmp = path.with_suffix(".new")
    tmp.write_text(",".join(urls) + "\n")
    os.replace(tmp, path)


def _moving_key(before: list[str], after: list[str], joiner: str) -> str:
    """A key that another replica owns over ``before`` and the joiner over ``after``."""
    return next(
        k
        for i in range(5000)
        if owner_of(budget_id(f"key:{(k := f'k{i}')}"), sorted(before)) != joiner
        and owner_of(budget_id(f"key:{k}"), sorted(after)) == joiner
    )


async def test_a_cap_of_one_holds_while_a_replica_joins(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    admins = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    joiner = admins[2]
    key = _moving_key(admins[:2], admins, joiner)
    (tmp_path / "keys").write_text(key + "\n")
    files = [tmp_path / f"peers{i}" for i in range(3)]
    for f in files:
        _write(f, admins[:2])
    dst = FakeState("decode", "d0", token_delay_s=0.05)
    fake = InFlight(decode_app(dst))
    async with serve(fake) as durl, httpx.AsyncClient(timeout=30) as h:
        ports = [free_port() for _ in range(3)]
        procs = [
            await start_router(
                *("--model", str(tiny_model_dir), "--served-model-name", "m"),
                *("--decode", durl, "--api-key-file", str(tmp_path / "keys")),
                *("--max-concurrency-per-key", "1"),
                *("--port", str(port), "--admin-port", admins[i].rsplit(":", 1)[1]),
                *("--budget-peers", f"@{files[i]}", "--budget-self", admins[i]),
            )
            for i, port in enumerate(ports)
        ]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        stop = asyncio.Event()
        got: list[tuple[float, int, int]] = []  # (when, via, status)

        async def race(via: int) -> None:
            body = {"model": "m", "prompt": "hi", "max_tokens": 6, "stream": True}
            auth = {"Authorization": f"Bearer {key}"}
            while not stop.is_set():
                async with h.stream(
                    "POST", urls[via] + "/v1/completions", json=body, headers=auth
                ) as r:
                    await r.aread()
                got.append((time.monotonic(), via, r.status_code))
                if r.status_code != 200:
                    await asyncio.sleep(0.02)

        try:
            for url in urls:
                await wait_healthy(h, url)
            tasks = [asyncio.create_task(race(i % 3)) for i in range(6)]
            await asyncio.sleep(1.0)  # the old list: the key's old owner serves it
            _write(files[2], admins)  # the joiner sees it first
            await asyncio.sleep(SKEW_S)
            _write(files[0], admins)
            await asyncio.sleep(0.5)
            _write(files[1], admins)
            agreed = time.monotonic()
            await asyncio.sleep(2.0)  # all on the new list: the joiner serves the key
            stop.set()
            await asyncio.gather(*tasks)
        finally:
            for proc in procs:
                proc.terminate()
            outs = [(await asyncio.wait_for(p.communicate(), 30))[0].decode() for p in procs]
        assert fake.most == 1, got
        statuses = {s for _, _, s in got}
        assert statuses <= {200, 429, 503}, got
        assert any(s == 503 for _, _, s in got), got  # some were caught in the window
        late = [s for t, _, s in got if t > agreed + 1.0]
        assert 200 in late, got  # served again once the replicas agree
        for out in outs:
            assert "Traceback" not in out, out
