"""``pdserve up --kv-shared``'s store (local/kv_store.py): ``local`` starts a redis-server
with a password the workers inherit and ``stop`` ends it; a URL is pinged before anything
starts; a bad value or an unreachable store is refused by name."""

from __future__ import annotations

import os

import pytest
import redis

from pdserve import env
from pdserve.engine.kv_tiers.redis_server import free_port, start_redis
from pdserve.local import kv_store

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bad", ["redis", "http://127.0.0.1:6379", "locale"])
def test_a_bad_value_is_refused_by_name(bad: str) -> None:
    with pytest.raises(SystemExit, match="--kv-shared"):
        kv_store.check(bad)


def test_local_starts_a_server_with_a_password_and_stops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(env.KV_SHARED_PASSWORD, "")  # undone after: open_store sets it
    store = kv_store.open_store("local", "16mb")
    assert store is not None and store.server is not None
    password = os.environ[env.KV_SHARED_PASSWORD]
    assert store.worker_args() == ("--kv-tier-shared-url", store.url)
    with pytest.raises(redis.AuthenticationError):  # no password: refused
        redis.Redis.from_url(store.url, socket_timeout=2).ping()
    assert redis.Redis.from_url(store.url, password=password, socket_timeout=2).ping()
    proc = store.server.proc  # type: ignore[attr-defined]
    store.stop()
    assert proc.poll() is not None


def test_a_url_is_pinged_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.KV_SHARED_PASSWORD, raising=False)
    with pytest.raises(SystemExit, match="--kv-shared redis://"):
        kv_store.open_store(f"redis://127.0.0.1:{free_port()}/0", "16mb")
    server = start_redis(password="pw")
    try:
        with pytest.raises(SystemExit, match="--kv-shared"):  # the password is missing
            kv_store.open_store(server.url, "16mb")
        monkeypatch.setenv(env.KV_SHARED_PASSWORD, "pw")
        store = kv_store.open_store(server.url, "16mb")
        assert store is not None and store.server is None and store.url == server.url
        store.stop()  # not ours: left running
        assert server.proc.poll() is None
    finally:
        server.stop()
