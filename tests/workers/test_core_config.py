"""The engine core is started with a typed, frozen CoreConfig (worker/core/config.py), not
the front end's argparse.Namespace: built from each role's real flags, pickled as the
``init`` message carries it, with derived ports as properties and bad values refused."""

from __future__ import annotations

import argparse
import pickle
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest

from pdserve.decode_worker import server as decode_server
from pdserve.prefill_worker import server as prefill_server
from pdserve.worker.core.config import CoreConfig
from pdserve.worker.http import core_config

pytestmark = pytest.mark.unit


def _args(role: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    (decode_server if role == "decode" else prefill_server).add_arguments(parser)
    return parser.parse_args(["--model", "tiny", "--host", "127.0.0.1", *argv])


def test_each_role_s_flags_become_a_frozen_config_that_pickles() -> None:
    flags = ["--port", "8200", "--on-transfer-failure", "fail", "--transfer-timeout", "4"]
    d = core_config("decode", _args("decode", *flags, "--kv-transport", "tcp"))
    assert d.role == "decode" and d.port == 8200 and d.kv_transport == "tcp"
    assert not d.recompute_on_load_failure and d.transfer_timeout == 4.0
    assert d.events_port == 8201 and d.worker_id == "decode-127.0.0.1-8200"
    flags = ["--port", "8100", "--lease-seconds", "7", "--kv-events-port", "9000"]
    p = core_config("prefill", _args("prefill", *flags, "--worker-id", "p0"))
    assert p.lease_seconds == 7.0 and p.events_port == 9000 and p.side_channel == 8102
    assert p.worker_id == "p0" and p.advertise_host == "127.0.0.1"
    for config in (d, p):
        assert not isinstance(config, argparse.Namespace)
        kind, back = pickle.loads(pickle.dumps(("init", config)))  # as core_main reads it
        assert kind == "init" and back == config and isinstance(back, CoreConfig)
        assert config.engine.model == "tiny"  # as given: the core resolves it
        with pytest.raises(FrozenInstanceError):
            config.port = 1  # type: ignore[misc]


def test_the_core_resolves_the_model(tiny_model_dir: Path) -> None:
    config = core_config("decode", _args("decode"))
    as_dir = replace(config, engine=replace(config.engine, model=str(tiny_model_dir)))
    assert as_dir.engine_config().model == str(tiny_model_dir)  # a directory stays itself


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"role": "router"}, "role must be one of"),
        ({"lease_seconds": 0.0}, "lease_seconds"),
        ({"transfer_timeout": -1.0}, "transfer_timeout"),
        ({"core_stall_timeout": 0.0}, "core_stall_timeout"),
        ({"core_kill_timeout": 2.0}, "core_kill_timeout"),  # killed before it is called hung
        ({"core_kill_timeout": -1.0}, "core_kill_timeout"),
    ],
)
def test_bad_values_are_refused_by_name(change: dict[str, object], message: str) -> None:
    config = core_config("prefill", _args("prefill"))
    with pytest.raises(ValueError, match=message):
        replace(config, **change)  # type: ignore[arg-type]


def test_a_hung_core_is_killed_after_four_stall_timeouts_unless_told() -> None:
    config = core_config("decode", _args("decode"))
    assert config.kill_after_s == 4 * config.core_stall_timeout == 120.0
    flags = ("--core-stall-timeout", "4", "--core-kill-timeout", "6")
    short = core_config("decode", _args("decode", *flags))
    assert (short.core_stall_timeout, short.kill_after_s) == (4.0, 6.0)
    assert replace(config, core_stall_timeout=4.0).kill_after_s == 16.0
