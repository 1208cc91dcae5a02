"""The workers' flags: the engine's (engine/engine_args.py), the server's and each role's.

``pdserve prefill-worker`` takes ``FLAGS_PREFILL``, ``pdserve decode-worker``
``FLAGS_DECODE`` (pdserve/config_cli.py). The worker's front end builds its engine core's
:class:`~pdserve.worker.core.config.CoreConfig` from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve import env
from pdserve.config_cli import flag_group
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.kv_tiers.config import TierArgs
from pdserve.transfer.registry import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_TRANSFER_TIMEOUT,
    DEFAULT_TRANSPORT,
    TRANSPORT_NAMES,
)
from pdserve.worker.core.config import DEFAULT_STALL_S

flag_server = flag_group("server")
flag_prefill = flag_group("prefill")
flag_decode = flag_group("decode")
DEFAULT_PREFILL_TIMEOUT_S = 120.0  # a decode worker's wait for the prefill worker it calls


@dataclass(frozen=True)
class ServerArgs:
    """Where a worker listens, how peers reach it, and how its KV moves."""

    host: str = flag_server("127.0.0.1", "address to bind", short=True)
    port: int = flag_server(8100, "HTTP port", short=True)
    advertise_host: str | None = flag_server(
        None,
        "address peers use to reach this worker (default: --host, or the pod IP)",
        env=env.ADVERTISE_HOST,
    )
    side_channel_port: int | None = flag_server(
        None, "the KV side channel's port (default: port + 2)"
    )
    worker_id: str | None = flag_server(None, "the worker's name (default: ROLE-HOST-PORT)")
    kv_transport: str = flag_server(
        DEFAULT_TRANSPORT,
        "how KV moves between workers",
        short=True,
        choices=TRANSPORT_NAMES,
    )
    log_level: str = flag_server("info", "logging level")
    core_stall_timeout: float = flag_server(
        DEFAULT_STALL_S,
        "seconds the engine core may go without "
        "a word before /health calls it hung (it sends one every "
        "second)",
    )
    core_kill_timeout: float = flag_server(
        0.0,
        "seconds the engine core may stay silent before it is killed and the worker exits "
        "to be restarted (0: four times --core-stall-timeout)",
    )


@dataclass(frozen=True)
class DecodeServerArgs(ServerArgs):
    port: int = flag_server(8200, "HTTP port", short=True)


@dataclass(frozen=True)
class PrefillArgs:
    """A prefill worker's own."""

    kv_events_port: int | None = flag_prefill(
        None, "its KV events' ZeroMQ port (default: port + 1)"
    )
    lease_seconds: float = flag_prefill(
        DEFAULT_LEASE_SECONDS,
        "how long handed-off KV is held unclaimed, and once claimed (one clock, here)",
    )


@dataclass(frozen=True)
class DecodeArgs:
    """A decode worker's own."""

    kv_events_port: int | None = flag_decode(
        None, "its load reports' ZeroMQ port (default: port + 1)"
    )
    transfer_timeout: float = flag_decode(
        DEFAULT_TRANSFER_TIMEOUT, "seconds per KV load (claim, read, confirm)"
    )
    on_transfer_failure: str = flag_decode(
        "recompute",
        "recompute the prompt locally, or fail the request",
        choices=("recompute", "fail"),
    )
    prefill_timeout: float = flag_decode(
        DEFAULT_PREFILL_TIMEOUT_S,
        "seconds to wait for a prefill "
        "worker's reply when this worker calls it (the router's "
        "--pd-handoff decode); then the next one, or a local prefill",
    )


# Both roles take the KV tiers (docs/kv_tiers.md): a decode worker's prefix cache evicts too.
FLAGS_PREFILL = (EngineArgs, TierArgs, ServerArgs, PrefillArgs)
FLAGS_DECODE = (EngineArgs, TierArgs, DecodeServerArgs, DecodeArgs)
