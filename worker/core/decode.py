"""The decode worker's engine core (its own process, worker/core/main.py): the engine
and the KV connector that pulls prompts' blocks from prefill workers into its pool."""

from __future__ import annotations

from typing import Any

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora_registry import lora_queries
from pdserve.transfer.connector import RemoteKVConnector
from pdserve.transfer.messages import CompatRecord
from pdserve.worker.core import handoff_probe
from pdserve.worker.core.config import CoreConfig
from pdserve.worker.core.events import KVEventPublisher
from pdserve.worker.core.info import engine_info
from pdserve.worker.core.loop import Hook, Query
from pdserve.worker.core.metered import MeteredConnector
from pdserve.worker.core.spec_metrics import SpecCollector
from pdserve.worker.metrics import CoreMetrics

ROLE = "decode"


class DecodeCore:
    def __init__(self, config: CoreConfig) -> None:
        self.engine = e = LLMEngine(
            config.engine_config(), recompute_on_load_failure=config.recompute_on_load_failure
        )
        self.metrics = CoreMetrics(ROLE)
        if e.spec is not None:  # acceptance rate, tokens per step (worker/core/spec_metrics.py)
            self.metrics.registry.register(SpecCollector(e.spec.stats, ROLE))
        if e.tier_store is not None:  # KV tiers below the pool (docs/kv_tiers.md)
            from pdserve.engine.kv_tiers.metrics import TierCollector

            self.metrics.registry.register(TierCollector(e.tier_store.stats, ROLE))
        remote = RemoteKVConnector(
            e.kv_tensor,
            CompatRecord.for_pool(e.kv_tensor, e.model_id),
            transport=config.kv_transport,
            transfer_timeout=config.transfer_timeout,
        )
        self.remote = remote
        self.connector = MeteredConnector(remote, self.metrics, remote.transport_name)
        e.attach_connector(self.connector)
        # Load reports for every router replica (no KV events: its cache is not routed to).
        # Its default port (HTTP + 1) may be another process's when only the HTTP and side
        # channel ports were picked free (tests, benches): then any port, advertised.
        self.events = KVEventPublisher(
            f"tcp://{config.host}:{config.events_port}",
            config.worker_id,
            e,
            kv_events=False,
            any_port=config.kv_events_port is None,
        )
        self.events_address = f"tcp://{config.advertise_host}:{self.events.port}"
        self.hooks: list[Hook] = [self.events.hook]
        self.queries: dict[str, Query] = {
            "known": lambda rid: rid in e.requests or rid in e.held,
            "metrics": self.metrics.render,
            **lora_queries(e.loras),  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        }

    def probe_transfer(self, handles: list[Any]) -> None:
        """The start-up probe's hand-off: the worker's own connector reads seeded blocks
        from a loopback peer, bytes checked (worker/core/handoff_probe.py); not metered."""
        handoff_probe.load_loopback(self.remote, self.engine)

    def info(self) -> dict[str, Any]:
        return {**engine_info(self.engine), "kv_events": self.events_address}

    def close(self) -> None:
        self.connector.close()
        self.events.close()
        if self.engine.tier_store is not None:
            self.engine.tier_store.close()
