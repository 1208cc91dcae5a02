"""What the prefill and the decode worker's HTTP servers share: the engine in its child
process, the worker's id and metrics, the identity both report, and the shutdown."""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.worker.core.client import EngineClient
from pdserve.worker.http import core_config, worker_id
from pdserve.worker.metrics import WorkerMetrics


class RoleWorker:
    """One worker of ``ROLE``; the engine runs in a child process (``*_worker/core.py``)."""

    ROLE = ""

    def __init__(self, args: argparse.Namespace) -> None:
        assert self.ROLE, "a subclass names its role"
        self.args = args
        self.worker_id = worker_id(args, self.ROLE)
        self.engine = EngineClient(core_config(self.ROLE, args))
        self.metrics = WorkerMetrics(self.engine, self.ROLE)

    def identity(self) -> dict[str, Any]:
        """What ``GET /identity`` reports; a role adds its own keys."""
        return {"role": self.ROLE, "worker_id": self.worker_id}

    def close(self) -> None:
        self.engine.shutdown()
