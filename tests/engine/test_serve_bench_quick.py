"""bench/serve.py --quick end to end: our setup under a concurrency sweep beside a peer.

The peer is a second, real `pdserve up --prefill 0` started here (vLLM is not a
dependency); the benchmark must treat it as any OpenAI-compatible server and
report per-point latencies, output tok/s and the peer ratio.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.local.proc_group import end_group
from tests.loopback import ROOT, free_port, run_bench, wait_until_up

pytestmark = pytest.mark.timeout(400)


def _start_peer(model: Path, port: int) -> tuple[subprocess.Popen, str]:  # type: ignore[type-arg]
    argv = [sys.executable, "-m", "pdserve", "up", "--model", str(model), "--prefill", "0",
            "--port", str(port), "--worker-port-base", str(20000 + port % 10000)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, start_new_session=True)  # fmt: skip
    url, workers = wait_until_up(proc, 300)
    assert len(workers) == 1, workers  # --prefill 0: one decode worker
    return proc, url


def test_serve_bench_quick(tiny_model_dir: Path, tmp_path: Path) -> None:
    peer, url = _start_peer(tiny_model_dir, free_port())
    try:
        plot = tmp_path / "serve.png"
        args = ["--quick", "--model", str(tiny_model_dir), "--setups", "colocated",
                "--peer-url", url, "--peer-name", "twin", "--port", str(free_port())]  # fmt: skip
        result = run_bench("serve.py", *args, "--plot", str(plot), timeout=360)
    finally:
        end_group(peer, grace_s=60)
    assert set(result["results"]) == {"twin", "pdserve-colocated"}
    for points in result["results"].values():
        assert [p["concurrency"] for p in points] == [1, 4]
        for p in points:
            assert p["requests"] == 8 and p["output_tok_s"] > 0
            assert 0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"]
            assert 0 < p["tpot_p50_ms"] <= p["tpot_p99_ms"]
    # No concurrency 16 in a quick sweep: the ratio is taken at the highest point (4).
    ours = result["results"]["pdserve-colocated"][-1]["output_tok_s"]
    twin = result["results"]["twin"][-1]["output_tok_s"]
    assert result["peer_ratio"] == pytest.approx(ours / twin, rel=1e-2)
    # The peer is the same server on the same model (`pdserve up --prefill 0` both): the
    # ratio is near 1. A sweep that counted tokens or time differently per side would not be.
    assert 0.4 < result["peer_ratio"] < 2.5, result["peer_ratio"]
    assert result["quick"] is True and plot.stat().st_size > 1000
