"""Keys derived from the service secret, one per use, so that no two channels share one.

The service secret (``PDSERVE_SERVICE_SECRET``, the per-LLMService Secret) is never sent
anywhere: each use derives its own key from it (HMAC-SHA256 of a purpose label, the
extract-less form of HKDF for a secret that is already uniformly random), and a key
that leaks from one channel (a log of the KV data path, say) proves nothing on another.

Rotation: ``PDSERVE_SERVICE_SECRET_ACCEPTED`` names a second secret that is accepted but
never used to sign. Rotating is three rollouts: the new secret accepted, then signing
with it (the old one accepted), then the old one dropped; at no step does a pod sign
with a secret another pod cannot check (docs/security.md: rotating the secret).

Stdlib only: the router, the workers and the engine's import path all use it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from functools import lru_cache

from pdserve import env

# Purposes: each is one channel or one store.
HTTP = "http"  # router -> worker calls and the workers' replies
SIDE_CHANNEL = "side-channel"  # the KV side channel's requests and replies
KV_DATA = "kv-data"  # tcp KV data frames
COMPILE_CACHE = "compile-cache"  # compiled code in a shared model cache
BLOCK_HASH = "block-hash"  # the prefix cache's keyed block hash (see hashing.py)
PREFILL_PIN = "prefill-pin"  # the endpoint picker's x-prefiller-host-port signature
ROUTER_PEER = "router-peer"  # router replicas' budget calls (router/peer_budgets.py)
PURPOSES = (HTTP, SIDE_CHANNEL, KV_DATA, COMPILE_CACHE, BLOCK_HASH, PREFILL_PIN, ROUTER_PEER)


@lru_cache(maxsize=64)
def derive(secret: str, purpose: str) -> bytes:
    """The 32-byte key for ``purpose`` under ``secret`` (b"" without a secret)."""
    assert purpose in PURPOSES, purpose
    if not secret:
        return b""
    label = f"pdserve/v1/{purpose}".encode()
    return hmac.new(secret.encode(), label, hashlib.sha256).digest()


def secrets_from_env() -> tuple[str, ...]:
    """(signing, accepted) service secrets set in the environment; () without one."""
    current = os.environ.get(env.SERVICE_SECRET, "")
    accepted = os.environ.get(env.SERVICE_SECRET_ACCEPTED, "")
    if not current:
        return ()
    return (current, accepted) if accepted and accepted != current else (current,)


class KeyRing:
    """The keys of one purpose: the first signs, every one verifies (rotation)."""

    def __init__(self, purpose: str, secrets: tuple[str, ...] | list[str] | str) -> None:
        if isinstance(secrets, str):
            secrets = (secrets,) if secrets else ()
        self.purpose = purpose
        self.keys = tuple(derive(s, purpose) for s in secrets if s)

    @classmethod
    def from_env(cls, purpose: str) -> KeyRing:
        return cls(purpose, secrets_from_env())

    def __bool__(self) -> bool:
        return bool(self.keys)

    @property
    def signing(self) -> bytes:
        return self.keys[0] if self.keys else b""

    def sign(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 of ``parts`` (length-prefixed) under the signing key; b"" without."""
        return mac(self.signing, *parts)

    def verify(self, tag: bytes, *parts: bytes, head: tuple[str, ...] = ()) -> bytes | None:
        """The key that made ``tag`` over ``head`` and ``parts`` (``mac_after``; None: none
        did). Without keys every tag passes (an unauthenticated local deployment) and b""
        is returned."""
        if not self.keys:
            return b""
        for key in self.keys:
            if hmac.compare_digest(tag, mac_after(key, head, *parts)):
                return key
        return None


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed (no two splits of one byte string
    give the same tag); b"" without a key."""
    if not key:
        return b""
    return _keyed(key).digest(_framed(parts))


def mac_after(key: bytes, head: tuple[str, ...], *parts: bytes) -> bytes:
    """``mac(key, *head encoded, *parts)``, the hashing of ``head`` kept per key and head:
    a worker call's version, method and path, or a proof's label, are the same on every
    call (the router signs two calls and checks two proofs per P/D request)."""
    if not key:
        return b""
    return _keyed_head(key, head).digest(_framed(parts))


def _framed(parts: tuple[bytes, ...]) -> bytes:
    return b"".join([len(part).to_bytes(8, "big") + part for part in parts])


class _Pads:
    """HMAC-SHA256 (RFC 2104) under one key, its two padded-key blocks hashed once: a tag
    is two copies, two updates and two digests of hashlib's C objects. (``hmac.new`` keys
    them again on every call; copying an ``hmac.HMAC`` goes through its Python wrapper,
    ~2 µs a tag, and the router signs two calls and checks two proofs per P/D request.)
    ``prefix``: bytes every message under it starts with, hashed once too."""

    __slots__ = ("inner", "outer")
    BLOCK = 64  # SHA-256's block size

    def __init__(self, key: bytes, prefix: bytes = b"") -> None:
        if len(key) > self.BLOCK:
            key = hashlib.sha256(key).digest()
        key = key.ljust(self.BLOCK, b"\0")
        self.inner = hashlib.sha256(bytes(b ^ 0x36 for b in key) + prefix)
        self.outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def digest(self, message: bytes) -> bytes:
        inner = self.inner.copy()
        inner.update(message)
        outer = self.outer.copy()
        outer.update(inner.digest())
        return outer.digest()


@lru_cache(maxsize=256)
def _keyed_head(key: bytes, head: tuple[str, ...]) -> _Pads:
    return _Pads(key, _framed(tuple(p.encode() for p in head)))


@lru_cache(maxsize=64)
def _keyed(key: bytes) -> _Pads:
    return _Pads(key)
