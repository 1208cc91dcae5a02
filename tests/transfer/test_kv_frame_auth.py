"""KV data frames and side-channel keys (issue 24 item 7), on a real side channel on
loopback: a tcp data frame altered after the prefill side sent it is caught by its MAC
before a byte enters the decode pool (before the MAC, the altered bytes were written:
this test fails then); the side channel and the data frames use keys derived for them,
never the secret itself; and a rotating secret keeps KV moving."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from kv_helpers import load_with

from pdserve import keys
from pdserve.transfer.side_channel import mac
from pdserve.transfer.tcp_transport import TcpTransport, data_mac

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_a_tampered_tcp_data_frame_never_enters_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    serve = TcpTransport.serve

    def on_path_flip(self: TcpTransport, msg: object) -> list[Any] | None:
        frames = serve(self, msg)
        if frames is not None and len(frames) == 3:  # head, data, its MAC: alter the data
            data = np.array(frames[1], copy=True)
            data[len(data) // 2] ^= 0x01
            frames = [frames[0], data, frames[2]]
        return frames

    monkeypatch.setattr(TcpTransport, "serve", on_path_flip)
    res, wrote = load_with("tcp", "s", "s")
    assert not res.ok and "MAC does not check" in res.error, res.error
    assert not wrote, "altered KV bytes entered the decode pool"


def test_data_mac_binds_the_head_and_every_byte() -> None:
    key = keys.derive("s", keys.KV_DATA)
    data = np.arange(1000, dtype=np.uint8)
    tag = data_mac(key, b"head-a", data)
    assert tag != data_mac(key, b"head-b", data)  # another request's reply
    flipped = data.copy()
    flipped[-1] ^= 1
    assert tag != data_mac(key, b"head-a", flipped)
    assert tag != data_mac(keys.derive("s", keys.SIDE_CHANNEL), b"head-a", data)


def test_each_channel_has_its_own_key() -> None:
    """A tag from one channel proves nothing on another, and none is the secret's own."""
    derived = {p: keys.derive("s", p) for p in keys.PURPOSES}
    assert len(set(derived.values())) == len(keys.PURPOSES)
    assert b"s" not in derived.values()
    assert mac("s", b"x") == keys.mac(derived[keys.SIDE_CHANNEL], b"x")


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_rotation_keeps_kv_moving(transport: str) -> None:
    """Adjacent steps of a rotation, (old) -> (old, +new) -> (new, +old) -> (new), on the
    two sides, either way round."""
    steps = [("old",), ("old", "new"), ("new", "old"), ("new",)]
    pairs = list(itertools.pairwise(steps))
    for server_secret, decode_secret in pairs + [(b, a) for a, b in pairs]:
        res, wrote = load_with(transport, server_secret, decode_secret)
        assert res.ok and wrote, (server_secret, decode_secret, res.error)
    res, wrote = load_with(transport, ("old",), ("new",))  # what rotation must never produce
    assert not res.ok and not wrote
