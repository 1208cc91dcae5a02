"""The block hash: one function shared by the workers' prefix caches and the router's index.

Block ``i`` of a prompt hashes its parent's hash together with its own token
ids, so equal hashes mean equal prefixes. Only full blocks are hashed. The
hash is a 64-bit blake2b digest, stable across processes, platforms and
Python's hash randomisation.

A cache salt (a tenant's, a request's ``cache_salt``) replaces the root of the
chain: salted prompts share no block hash with unsalted or differently salted
ones, so one tenant's prefix-cache hits (``cached_tokens``) reveal nothing about
another's prompts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH = 0


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little", signed=False))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little", signed=False)


def salt_root(salt: str | None) -> int:
    """The parent hash of a prompt's first block under ``salt`` (``ROOT_HASH`` without)."""
    if not salt:
        return ROOT_HASH
    digest = hashlib.blake2b(salt.encode("utf-8"), digest_size=8, person=b"pdserve-salt").digest()
    return int.from_bytes(digest, "little", signed=False) or 1  # never the unsalted root


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every full block of ``token_ids``."""
    assert block_size > 0
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out
