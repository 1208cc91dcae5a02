"""A KV connector wrapper that turns finished loads into metrics."""

from __future__ import annotations

from typing import Any

from pdserve.engine.kv_connector import KVConnector, LoadResult
from pdserve.worker.metrics import CoreMetrics


class MeteredConnector(KVConnector):
    def __init__(self, inner: Any, metrics: CoreMetrics, transport: str) -> None:
        self.inner = inner
        self.transport_name = transport
        self.bytes = metrics.transfer_bytes.labels(metrics.role, transport)
        self.seconds = metrics.transfer_seconds.labels(metrics.role, transport)
        self.failures = metrics.transfer_failures.labels(metrics.role, transport)

    def start_load(
        self, request_id: str, handle: Any, remote_block_ids: list[int], local_block_ids: list[int]
    ) -> None:
        self.inner.start_load(request_id, handle, remote_block_ids, local_block_ids)

    def poll(self) -> list[LoadResult]:
        results: list[LoadResult] = self.inner.poll()
        for r in results:
            if r.ok:
                self.bytes.inc(r.num_bytes)
                self.seconds.observe(r.seconds)
            else:
                self.failures.inc()
        return results

    def cancel(self, request_id: str) -> None:
        self.inner.cancel(request_id)

    def unquarantined(self) -> list[str]:
        return self.inner.unquarantined()  # type: ignore[no-any-return]

    def close(self) -> None:
        self.inner.close()
