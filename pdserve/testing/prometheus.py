"""A real Prometheus server (Debian's ``prometheus`` package) on loopback, for tests.

:func:`run_prometheus` writes a scrape configuration (one job per group of targets, a short
scrape interval, extra target labels such as the ones a ServiceMonitor would add), starts
``prometheus`` with its storage in a temporary folder, waits until it is ready and has
scraped every target once, and stops it on exit. scripts/setup.sh installs the package;
:func:`prometheus_binary` finds it (``PDSERVE_PROMETHEUS_BIN`` names another one).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdserve.env import PROMETHEUS_BIN
from pdserve.local.proc_group import end_group
from pdserve.testing.loopback import free_port


@dataclass
class Prometheus:
    url: str  # e.g. http://127.0.0.1:PORT (its HTTP API is url + /api/v1/...)
    proc: subprocess.Popen[bytes]
    log: Path

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """One instant query's vector result, as Prometheus sent it (evaluated at ``at``,
        Unix seconds, or at the server's now)."""
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        body = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=5).json()
        assert body.get("status") == "success", body
        return list(body["data"]["result"])

    def value(self, promql: str, at: float | None = None) -> float | None:
        rows = self.query(promql, at)
        return float(rows[0]["value"][1]) if rows else None

    def wait_scraped(self, promql: str, want: float, timeout_s: float = 15.0) -> None:
        """Until ``promql`` (one series) reads ``want``: every sample up to now is stored."""
        deadline = time.monotonic() + timeout_s
        seen = None
        while time.monotonic() < deadline:
            seen = self.value(promql)
            if seen == want:
                return
            time.sleep(0.2)
        raise AssertionError(f"Prometheus: {promql} is {seen}, not {want}, after {timeout_s}s")


def prometheus_binary() -> str | None:
    """The ``prometheus`` executable, or None where it is not installed."""
    return os.environ.get(PROMETHEUS_BIN) or shutil.which("prometheus")


def scrape_config(
    jobs: Mapping[str, Sequence[str]], labels: Mapping[str, str], interval_s: float
) -> dict[str, Any]:
    """Prometheus' configuration: job name -> host:port targets, each scraped at /metrics
    every ``interval_s`` with ``labels`` added (what a ServiceMonitor's relabelling adds)."""
    every = f"{int(interval_s * 1000)}ms"
    return {
        "global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every},
        "scrape_configs": [
            {
                "job_name": job,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": list(targets), "labels": dict(labels)}],
            }
            for job, targets in jobs.items()
        ],
    }


@contextlib.contextmanager
def run_prometheus(
    jobs: Mapping[str, Sequence[str]],
    labels: Mapping[str, str] | None = None,
    interval_s: float = 1.0,
    timeout_s: float = 30.0,
) -> Iterator[Prometheus]:
    """A Prometheus scraping ``jobs`` (job name -> ["127.0.0.1:PORT", ...]), ready and with
    every target up once the context is entered."""
    binary = prometheus_binary()
    if binary is None:
        raise FileNotFoundError("prometheus is not installed (apt-get install -y prometheus)")
    with tempfile.TemporaryDirectory(prefix="pdserve-prom-") as tmp:
        config = Path(tmp) / "prometheus.yml"  # JSON is YAML
        config.write_text(json.dumps(scrape_config(jobs, labels or {}, interval_s)))
        port = free_port()
        log = Path(tmp) / "prometheus.log"
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp}/data",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
        ]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
        try:
            _wait_ready(prom, sum(len(t) for t in jobs.values()), timeout_s)
            yield prom
        finally:
            end_group(proc, signal.SIGTERM)


def _wait_ready(prom: Prometheus, targets: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    health: list[str] = []
    while time.monotonic() < deadline:
        if prom.proc.poll() is not None:
            break
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            active = httpx.get(f"{prom.url}/api/v1/targets", timeout=2).json()["data"]
            health = [t["health"] for t in active["activeTargets"]]
            if len(health) == targets and all(h == "up" for h in health):
                return
        time.sleep(0.2)
    tail = prom.log.read_text(errors="replace")[-3000:]
    raise AssertionError(f"Prometheus not scraping {targets} targets (health {health}):\n{tail}")
