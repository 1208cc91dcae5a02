"""Checks before anything is read: a bad handle is refused with a clear error and no byte
moves. The handle's own checks are ``KVHandle.problem`` (one place, shared with the engine);
here: the block id lists of one load (engine thread, in ``start_load``) and what needs the
peer's pool (agent name, remote block range), after the handshake. Whether the lease is
still held is the prefill side's to say, when the decode side claims it."""

from __future__ import annotations

from pdserve.transfer.base import PeerInfo
from pdserve.transfer.messages import KVHandle


def check_local(
    handle: object,
    remote_ids: list[int],
    local_ids: list[int],
    transport: str,
    block_size: int,
    local_num_blocks: int,
) -> str:
    """An error message, or "" if the request may go to the peer."""
    if not isinstance(handle, KVHandle):
        return f"expected a KVHandle, got {type(handle).__name__}"
    err = handle.problem(transport, block_size, None)
    if err:
        return err
    if not remote_ids or len(remote_ids) != len(local_ids):
        return f"{len(remote_ids)} remote block ids for {len(local_ids)} local block ids"
    n = len(remote_ids)
    if list(remote_ids) != handle.block_ids[len(handle.block_ids) - n :]:
        return "remote block ids are not a suffix of the kv handle's block ids"
    bad = [b for b in local_ids if not 0 <= b < local_num_blocks]
    if bad:
        return f"local block ids {bad[:8]} out of range [0, {local_num_blocks})"
    if len(set(local_ids)) != n:
        return "local block ids repeat"
    return ""


def check_peer(handle: KVHandle, remote_ids: list[int], peer: PeerInfo) -> str:
    """An error message, or "" if ``remote_ids`` may be read from ``peer``."""
    if handle.agent_name != peer.agent_name:
        return (
            f"unknown agent {handle.agent_name!r}: the side channel {peer.side_channel} "
            f"serves agent {peer.agent_name!r}"
        )
    n = peer.geometry.num_blocks
    bad = [b for b in remote_ids if not 0 <= b < n]
    if bad:
        return f"remote block ids {bad[:8]} out of range of agent {peer.agent_name!r} [0, {n})"
    return ""
