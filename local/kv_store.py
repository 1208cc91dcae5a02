"""``pdserve up --kv-shared``: the store of the shared KV tier for a local service.

``local`` starts Debian's redis-server (engine/kv_tiers/redis_server.py) on loopback with a
fresh password, handed to the workers in ``$PDSERVE_KV_SHARED_PASSWORD``; it is stopped
when ``up`` stops (and sent SIGTERM by the kernel if ``up`` is killed hard). A
``redis://`` URL names a running store, pinged once before any worker starts so a wrong
address or password is refused at once. Either way every worker (prefill and decode) gets
``--kv-tier-shared-url``: a prefix one worker evicted is a tier hit on every other.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

from pdserve import env

LOCAL = "local"


@dataclass
class SharedStore:
    url: str
    server: object | None = None  # the LocalRedis this process started, if any

    def worker_args(self) -> tuple[str, ...]:
        return ("--kv-tier-shared-url", self.url)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()  # type: ignore[attr-defined]
            self.server = None


def check(value: str) -> None:
    """Refuse a bad ``--kv-shared`` by name (before anything starts)."""
    if not value or value == LOCAL:
        return
    from pdserve.engine.kv_tiers.config import TierConfig

    try:
        TierConfig(shared_url=value)
    except ValueError:
        raise SystemExit(
            f"pdserve up: --kv-shared must be {LOCAL!r} or a redis://HOST:PORT/DB URL, "
            f"got {value!r}"
        ) from None


def open_store(value: str, maxmemory: str) -> SharedStore | None:
    """The shared store ``--kv-shared`` asks for (None: no shared tier)."""
    if not value:
        return None
    from pdserve.engine.kv_tiers import redis_server

    if value != LOCAL:
        _ping(value)
        return SharedStore(value)
    password = secrets.token_hex(16)
    try:
        server = redis_server.start_redis(
            maxmemory=maxmemory, password=password, die_with_parent=True
        )
    except RuntimeError as exc:  # no binary, or it did not start
        raise SystemExit(f"pdserve up: --kv-shared local: {exc}") from None
    os.environ[env.KV_SHARED_PASSWORD] = password  # every worker started from here reads it
    print(
        f"pdserve up: shared KV tier: redis-server (pid {server.proc.pid}) at {server.url}, "
        f"maxmemory {maxmemory}",
        flush=True,
    )
    return SharedStore(server.url, server)


def _ping(url: str) -> None:
    import redis

    client = redis.Redis.from_url(
        url, password=env.get(env.KV_SHARED_PASSWORD) or None, socket_timeout=5
    )
    try:
        client.ping()
    except redis.RedisError as exc:
        raise SystemExit(f"pdserve up: --kv-shared {url}: {exc}") from None
    finally:
        client.close()
