"""The block hash: one function shared by the workers' prefix caches and the router's index.

Block ``i`` of a prompt hashes its parent's hash together with its own token
ids, so equal hashes mean equal prefixes. Only full blocks are hashed. A prefix
cache hit compares only the hash, so the hash must not collide on purpose: it is
a 128-bit blake2b keyed with the service's key (``PDSERVE_BLOCK_HASH_KEY``, else
derived from the service secret: pdserve/keys.py). Without the key nobody can
search offline for a prompt whose blocks collide with another tenant's (at 64
bits and unkeyed, a birthday search is within reach; at 128 bits and keyed, it
cannot even start). Stable across processes, platforms and Python's hash
randomisation; the router and the workers of one service share the key.

The key does not follow the service secret's rotation: a router and a worker
that hashed one prompt differently would refuse each other's KV handles. The
operator keeps it in its own entry of the service's Secret, created once.

A cache salt (a tenant's, a request's ``cache_salt``) replaces the root of the
chain: salted prompts share no block hash with unsalted or differently salted
ones, so one tenant's prefix-cache hits (``cached_tokens``) reveal nothing about
another's prompts.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from pdserve import env, keys

log = logging.getLogger(__name__)

ROOT_HASH = 0
HASH_BYTES = 16  # 128 bits


def hash_key() -> bytes:
    """This service's block-hash key (b"": none configured, the hash is unkeyed).
    ``keys.derive`` keeps what it derived: two environment reads and a cache lookup."""
    explicit = os.environ.get(env.BLOCK_HASH_KEY)
    if explicit:
        return keys.derive(explicit, keys.BLOCK_HASH)
    secret = os.environ.get(env.SERVICE_SECRET)
    return keys.derive(secret, keys.BLOCK_HASH) if secret else b""


def hash_key_source() -> str:
    """Where ``hash_key()`` comes from: ``"hash-key"`` (the Secret's own entry),
    ``"secret"`` (a Secret from before that entry existed: derived from the service
    secret under the block-hash label), ``""`` (no secret: unkeyed)."""
    if os.environ.get(env.BLOCK_HASH_KEY):
        return "hash-key"
    return "secret" if os.environ.get(env.SERVICE_SECRET) else ""


@lru_cache(maxsize=1)
def note_key_source() -> str:
    """``hash_key_source()``, logged once a process where the Secret has no ``hash-key``:
    the keys still come from secret material (keyed, never a bare hash), but they follow
    ``secret`` and so change if it is rotated by hand; ``pdserve rotate-secret`` patches
    in a dedicated entry (the value these pods already use) before its first step."""
    source = hash_key_source()
    if source == "secret":
        log.warning(
            "the service Secret has no hash-key entry (made before it existed): the block "
            "hash and the API keys' cache salts are keyed from `secret` under their own "
            "labels, and change with it; `pdserve rotate-secret` adds a dedicated hash-key "
            "(rotating by hand would change every block hash mid-rollout)"
        )
    return source


@lru_cache(maxsize=8)
def _keyed(key: bytes) -> Any:
    # Keying blake2b costs a compression; copying a keyed state does not.
    return hashlib.blake2b(key=key, digest_size=HASH_BYTES, person=b"pdserve-block")


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    h = _keyed(hash_key()).copy()
    h.update(parent.to_bytes(HASH_BYTES, "little", signed=False))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little", signed=False)


def salt_root(salt: str | None, extra_key: str | None = None) -> int:
    """The parent hash of a prompt's first block under ``salt`` (``ROOT_HASH`` without).

    ``extra_key``: the LoRA adapter's hash (``LoraRef.hash``, engine/lora_files.py), so KV
    computed under one adapter is never reused under another or the base model. The
    router's prefix index and the workers pass the same one. Without it, the root is
    the salt's alone (unchanged)."""
    if not salt and not extra_key:
        return ROOT_HASH
    salted = (salt or "").encode("utf-8")
    if not extra_key:
        h = hashlib.blake2b(salted, key=hash_key(), digest_size=HASH_BYTES, person=b"pdserve-salt")
    else:  # the salt's length first: no (salt, key) pair reads as another
        h = hashlib.blake2b(key=hash_key(), digest_size=HASH_BYTES, person=b"pdserve-extra")
        h.update(len(salted).to_bytes(8, "little"))
        h.update(salted)
        h.update(extra_key.encode("utf-8"))
    return int.from_bytes(h.digest(), "little", signed=False) or 1  # never the unsalted root


def block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH, key: bytes | None = None
) -> list[int]:
    """Chained hashes of every full block of ``token_ids``. ``key``: ``hash_key()``, read
    once by a caller that hashes every request (the router; two environment reads a call)."""
    assert block_size > 0
    full = len(token_ids) // block_size * block_size
    raw = np.asarray(token_ids[:full], dtype=np.int64).tobytes()  # one conversion, not one a block
    keyed, step = _keyed(hash_key() if key is None else key), block_size * 8
    out: list[int] = []
    link = parent.to_bytes(HASH_BYTES, "little", signed=False)
    for start in range(0, len(raw), step):
        h = keyed.copy()
        h.update(link)
        h.update(raw[start : start + step])
        link = h.digest()
        out.append(int.from_bytes(link, "little", signed=False))
    return out
