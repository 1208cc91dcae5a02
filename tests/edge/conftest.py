"""One real deployment for the edge tests: a router process in front of a real prefill
worker and a real decode worker on loopback (tiny model from disk, KV over NIXL).

The router knows two API keys (two tenants) so the cache-isolation test can compare
them; the other tests send tenant A's key.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.local.processes import ClusterSpec, LocalCluster
from pdserve.testing.loopback import SMALL_WORKER_ARGS, free_port, worker_port_base
from tests.early_release import released_after_last_user

KEYS = ("tenant-a-key", "tenant-b-key")
ADMIN_KEY = "edge-admin-key"  # /workers needs it while tenant keys are on
# Two tiny workers and a router start in ~20-50 s on the loaded 2-core machine; a set-up
# that takes longer is stuck, and fails well before pytest-timeout's 600 s per test.
SETUP_TIMEOUT_S = 120
WORKER_ARGS = (*SMALL_WORKER_ARGS, "--cpu-threads", "1")


@dataclass(frozen=True)
class Deployment:
    url: str  # the router
    workers: tuple[str, ...]
    model: str

    def headers(self, tenant: int = 0) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="session")
def deployment(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("edge-logs")
    keys = logs / "keys.txt"
    keys.write_text("\n".join(KEYS) + "\n")
    spec = ClusterSpec(
        model_dir=str(tiny_model_dir),
        dtype="float32",
        worker_args=WORKER_ARGS,
        kv_transport=os.environ.get("PDSERVE_TEST_TRANSPORT", "nixl"),
        log_dir=str(logs),
        worker_port_base=worker_port_base(),
    )
    cluster = LocalCluster(spec)
    with released_after_last_user("deployment") as stack:  # tests/early_release.py
        stack.callback(cluster.stop)
        cluster.start_workers()
        router = cluster.start_router(
            port=free_port(),
            args=(
                "--api-key-file",
                str(keys),
                "--disagg-threshold",
                "32",
                "--health-interval",
                "0.2",
                "--admin-api-key",
                ADMIN_KEY,
            ),
        )
        try:  # bounded: a deployment not up in 2 min fails its tests with the logs' ends
            cluster.wait_healthy(timeout=SETUP_TIMEOUT_S)
            cluster.wait_routed(router, api_key=ADMIN_KEY)
        except (RuntimeError, TimeoutError) as exc:
            tails = "".join(f"\n--- {p.name}\n{p.log_tail(15)}" for p in cluster.procs)
            pytest.fail(f"edge deployment not up: {exc}{tails}", pytrace=False)
        workers = tuple(cluster.urls("prefill") + cluster.urls("decode"))
        yield Deployment(router.url, workers, spec.model_name)
