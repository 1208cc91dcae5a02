"""bench/sim_vs_real.py --quick: the same short trace against ``pdserve up --autoscale`` (real
processes on loopback, the tiny model) and in the simulator; one JSON line last, a plot.

The quick trace is too short for the agreement figure to mean anything on a shared
2-core machine (start-up takes most of it), so this checks the path, not the 25% goal:
every request of the trace is answered on both sides, TTFTs and replica-seconds are
positive and finite, and the simulated cluster saw the same requests.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tests.loopback import run_bench

PROFILE = Path(__file__).resolve().parents[2] / "bench/profiles/cpu-tiny-1thread-cputime.json"


@pytest.mark.timeout(300)
def test_sim_vs_real_quick(tiny_model_dir: Path, tmp_path: Path) -> None:
    rec = tmp_path / "recording"
    args = ("--quick", "--model", str(tiny_model_dir), "--profile", str(PROFILE),
            "--out-dir", str(tmp_path), "--work-dir", str(rec))  # fmt: skip
    result = run_bench("sim_vs_real.py", *args, timeout=290)
    real, sim, n = result["real"], result["sim"], result["trace"]["requests"]
    assert n > 20
    # A scale event costs no request (docs/autoscaling.md: keep-alive and drain fixes)
    assert real["failed"] == 0, real["errors"]
    assert real["requests"] + real["failed"] == n, real
    assert sim["requests"] == n  # every request of the trace got its first token in the sim
    for side in (real, sim):
        for key in ("ttft_p50_s", "ttft_p90_s", "replica_s"):
            assert 0 < side[key] < math.inf, (side, key)
        assert side["ttft_p50_s"] <= side["ttft_p90_s"]
    assert real["replica_s"] >= 2 * result["trace"]["duration_s"] * 0.9  # 2 workers at least
    # Not the 25% goal: on the quick trace (tens of requests, seconds per phase) the error
    # measured 0.93 and 1.15 in two runs on 2026-12-03 (the recorded full runs replay at
    # 0.03-0.80, test_sim_vs_real_recordings.py), so the quick run only bounds a simulator
    # off by more than 3x (error >= 2), e.g. one that queues every request behind all the
    # others; making the quick trace predictive is issue 28 item 1.
    assert result["sim_vs_real_ttft_p90_error"] < 2.0, result["sim_vs_real_ttft_p90_error"]
    assert len(result["load_average_before_after"]) == 2
    # both sides plan with the start-up pdserve up measured on its own workers
    assert result["worker_startup_source"].startswith("pdserve up's pools"), result
    assert result["worker_startup_observed_s"] > 0
    # Scale events, both sides (counted from each timeline), and the replica-seconds they
    # cost agree within 50% (recordings: 0-29%): a simulated planner that never scaled
    # while the real one did, or scaled wildly, fails this.
    assert isinstance(real["workers_added"], int) and isinstance(sim["replicas_added"], int)
    assert result["sim_vs_real_replica_s_error"] < 0.5, (real, sim)
    host = result["host"]  # the simulated cluster shares this machine's cores (sim_host.py)
    assert host["cores"] == len(os.sched_getaffinity(0))
    assert host["other_cpu_ms_per_request"] > 0  # the router and the client used some CPU
    assert 0 <= host["background_cores_mean"] <= host["cores"]
    # under autogroup scheduling (on here) the sampler lowered our sessions to our nice and
    # the host model weighs sessions; the per-process model is reported beside it
    if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
        up_nice = max(10, os.nice(0))  # sim_vs_real_up.Up: nice 10 at least
        assert host["autogroup_weight"] == pytest.approx(1024 / 1.25**up_nice, rel=0.05)
        assert result["sim_per_process_nice"]["requests"] == n
    assert (tmp_path / "sim_vs_real.png").stat().st_size > 0
    # the recorded run gives the same simulated side again, without pdserve up
    again = run_bench("sim_vs_real.py", "--replay", str(rec), "--no-plot", timeout=120)
    for key in ("sim", "real", "sim_vs_real_ttft_p90_error", "host", "trace"):
        assert again[key] == result[key], key
