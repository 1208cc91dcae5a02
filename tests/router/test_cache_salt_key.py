"""An API key's prefix-cache salt is an HMAC under a key derived from the service's hash
key (issue 44 item 14): the salt travels in clear on every worker call, and the unkeyed
SHA-256 it was let anyone who saw one search a low-entropy API key offline."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from pdserve import env
from pdserve.router import runtime
from pdserve.router.config import RouterConfig
from pdserve.router.runtime import Runtime

pytestmark = pytest.mark.unit


def salt_key() -> bytes:
    make = getattr(runtime, "salt_key", None)  # absent before the fix: the test still runs
    return make() if make else b""


def _salt(monkeypatch: pytest.MonkeyPatch, secret: str, api_key: str) -> str:
    monkeypatch.setenv(env.SERVICE_SECRET, secret)
    monkeypatch.delenv(env.BLOCK_HASH_KEY, raising=False)
    rt = SimpleNamespace(cfg=RouterConfig(model_dir="/m"), _salt_key=salt_key())
    return str(Runtime.cache_salt(rt, api_key, None))  # type: ignore[arg-type]


def test_the_key_salt_is_keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    unkeyed = "k:" + hashlib.sha256(b"tenant-1").hexdigest()[:32]
    a = _salt(monkeypatch, "service-a", "tenant-1")
    assert a != unkeyed and a.startswith("k:") and len(a) == 34
    assert a == _salt(monkeypatch, "service-a", "tenant-1")  # every router replica agrees
    assert a != _salt(monkeypatch, "service-b", "tenant-1")
    assert a != _salt(monkeypatch, "service-a", "tenant-2")
