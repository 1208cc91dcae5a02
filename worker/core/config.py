"""What a worker's engine core is started with: one frozen dataclass, not the flags.

The front end parses its flags and sends this, pickled, in the core's ``init`` message
(worker/core/client.py → worker/core/main.py). Every field is plain data, so it pickles
and compares; the engine's part carries ``--model`` as given, and the core resolves it
(a GGUF file is converted there, where torch is loaded anyway: engine/model_source.py).
Derived values are properties; nothing the core discovers is written back.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_args import engine_config_from_args
from pdserve.transfer.registry import DEFAULT_LEASE_SECONDS, DEFAULT_TRANSFER_TIMEOUT

ROLES = ("prefill", "decode")
DEFAULT_STALL_S = 30.0  # a core silent this long is hung (it sends a heartbeat every second)
HUNG_KILL_FACTOR = 4  # silent this many stall timeouts (by default): killed, so it restarts


@dataclass(frozen=True)
class CoreConfig:
    role: str  # prefill | decode
    engine: EngineConfig  # its model unresolved: see ``engine_config``
    host: str  # address the core's own sockets bind (KV events, side channel)
    port: int  # the worker's HTTP port: the default of the ports below derives from it
    advertise_host: str  # the address peers reach this worker at
    worker_id: str
    kv_transport: str  # the transfer registry's key: nixl | tcp
    kv_events_port: int | None = None  # default: port + 1
    side_channel_port: int | None = None  # prefill; default: port + 2
    lease_seconds: float = DEFAULT_LEASE_SECONDS  # prefill: how long handed-off KV is held
    transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT  # decode: seconds per KV load
    recompute_on_load_failure: bool = True  # decode: else a failed load fails the request
    log_level: str = "info"
    core_stall_timeout: float = DEFAULT_STALL_S  # the front end's: silent this long is hung
    core_kill_timeout: float = 0.0  # silent this long: killed (0: HUNG_KILL_FACTOR x the above)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {self.role!r}")
        if self.lease_seconds <= 0 or self.transfer_timeout <= 0:
            raise ValueError("lease_seconds and transfer_timeout must be positive")
        if self.core_stall_timeout <= 0:
            raise ValueError("core_stall_timeout must be positive")
        if self.core_kill_timeout and self.core_kill_timeout < self.core_stall_timeout:
            raise ValueError(
                f"core_kill_timeout ({self.core_kill_timeout:g}) must be 0 (the default) or at "
                f"least core_stall_timeout ({self.core_stall_timeout:g})"
            )

    @property
    def kill_after_s(self) -> float:
        """Seconds of silence after which the front end kills its hung core."""
        return self.core_kill_timeout or HUNG_KILL_FACTOR * self.core_stall_timeout

    @property
    def events_port(self) -> int:
        return self.kv_events_port or self.port + 1

    @property
    def side_channel(self) -> int:
        return self.side_channel_port or self.port + 2

    def engine_config(self) -> EngineConfig:
        """The engine's config with ``--model`` resolved to an HF directory (in the core:
        this may convert a GGUF file, which loads torch)."""
        from pdserve.engine.model_source import resolved

        return resolved(self.engine)

    @classmethod
    def from_args(
        cls, role: str, args: argparse.Namespace, advertise_host: str, worker_id: str
    ) -> CoreConfig:
        """From a worker's parsed flags (worker/http.py ``add_worker_arguments`` and the
        role's own); the host and id as the front end resolved them."""
        return cls(
            role=role,
            engine=engine_config_from_args(args, resolve=False, background=True),
            host=args.host,
            port=args.port,
            advertise_host=advertise_host,
            worker_id=worker_id,
            kv_transport=args.kv_transport,
            kv_events_port=getattr(args, "kv_events_port", None),
            side_channel_port=getattr(args, "side_channel_port", None),
            lease_seconds=getattr(args, "lease_seconds", DEFAULT_LEASE_SECONDS),
            transfer_timeout=getattr(args, "transfer_timeout", DEFAULT_TRANSFER_TIMEOUT),
            recompute_on_load_failure=getattr(args, "on_transfer_failure", "recompute")
            == "recompute",
            log_level=args.log_level,
            core_stall_timeout=getattr(args, "core_stall_timeout", DEFAULT_STALL_S),
            core_kill_timeout=getattr(args, "core_kill_timeout", 0.0),
        )
