"""One operator replica (``kopf.operator`` with peering) in its own thread and event loop,
as in its own pod: kopf reaps every kopf task of its loop at exit, so two replicas cannot
share one loop. For the HA test (test_k8s_ha.py) and the operator benchmark
(bench/operator_peers.py)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import kopf

from pdserve.operator.handlers import OperatorConfig
from pdserve.operator.main import build_registry


class OperatorReplica:
    def __init__(self, config: OperatorConfig, priority: int, peering: str, namespace: str) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(config, priority, peering, namespace), daemon=True
        )

    def _run(self, config: OperatorConfig, priority: int, peering: str, namespace: str) -> None:
        asyncio.run(
            kopf.operator(
                registry=build_registry(config),
                namespaces=[namespace],
                standalone=False,
                peering_name=peering,
                priority=priority,
                stop_flag=self.stop,
            )
        )

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        """Stop it (its pod goes away) and wait until it has."""
        self.stop.set()
        self.thread.join(timeout=30)
        # kopf stops within seconds once its requests are answered: one still running now
        # is stuck (e.g. a close that blocked the loop serving its API), not merely slow
        assert not self.thread.is_alive(), "operator replica did not stop within 30 s"

    def __enter__(self) -> OperatorReplica:
        self.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    # From a test's event loop, the one that also serves the in-process API emulator: a close
    # that blocked that loop would leave the replica's last requests (peering, in-flight
    # handlers) unanswered, and the join would wait out its whole 30 s timeout.
    async def __aenter__(self) -> OperatorReplica:
        self.start()
        return self

    async def __aexit__(self, *_: Any) -> None:
        await asyncio.to_thread(self.close)
