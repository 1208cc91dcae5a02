"""The start-up probe's KV hand-off (worker/core/handoff_probe.py), on the worker cores
themselves (``build_core``, in this process: their real ``KVServer`` / ``RemoteKVConnector``
over NIXL, their ports) and the same ``probe`` their process runs before "ready"
(worker/core/main.py).

A prefill core's KV server serves its held probe blocks to an in-process reader; a decode
core's own connector reads seeded blocks from a loopback peer; the bytes are checked, and
nothing is left held, allocated or metered. A transport that fails refuses the start with
the exception's class and message. The failure is injected (NIXL cannot be made to fail
a read on demand): the transport class's ``start_read`` raises, everything around it is
real. Before the probe had a hand-off, these workers started.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine import startup_probe
from pdserve.testing.loopback import free_port
from pdserve.transfer.base import TransferError
from pdserve.worker.core import handoff_probe
from pdserve.worker.core.config import CoreConfig
from pdserve.worker.core.main import WorkerCore, build_core, probe
from tests.engine.engine_helpers import assert_all_free, tiny_config

pytestmark = pytest.mark.unit


@pytest.fixture(params=["prefill", "decode"])
def core(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[WorkerCore]:
    config = CoreConfig(
        role=request.param,
        engine=tiny_config(tiny_model_dir, num_blocks=64),
        host="127.0.0.1",
        port=free_port(),
        advertise_host="127.0.0.1",
        worker_id=f"probe-{request.param}",
        kv_transport="nixl",
        kv_events_port=free_port(),
        side_channel_port=free_port(),
    )
    made = build_core(config)
    try:
        yield made
    finally:
        made.close()


def _role(core: WorkerCore) -> str:
    return "prefill" if hasattr(core, "kv") else "decode"


def _transport_class(core: WorkerCore) -> type:
    """The class of the role's own transport (the prefill's reader is made of the same)."""
    role_side = getattr(core, "kv", None) or getattr(core, "remote")  # noqa: B009
    return type(role_side.transport)


def test_probe_runs_the_roles_hand_off(core: WorkerCore, monkeypatch: pytest.MonkeyPatch) -> None:
    role = _role(core)
    calls: list[str] = []
    for name in ("read_back", "load_loopback"):
        real = getattr(handoff_probe, name)

        def spy(*args: object, _real: object = real, _name: str = name) -> None:
            calls.append(_name)
            _real(*args)  # type: ignore[operator]

        monkeypatch.setattr(handoff_probe, name, spy)
    probe(core, role)
    assert calls == ["read_back" if role == "prefill" else "load_loopback"]
    assert_all_free(core.engine)
    # The probe's read is not a served transfer: the decode worker's metrics stay at 0.
    registry = core.metrics.registry  # type: ignore[attr-defined]
    labels = {"role": role, "transport": "nixl"}
    assert not registry.get_sample_value("pdserve_kv_transfer_bytes_total", labels)


def test_a_broken_transfer_refuses_the_start(
    core: WorkerCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise TransferError("injected: UCX endpoint closed")

    monkeypatch.setattr(_transport_class(core), "start_read", broken)
    with pytest.raises(startup_probe.ProbeFailed) as info:
        probe(core, _role(core))
    text = str(info.value)
    assert f"model {core.engine.served_model_name!r} refused at start" in text
    assert "TransferError: injected: UCX endpoint closed" in text
    assert_all_free(core.engine)


def test_wrong_bytes_refuse_the_start(core: WorkerCore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe compares bytes, not only the load's outcome: a read of the peer's next
    block (a real NIXL read, of the wrong block) refuses the start."""
    cls = _transport_class(core)
    start_read = cls.start_read

    def shifted(self: object, lease: object, peer: Any, remote: list[int], local: list[int]) -> Any:
        n = peer.geometry.num_blocks
        return start_read(self, lease, peer, [(b + 1) % n for b in remote], local)

    monkeypatch.setattr(cls, "start_read", shifted)
    with pytest.raises(startup_probe.ProbeFailed, match="HandOffFailed: KV hand-off: the blocks"):
        probe(core, _role(core))
    assert_all_free(core.engine)
