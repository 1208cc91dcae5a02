"""The simulator against ``pdserve up --autoscale``: bench/sim_vs_real.py --quick (real
processes on loopback, the tiny model, one JSON line last, a plot), and the staircase of
bench/sim_vs_real_scaling.py, whose recorded scored run is predicted again from its
calibration recording (sim only, seconds: the real run takes ~6 minutes of 2 cores).

The quick step trace is too short for the agreement figure to mean anything on a shared
2-core machine (start-up takes most of it), so that test checks the path, not the 25%
goal: every request of the trace is answered on both sides, TTFTs and replica-seconds
are positive and finite, and the simulated cluster saw the same requests.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.loopback import run_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import sim_vs_real_windows as win  # noqa: E402

PROFILE = BENCH / "profiles/cpu-tiny-1thread-cputime.json"


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
    # Scale events, both sides (counted from each timeline), agree within two workers and
    # the replica-seconds they cost within 50% (recordings: 0-29%): a simulated planner
    # that never scaled while the real one did, or scaled wildly, fails this. (The
    # staircase below is where scaling is forced and scored.)
    assert abs(real["workers_added"] - sim["replicas_added"]) <= 2, (real, sim)
    assert result["sim_vs_real_replica_s_error"] < 0.5, (real, sim)
    host = result["host"]  # the simulated cluster shares this machine's cores (sim_host.py)
    assert host["cores"] == len(os.sched_getaffinity(0))
    assert host["other_cpu_ms_per_request"] > 0  # the router and the client used some CPU
    assert 0 <= host["background_cores_mean"] <= host["cores"]
    # under autogroup scheduling (on here) the host model weighs sessions: --quick leaves
    # ours at the autogroup nice 0 every other session has (lowered to 10 they starved:
    # 265 s to start at load 20), so each weighs 1024; the per-process model beside it
    if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
        assert host["autogroup_weight"] == pytest.approx(1024, rel=0.05)
        assert result["sim_per_process_nice"]["requests"] == n
    assert (tmp_path / "sim_vs_real.png").stat().st_size > 0
    # the recorded run gives the same simulated side again, without pdserve up
    again = run_bench("sim_vs_real.py", "--replay", str(rec), "--no-plot", timeout=120)
    for key in ("sim", "real", "sim_vs_real_ttft_p90_error", "host", "trace"):
        assert again[key] == result[key], key


# -- the staircase (bench/sim_vs_real_scaling.py, issue 28 item 1): calibrate, then predict --
SCORED = BENCH / "recordings/2026-12-03-1231-scaling-scored"
# Bounds on the recorded scored run (a deterministic replay: no noise margin is needed).
# Measured on it (2026-12-03 12:31, load average 15-24 on the 2 cores): scaling-window
# TTFT p90 error 0.932 (real 24.6 s, predicted 1.67 s), replica-seconds error 0.003,
# scale events real 4 up / 4 down, sim 4 up / 3 down. The goal, 0.25, is NOT met: the
# host model does not queue the real side's work the way a machine at load 20 does
# (docs/autoscaling.md, "Through scale events"). The p90 bound is therefore loose, but
# it still fails a simulator that predicts no waiting for a core (0.999: the negative
# control below) or one 2x too slow (>= 1.0); the replica-seconds bound fails a planner
# that never scales (2 workers throughout: error 0.24) or one that scales twice as often.
SCALING_BOUND = 0.96
REPLICA_BOUND = 0.05


@pytest.fixture(scope="module")
def scored() -> dict:
    return run_bench("sim_vs_real_scaling.py", "--replay", str(SCORED), timeout=170)


def test_scaling_predicted_from_a_calibration_run(scored: dict) -> None:
    """The scored staircase run against the simulation built from the earlier
    calibration recording alone (sim only, deterministic)."""
    result = scored
    cal, run = result["calibration"], result["scored"]
    # calibrate once, then predict: another, earlier run with other requests
    assert cal["recording"] != Path(run["recording"]).name
    assert cal["date"] < run["date"] and cal["seed"] != run["seed"]
    # The trace covers scaling on both sides: >= 2 workers added and >= 1 removed. A
    # simulated planner that never scales (or a trace that stopped forcing it) fails.
    for side in ("real", "sim"):
        events = result["scale_events"][side]
        assert events["up"] >= 2 and events["down"] >= 1, (side, result["scale_event_times"])
    assert result["windows"]["scaling"] >= 3 and result["scaling"]["requests_real"] >= 200
    assert result["real"]["failed"] == 0, result["real"]["errors"]
    assert result["sim_vs_real_ttft_p90_error_scaling"] < SCALING_BOUND, result["scaling"]
    assert result["sim_vs_real_replica_s_error"] < REPLICA_BOUND, (result["real"], result["sim"])
    assert result["constants"]["BURST_WINDOW_S"] == 0.1  # fixed 2026-12-02, before this run


def test_nothing_measured_in_the_scored_run_reaches_the_prediction(
    scored: dict, tmp_path: Path
) -> None:
    """The scored run's host measurements (CPU samples, idle probe, start-up) scrambled in
    a copy: the prediction stays what it was."""
    import sim_vs_real_scaling as scaling
    from sim_vs_real import stats

    copy = tmp_path / SCORED.name
    shutil.copytree(SCORED, copy)
    dump = json.loads((copy / "real.json").read_text())
    for sample in dump["cpu"]:
        sample["machine"] = sample["machine"] * 3 + sample["t"]  # other jobs galore
    dump["probe"] = [x + 0.5 for x in dump["probe"]]  # a 500 ms slower serving path
    (copy / "real.json").write_text(json.dumps(dump))
    meta = json.loads((copy / "meta.json").read_text())
    meta["real"]["startup_s"] *= 3
    (copy / "meta.json").write_text(json.dumps(meta))
    calibration = scaling.Recording(BENCH / "recordings" / meta["calibration"])
    sim = scaling.predict(scaling.Recording(copy), calibration)
    assert stats(sim.ttft, sim.replica_s) == scored["sim"]


def test_a_host_model_that_never_waits_fails_the_bound(scored: dict) -> None:
    """The negative control: the same prediction with a core per replica (no host model)
    misses the scaling windows' p90 by more than SCALING_BOUND."""
    import sim_vs_real_scaling as scaling
    from sim_replay import replay

    run = scaling.Recording(SCORED)
    calibration = scaling.Recording(BENCH / "recordings" / run.meta["calibration"])
    cfg = run.config(calibration.dir / "profile.json")
    startup = float(calibration.meta["real"]["startup_s"])
    sim = replay(run.trace, cfg, (1, 1), startup, 2.0, scaling.DRAIN_S)  # no host
    events = win.real_events(run.dump["log"], run.end_s) + win.sim_events(sim.timeline)
    hit = win.scaling_windows(events, startup, run.end_s)
    split = win.split_errors(run.trace.arrival, run.ttft_all, sim.arrival, sim.ttft_by_arrival,
                             hit)  # fmt: skip
    assert split["sim_vs_real_ttft_p90_error_scaling"] > SCALING_BOUND, split


def test_scale_windows_cover_a_start_up_and_a_removal() -> None:
    """Windows of 10 s: an added worker's whole start-up, a removed one's next interval."""
    events = [win.Event(12.0, "prefill", 1), win.Event(95.0, "decode", -1)]
    hit = win.scaling_windows(events, startup_s=25.0, end_s=120.0)
    assert hit.tolist() == [False, True, True, True, False, False, False, False, False,
                            True, False, False]  # fmt: skip
    arrival = np.array([5.0, 15.0, 50.0, 99.0])
    ttft = np.array([0.01, 1.0, 0.02, 2.0])
    out = win.split_errors(arrival, ttft, arrival, ttft * 1.5, hit)
    assert out["sim_vs_real_ttft_p90_error_scaling"] == pytest.approx(0.5)
    assert out["sim_vs_real_ttft_p90_error_steady"] == pytest.approx(0.5)
    assert out["scaling"]["requests_real"] == 2
    sim: dict[str, list[float]] = {"t": [2.0, 4.0, 6.0], "prefill": [1, 3, 2], "decode": [1, 1, 1]}
    assert win.count(win.sim_events(sim)) == {"up": 2, "down": 1, "prefill": 3, "decode": 0}
