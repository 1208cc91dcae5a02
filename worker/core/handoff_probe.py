"""The start-up probe's KV hand-off (engine/startup_probe.py's ``transfer``): the role's
own transfer path, run once before the worker says it is ready, with its bytes checked.

- **prefill**: the probe's prefill is held in the worker's own ``KVServer`` (its
  transport, its side channel, its service secret); an in-process reader (a
  ``RemoteKVConnector`` on a scratch pool of that many blocks, its own agent) does what a
  decode worker does: handshake, lease claim, READ, done. The scratch bytes must equal
  the held blocks' bytes in the pool, and the done ends the lease.
- **decode**: a loopback peer (a ``KVServer`` of its own agent, on a scratch pool of
  ``PROBE_BLOCKS`` blocks of seeded bytes) holds them under a lease; the worker's own
  connector reads them into free blocks of the worker's pool, as a request's hand-off
  does. The pool's bytes must equal the scratch's; the blocks are zeroed and freed.

A load that fails (handshake, claim, read, done, timeout) or bytes that differ raise
``HandOffFailed`` with the connector's error (which names the transport exception's
class and message); the probe turns it into the refusal that names the model.
Cost: one more agent and side channel for a few milliseconds (docs/workers.md).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pdserve.engine.kv_connector import LoadResult
from pdserve.engine.llm_engine import LLMEngine
from pdserve.transfer.connector import RemoteKVConnector
from pdserve.transfer.messages import KVHandle
from pdserve.transfer.server import KVServer

PROBE_BLOCKS = 2
READ_TIMEOUT_S = 5.0  # the prefill probe's reader: a loopback read takes milliseconds
BLOCK_DIM = 2  # the pool tensor's block dimension (engine/kv_pool.py)


class HandOffFailed(RuntimeError):
    """The start-up probe's KV hand-off failed or moved the wrong bytes."""


def _scratch(pool: torch.Tensor, num_blocks: int) -> torch.Tensor:
    shape = list(pool.shape)
    shape[BLOCK_DIM] = num_blocks
    return torch.zeros(shape, dtype=pool.dtype, device=pool.device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _load(conn: RemoteKVConnector, handle: KVHandle, remote: list[int], local: list[int]) -> None:
    """One load through ``conn``, waited for; raises unless it succeeded."""
    rid = handle.request_id
    conn.start_load(rid, handle, remote, local)
    deadline = time.monotonic() + conn.transfer_timeout + 1.0
    results: list[LoadResult] = []
    while not results:
        if time.monotonic() > deadline:
            raise HandOffFailed(f"KV read {rid} never reported a result")
        results = conn.poll()
        if not results:
            time.sleep(0.0005)
    (result,) = results
    if not result.ok:
        raise HandOffFailed(f"KV hand-off over {conn.transport_name}: {result.error}")


def _check_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(_bytes(got), _bytes(want)):
        raise HandOffFailed(f"KV hand-off: {what} differ from the bytes held")


def read_back(server: KVServer, engine: LLMEngine, handles: list[Any]) -> None:
    """Prefill: read each held probe handle from ``server`` through an in-process reader."""
    if not handles:
        raise HandOffFailed("the probe's prefill handed off no KV")
    pool = engine.kv_tensor
    for handle in handles:
        assert isinstance(handle, KVHandle)
        ids = list(handle.block_ids)
        scratch = _scratch(pool, len(ids))
        reader = RemoteKVConnector(
            scratch,
            server.compat,
            server.transport_name,
            transfer_timeout=READ_TIMEOUT_S,
            secret=server.secret,
        )
        try:
            _load(reader, handle, ids, list(range(len(ids))))
        finally:
            reader.close()
        _check_equal(scratch, pool[:, :, ids], "the blocks read back")


def load_loopback(conn: RemoteKVConnector, engine: LLMEngine) -> None:
    """Decode: read ``PROBE_BLOCKS`` seeded blocks from a loopback peer through ``conn``."""
    pool = engine.kv_tensor
    scratch = _scratch(pool, PROBE_BLOCKS)
    seeded = torch.Generator().manual_seed(48)
    _bytes(scratch).copy_(torch.randint(0, 256, _bytes(scratch).shape, generator=seeded))
    compat = conn.compat
    blocks = engine.kv.block_manager
    local = blocks.allocate([], PROBE_BLOCKS * engine.kv.block_size).block_ids
    try:
        server = KVServer(scratch, compat, conn.transport_name, secret=conn.secret)
        try:
            ids = list(range(PROBE_BLOCKS))
            tokens = len(ids) * compat.block_size
            handle = server.make_handle("pdserve-probe-handoff", ids, tokens, [])
            _load(conn, handle, ids, local)
        finally:
            server.close()
        _check_equal(pool[:, :, local], scratch, "the blocks loaded")
    finally:
        pool[:, :, local] = 0
        blocks.free(local)
