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


def test_a_secret_without_hash_key_keys_the_salt_from_the_secret(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Secret from before ``hash-key`` existed (issue 44 item 14): its pods have the
    service secret and no PDSERVE_BLOCK_HASH_KEY (the entry is an optional secretKeyRef).
    The salt is keyed from the secret (not the SHA-256 of the API key), per service and
    key; the same as once ``pdserve rotate-secret`` patches the entry in (the old secret);
    and each process says once that rotate-secret would add a dedicated entry."""
    from pdserve.protocol import hashing

    hashing.note_key_source.cache_clear()
    caplog.set_level("WARNING")
    old = _salt(monkeypatch, "service-a", "tenant-1")
    assert old != "k:" + hashlib.sha256(b"tenant-1").hexdigest()[:32]
    assert old not in {
        _salt(monkeypatch, "service-b", "tenant-1"),
        _salt(monkeypatch, "service-a", "tenant-2"),
    }
    said = [r for r in caplog.records if "rotate-secret" in r.getMessage()]
    assert len(said) == 1 and "hash-key" in said[0].getMessage()
    monkeypatch.setenv(env.SERVICE_SECRET, "rotated")
    monkeypatch.setenv(env.BLOCK_HASH_KEY, "service-a")  # what rotate-secret patches in
    rt = SimpleNamespace(cfg=RouterConfig(model_dir="/m"), _salt_key=salt_key())
    assert Runtime.cache_salt(rt, "tenant-1", None) == old  # type: ignore[arg-type]
    hashing.note_key_source.cache_clear()


def test_without_any_secret_the_salt_is_still_keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    """No service secret at all (a bare local router): before, the salt fell back to the
    unkeyed SHA-256 of the API key; now a random key of the process keys it."""
    monkeypatch.delenv(env.SERVICE_SECRET, raising=False)
    monkeypatch.delenv(env.BLOCK_HASH_KEY, raising=False)
    salts = set()
    for _ in range(2):  # two router processes
        rt = SimpleNamespace(cfg=RouterConfig(model_dir="/m"), _salt_key=salt_key())
        salts.add(Runtime.cache_salt(rt, "tenant-1", None))  # type: ignore[arg-type]
    assert "k:" + hashlib.sha256(b"tenant-1").hexdigest()[:32] not in salts
    assert len(salts) == 2
