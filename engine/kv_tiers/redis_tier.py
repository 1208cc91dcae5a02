"""The shared tier: a Redis (or Valkey) server that every worker of a service reads.

A blob store: ``SET key entry`` and ``GET key``, with keys ``pdkv:`` + the block key's hex.
The server bounds itself (``maxmemory`` with ``allkeys-lru``: the operator's Deployment and
the tests start it so), so this client never trims. Writes use ``NX``: a block another
worker wrote already is not sent again. Every call has a socket timeout, so a slow or
dead server costs a load its deadline at most (then the block is recomputed). The client
is redis-py's, one connection pool shared by the store's threads.
"""

from __future__ import annotations

import redis

from pdserve.engine.kv_tiers.base import Tier

PREFIX = b"pdkv:"


class RedisTier(Tier):
    name = "shared"
    local = False  # ``contains`` is a round trip: the engine thread never calls it

    def __init__(
        self,
        url: str,
        password: str | None = None,
        timeout_s: float = 1.0,
        ttl_s: int | None = None,
    ) -> None:
        super().__init__()
        self.url = url
        self.ttl_s = ttl_s
        self.client = redis.Redis.from_url(
            url,
            password=password or None,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=30,
        )

    @staticmethod
    def _name(key: bytes) -> bytes:
        return PREFIX + key.hex().encode()

    def put(self, key: bytes, value: bytes) -> bool:
        self.client.set(self._name(key), value, nx=True, ex=self.ttl_s)
        return True

    def get(self, key: bytes) -> bytes | None:
        value = self.client.get(self._name(key))
        return value if isinstance(value, bytes) else None

    def contains(self, key: bytes) -> bool:
        return bool(self.client.exists(self._name(key)))

    def delete(self, key: bytes) -> None:
        self.client.delete(self._name(key))

    def close(self) -> None:
        self.client.close()
