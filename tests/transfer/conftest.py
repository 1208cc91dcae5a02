"""Fixtures of the KV transfer tests (helpers live in kv_helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kv_helpers import TRANSPORTS, Pair, make_pool

from pdserve.transfer.connector import RemoteKVConnector
from pdserve.transfer.messages import CompatRecord
from pdserve.transfer.server import KVServer


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pair(transport: str) -> Iterator[Pair]:
    src, dst = make_pool(24, seed=1), make_pool(20, seed=None)
    server = KVServer(src, CompatRecord.for_pool(src, "m"), transport=transport)
    conn = RemoteKVConnector(dst, CompatRecord.for_pool(dst, "m"), transport, transfer_timeout=3)
    yield Pair(server, conn, src, dst)
    assert conn.pending() == 0, "a load was never reported"
    conn.close()
    server.close()
