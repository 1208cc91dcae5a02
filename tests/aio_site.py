"""An aiohttp app served on a free loopback port, for tests that stand in for a peer
(a worker's /health, a router's /metrics)."""

from __future__ import annotations

from aiohttp import web


async def start_site(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on 127.0.0.1 at a port the system picks: its runner (``cleanup()``
    stops it) and its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
