"""The prefill worker's engine core (its own process, worker/core/main.py): the engine
holding handed-off KV, the lease server decode workers read it from, and the KV event
publisher the router's prefix index follows."""

from __future__ import annotations

from typing import Any

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora_registry import lora_queries
from pdserve.transfer.messages import CompatRecord
from pdserve.transfer.server import KVServer
from pdserve.worker.core import handoff_probe
from pdserve.worker.core.config import CoreConfig
from pdserve.worker.core.events import KVEventPublisher
from pdserve.worker.core.info import engine_info
from pdserve.worker.core.loop import Hook, Query
from pdserve.worker.metrics import CoreMetrics

ROLE = "prefill"


class PrefillCore:
    def __init__(self, config: CoreConfig) -> None:
        host = config.advertise_host
        self.engine = e = LLMEngine(config.engine_config())
        e.kv.record_events()
        self.metrics = CoreMetrics(ROLE)
        if e.tier_store is not None:  # KV tiers below the pool (docs/kv_tiers.md)
            from pdserve.engine.kv_tiers.metrics import TierCollector

            self.metrics.registry.register(TierCollector(e.tier_store.stats, ROLE))
        events_port = config.events_port
        self.events = KVEventPublisher(f"tcp://{config.host}:{events_port}", config.worker_id, e)
        self.events_address = f"tcp://{host}:{events_port}"
        self.kv = KVServer(
            e.kv_tensor,
            CompatRecord.for_pool(e.kv_tensor, e.model_id),
            transport=config.kv_transport,
            host=config.host,
            port=config.side_channel,
            advertise_host=host,
            lease_seconds=config.lease_seconds,
            on_expired=lambda _: self.metrics.lease_expired.labels(ROLE).inc(),
        )
        e.attach_holder(self.kv)
        # Leases end on the side-channel thread; their blocks are freed on the engine's.
        self.hooks: list[Hook] = [LLMEngine.free_released, self.events.hook]
        self.queries: dict[str, Query] = {
            "known": lambda rid: rid in e.requests or rid in e.held,
            "release": self.kv.release,
            "kv_snapshot": self.events.snapshot,  # GET /kv_blocks (a late router catching up)
            "metrics": self.metrics.render,
            **lora_queries(e.loras),  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        }

    def probe_transfer(self, handles: list[Any]) -> None:
        """The start-up probe's hand-off: the KV server serves its held probe blocks to
        an in-process reader, bytes checked (worker/core/handoff_probe.py)."""
        handoff_probe.read_back(self.kv, self.engine, handles)

    def info(self) -> dict[str, Any]:
        return {
            **engine_info(self.engine),
            "kv_events": self.events_address,
            "side_channel": self.kv.side_channel,
            "kv_transport": self.kv.transport_name,
        }

    def close(self) -> None:
        self.kv.close()
        self.events.close()
        if self.engine.tier_store is not None:
            self.engine.tier_store.close()
