"""One block's KV as bytes, and back, verified.

An entry is a fixed header and the block's raw elements::

    magic "PDKV" | version | dtype | 5 dims | key (32 B) | payload length | blake2b(payload)
    payload: [layers, planes, block_size, kv_heads, head_dim] elements, C order

``decode`` returns the tensor only if the entry is whole and is the one asked for: the key,
dtype and shape must be this pool's and this block's, the length and checksum the payload's.
Anything else (a truncated file, a flipped bit, another model's block) raises ``BadEntry``
and the block is recomputed, never used.
"""

from __future__ import annotations

import hashlib
import struct
import warnings

import torch

MAGIC = b"PDKV"
VERSION = 1
KEY_BYTES = 32  # 16 of namespace, 16 of block hash
_HEADER = struct.Struct("<4sBB5I32sQ16s")
HEADER_BYTES = _HEADER.size
DTYPES = {1: torch.float32, 2: torch.bfloat16, 3: torch.float16}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


class BadEntry(ValueError):
    """A stored entry that is not the block asked for, or not whole."""


def namespace(model_id: str, dtype: torch.dtype, dims: tuple[int, ...]) -> bytes:
    """16 bytes naming a model and KV layout: blocks of another never match."""
    text = f"{model_id}|{dtype}|{'x'.join(map(str, dims))}".encode()
    return hashlib.blake2b(text, digest_size=16, person=b"pdserve-kvtier").digest()


def block_key(ns: bytes, block_hash: int) -> bytes:
    return ns + block_hash.to_bytes(16, "little")


def encode(key: bytes, block: torch.Tensor) -> bytes:
    """``block`` (one block of the pool, any device) as an entry under ``key``."""
    assert len(key) == KEY_BYTES and block.dim() == 5
    cpu = block.detach().to("cpu").contiguous()
    payload = cpu.view(torch.uint8).numpy().tobytes()
    digest = hashlib.blake2b(payload, digest_size=16).digest()
    header = _HEADER.pack(
        MAGIC, VERSION, DTYPE_CODES[cpu.dtype], *cpu.shape, key, len(payload), digest
    )
    return header + payload


def decode(entry: bytes, key: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The block stored in ``entry``, checked against ``key``, ``dtype`` and ``shape``."""
    if len(entry) < HEADER_BYTES:
        raise BadEntry(f"entry of {len(entry)} bytes is shorter than its header")
    magic, version, code, *rest = _HEADER.unpack_from(entry)
    dims, got_key, length, digest = tuple(rest[:5]), rest[5], rest[6], rest[7]
    if magic != MAGIC or version != VERSION:
        raise BadEntry("not a pdserve KV entry of this version")
    if got_key != key:
        raise BadEntry("entry holds another block")
    if DTYPES.get(code) != dtype or dims != tuple(shape):
        raise BadEntry(f"entry is {DTYPES.get(code)} {dims}, the pool's blocks {dtype} {shape}")
    payload = memoryview(entry)[HEADER_BYTES:]
    if len(payload) != length or length != _nbytes(dtype, shape):
        raise BadEntry(f"entry payload is {len(payload)} bytes, header says {length}")
    if hashlib.blake2b(payload, digest_size=16).digest() != digest:
        raise BadEntry("entry checksum does not match its payload")
    with warnings.catch_warnings():  # read-only bytes: the caller copies them into the pool
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n
