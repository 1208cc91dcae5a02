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

import contextlib
import io
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import sim_vs_real_windows as win

from pdserve.testing.loopback import run_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"

pytestmark = pytest.mark.bench

PROFILE = BENCH / "profiles/cpu-tiny-1thread-cputime.json"


@pytest.mark.timeout(300)
def test_sim_vs_real_quick(tiny_model_dir: Path, tmp_path: Path) -> None:
    rec = tmp_path / "recording"
    args = (
        "--quick",
        "--model",
        str(tiny_model_dir),
        "--profile",
        str(PROFILE),
        "--out-dir",
        str(tmp_path),
        "--work-dir",
        str(rec),
    )
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
    host = result["host"]  # the simulated cluster shares this machine's cores (planner/sim/host.py)
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
RECORDINGS = BENCH / "recordings" / "sim_vs_real_scaling"
# The scored runs, each predicted from its calibration alone, with the bound on its
# scaling-window TTFT p90 error (a deterministic replay: no noise margin is needed).
# Measured under the host model of 16:20 ("runnable": the other jobs as the always-runnable
# threads that left the calibration's queued prefill engine its share of a core, the
# serving path consistent with the idle probe, a prefill's CPU as the calibration's queued
# engines spent it; docs/autoscaling.md, "What the first model left out"):
# - 12:31 from 12:23 (load average 15-24): 0.637 (real 24.6 s, predicted 8.94 s): its
#   engine got 0.088 of a core where the calibration's got 0.104 (hindsight 0.22); bound 0.70.
# - 12:41 from 12:23 (load average 19-20): 0.641 (real 5.48 s, predicted 8.99 s; 0.183
#   without the prefill's measured cost, 1.03x the profile's: a queue 0.12 of a core from
#   growing turns 3% into 40%); bound 0.68.
# - 16:01 from 15:53 (load average 28): 0.379 (real 57.6 s, predicted 35.8 s): the
#   calibration's prefills cost 1.55x the profile's CPU while queued; bound 0.45.
# Each bound fails the host model before (0.932, 0.692, 0.940) and a simulator that
# predicts no waiting for a core (the negative control below). The goal, 0.25, is met by
# none of them.
# Replica-seconds: 0.003 and 0.028 (bound 0.05: fails a planner that never scales, error
# 0.24); 16:01 0.287 (the simulated planner also added decode workers at the longer
# queue: bound 0.35, which a never-scaling one, 0.20, would pass; the scale-event check
# below fails that one).
SCORED = {
    "2026-12-03-1231-scaling-scored": (0.70, 0.05),
    "2026-12-03-1241-scaling-scored": (0.68, 0.05),
    "2026-12-03-1601-scaling-scored": (0.45, 0.35),
}
# The pairs recorded as `pdserve up` ships (its core zygote: an added worker ready in 2.5-6.5
# s, not 10-18; the recordings above ran --no-core-zygote), on a quiet host (load average
# under 2.4), `--rate-scale 2`, three pairs back to back (docs/autoscaling.md, "As shipped"):
# - 13:58 from 13:50: 0.192 (real 137 ms, predicted 110 ms); replica-seconds 0.074.
# - 14:09 from 14:04: 0.885 (real 960 ms, predicted 110 ms): the real planner started three
#   workers at once, their start-ups saturated the 2 cores for 8 s at 20 req/s and the
#   queue reached 2-3 s; the simulated one started two, and its start-ups stay cheap.
# - 14:22 from 14:17: 0.502 (real 248 ms, predicted 123 ms): the real planner scaled up
#   and down six times, the simulated one four.
# The goal, 0.25, is met by the first only. Bounds: the replay as measured, rounded up.
# Since 16:36 `pdserve up` starts at most --max-starting workers at once (1 on 2 cores) and
# the simulator mirrors the recorded flag; five pairs, 0.164-0.833 (docs/autoscaling.md, "One
# start-up at a time"). Kept here: 17:00 from 16:55, 0.164, the goal, with the cap in
# both runs' flags (the others are in the table of RECORDINGS/2026-12-04-1936-scaling-scored/
# NOTES.md; their bounds would be loose enough for the no-host control to pass, which would
# then prove nothing).
QUIET = {
    "2026-12-04-1358-scaling-scored": (0.25, 0.10),
    "2026-12-04-1409-scaling-scored": (0.90, 0.05),
    "2026-12-04-1422-scaling-scored": (0.55, 0.10),
    "2026-12-04-1700-scaling-scored": (0.25, 0.10),
}


@pytest.fixture(scope="module", params=sorted(SCORED) + sorted(QUIET))
def scored(request: pytest.FixtureRequest) -> dict:
    """``sim_vs_real_scaling.py --replay``: the command for the first recording, its main()
    in this process for the others (a deterministic replay; a process each paid the
    bench's imports seven times)."""
    import sim_vs_real_scaling as scaling

    replay_args = ("--replay", str(RECORDINGS / request.param))
    if request.param == min(SCORED):
        out = run_bench("sim_vs_real_scaling.py", *replay_args, timeout=240)
    else:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert scaling.main(list(replay_args)) == 0
        out = json.loads(printed.getvalue().strip().splitlines()[-1])
    bound, replica_bound = {**SCORED, **QUIET}[request.param]
    return {
        **out,
        "bound": bound,
        "replica_bound": replica_bound,
        "name": request.param,
        "loaded": request.param in SCORED,
    }


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
    bound = result["bound"]
    assert result["sim_vs_real_ttft_p90_error_scaling"] < bound, result["scaling"]
    replica = result["sim_vs_real_replica_s_error"]
    assert replica < result["replica_bound"], (result["real"], result["sim"])
    assert result["constants"]["BURST_WINDOW_S"] == 0.1  # fixed 2026-12-02, before this run
    if not result["loaded"]:
        # the start-up the simulator has is the calibration's added workers' (with a core
        # zygote the first two also wait for its imports), seconds, not the 10 s of a
        # process per core
        assert cal["core_zygote"] and cal["startup_s"] < 6, cal
        assert "added" in cal["startup_source"], cal
        import sim_vs_real_scaling as scaling

        run = scaling.Recording(RECORDINGS / result["name"])
        # the recordings since the start-up cap carry it, and the simulator mirrors it
        assert run.max_starting == (1 if result["name"] >= "2026-12-04-1636" else 0)
        return
    # the share was measured where the calibration's engine had a queue (86 engine-s of
    # it), not taken from its starting workers
    share = result["calibration"]["runnable_share"]
    assert share["source"] == "prefill engines with a queue", share
    assert 0.05 < share["share"] < 0.2, share  # /proc: 0.09-0.12 per 10 s while queued
    # the host model before misses by more than the bound (what the change is for)
    assert result["sim_timeline_host"]["sim_vs_real_ttft_p90_error_scaling"] > bound


def test_nothing_measured_in_the_scored_run_reaches_the_prediction(
    scored: dict, tmp_path: Path
) -> None:
    """The scored run's host measurements (CPU samples, idle probe, start-up, its own
    TTFTs, from which a queued engine's share is measured) scrambled in a copy: the
    prediction stays what it was."""
    import sim_vs_real_scaling as scaling
    from sim_vs_real import stats

    copy = tmp_path / scored["name"]
    shutil.copytree(RECORDINGS / scored["name"], copy)
    dump = json.loads((copy / "real.json").read_text())
    for sample in dump["cpu"]:
        sample["machine"] = sample["machine"] * 3 + sample["t"]  # other jobs galore
        for key in [k for k in sample if k.endswith("/engine")]:
            sample[key] *= 0.1  # engines starved
    dump["probe"] = [x + 0.5 for x in dump["probe"]]  # a 500 ms slower serving path
    dump["ttft"] = [None if x is None else x * 10 for x in dump["ttft"]]  # queues everywhere
    (copy / "real.json").write_text(json.dumps(dump))
    meta = json.loads((copy / "meta.json").read_text())
    meta["real"]["startup_s"] *= 3
    (copy / "meta.json").write_text(json.dumps(meta))
    calibration = scaling.Recording(RECORDINGS / meta["calibration"])
    sim = scaling.predict(scaling.Recording(copy), calibration)
    assert stats(sim.ttft, sim.replica_s) == scored["sim"]


def test_a_host_model_that_never_waits_fails_the_bound(scored: dict) -> None:
    """The negative control: the same prediction with a core per replica (no host model)
    misses the scaling windows' p90 by more than the bound."""
    import sim_vs_real_scaling as scaling

    from pdserve.planner.sim.replay import replay

    run = scaling.Recording(RECORDINGS / scored["name"])
    calibration = scaling.Recording(RECORDINGS / run.meta["calibration"])
    cfg = run.config(calibration.dir / "profile.json")
    startup = float(calibration.meta["real"]["startup_s"])
    sim = replay(run.trace, cfg, (1, 1), startup, 2.0, scaling.DRAIN_S)  # no host
    events = win.real_events(run.dump["log"], run.end_s) + win.sim_events(sim.timeline)
    hit = win.scaling_windows(events, startup, run.end_s)
    split = win.split_errors(run.trace.arrival, run.ttft_all, sim.arrival, sim.ttft_by_arrival, hit)
    assert split["sim_vs_real_ttft_p90_error_scaling"] > scored["bound"], split


def _dump(engine_cores: float, waits: list[tuple[float, float]]) -> tuple[dict, list, list]:
    """A recording of 20 s: prefill-0 ready before the trace, its engine using
    ``engine_cores``; prefill-1 ready at 4 s, drained at 12 s; 1.5 cores of other jobs
    on 2; requests (arrival, TTFT)."""
    cpu = []
    for i in range(41):
        t = i * 0.5
        e0 = engine_cores * t
        e1 = engine_cores * min(max(t - 4.0, 0.0), 8.0)
        cpu.append(
            {
                "t": t,
                "machine": 2.0 * t,
                "client": 0.0,
                "prefill-0": e0,
                "prefill-0/engine": e0,
                "prefill-1": e1,
                "prefill-1/engine": e1,
            }
        )
    log = [
        [-1.0, "pdserve up: autoscaler: prefill-0 ready after 30.0s (start-up estimate)"],
        [4.0, "pdserve up: autoscaler: prefill-1 ready after 30.0s (start-up estimate)"],
        [12.0, "pdserve up: autoscaler: prefill: draining and stopping prefill-1"],
    ]
    return {"cpu": cpu, "log": log}, [a for a, _ in waits], [w for _, w in waits]


def test_a_queued_engine_share_is_measured_inside_the_backlog_only() -> None:
    """backlogged_share: the engine threads' CPU over the sampling periods where a request
    waited (over BACKLOG_S, up to BACKLOG_S before its first token), of the ready and not
    draining prefill workers; nothing outside a backlog counts."""
    from sim_vs_real_host import BACKLOG_S, backlogged_share

    # two requests waited 6 s, from 2 s and from 13 s: the backlog is [2, 7] and [13, 18];
    # prefill-0 counts in both (10 s), prefill-1 from its readiness (4 s) to its drain
    # (12 s) only: 3 s. Counting it before it was ready or after it drained (0 CPU)
    # would give 1.3 / 18 = 0.072
    dump, arrival, ttft = _dump(0.1, [(2.0, 6.0), (13.0, 6.0), (19.0, 0.1)])
    share, seconds = backlogged_share(dump, np.array(arrival), np.array(ttft), 20.0)
    assert BACKLOG_S == 1.0
    assert share == pytest.approx(0.1)
    assert seconds == pytest.approx(13.0)
    # no request waited: no backlog measured (the caller falls back to starting workers)
    _, arrival, ttft = _dump(0.1, [(2.0, 0.3), (15.0, 0.1)])
    assert backlogged_share(dump, np.array(arrival), np.array(ttft), 20.0) == (0.0, 0.0)


def test_a_queued_prefill_cost_is_its_engines_cpu_over_the_profiles_work() -> None:
    """backlogged_cost: the ready engines' CPU inside the backlog over the profile's work
    of the requests whose first token came in it (1.3 CPU-s for two prompts here)."""
    import sim_vs_real_scaling as scaling
    from sim_vs_real_host import backlogged_cost

    cal = scaling.Recording(scaling.CALIBRATION)
    profile = cal.config(cal.dir / "profile.json").profile
    # backlog [2, 7] and [13, 18] as above; first tokens at 4.0 and 16.0 inside it, the
    # waiting requests' own first tokens (8, 19) and the quick one's outside it
    dump, arrival, ttft = _dump(
        0.1, [(2.0, 6.0), (2.5, 1.5), (13.0, 6.0), (14.0, 2.0), (19.0, 0.1)]
    )
    prompt = np.array([256.0, 400.0, 256.0, 600.0, 64.0])
    ratio, served = backlogged_cost(dump, np.array(arrival), np.array(ttft), prompt, 20.0, profile)
    p = profile.prefill
    work = (p.chunk_overhead_s / p.chunk_tokens + 1 / p.tokens_per_s) * (400.0 + 600.0)
    assert served == 2
    assert ratio == pytest.approx(1.3 / work)
    # the same engines twice as fast per request: half the ratio
    dump2, *_ = _dump(0.05, [])
    half, _ = backlogged_cost(dump2, np.array(arrival), np.array(ttft), prompt, 20.0, profile)
    assert half == pytest.approx(ratio / 2)


def test_the_other_jobs_as_runnable_threads_leave_our_thread_the_measured_share() -> None:
    """runnable_threads: background / share always-runnable threads at our weight; a
    CPU-bound thread of ours then gets about the measured share (a little more: in the
    run it was measured in, our other threads competed too), and more when the machine
    is quieter. probe_consistent: the simulated idle request takes the probe's time."""
    import sim_vs_real_scaling as scaling
    from sim_vs_real_host import probe_consistent, runnable_threads

    from pdserve.planner.sim.host import Host

    bg = np.full(10, 1.6)
    host = Host(
        cores=2.0,
        background_t=np.arange(10.0),
        background=bg,
        other_s_per_request=0.0,
        path_s=0.0,
        startup_cores=0.1,
    )
    busy = runnable_threads(host, 0.1)
    assert busy.background_groups[0][0][0] == pytest.approx(16.0)
    got = busy.cpu(3.0, [1.0], 0, 0.0)
    assert 0.1 < got < 0.13, got  # 2 cores over 17 threads
    quiet = runnable_threads(replace_bg(host, 0.05), 0.9)
    assert quiet.cpu(3.0, [1.0], 0, 0.0) == 1.0
    # the 12:23 calibration's probe, through its own host model
    cal = scaling.Recording(scaling.CALIBRATION)
    profile = cal.config(cal.dir / "profile.json").profile
    host = cal.host(profile)
    assert host.path_slow > 4  # a saturated machine: the probe's prefill waited for a core
    probe = cal.dump["probe"][1:]
    lengths = [64, 256, 512] * 3
    simulated = [
        profile.prefill.service_time(n) * host.path_slow + host.path_s + host.path_s_per_token * n
        for n in lengths[1:]
    ]
    # the probe's mean within 20% (a fit of two terms to eight noisy requests; the model
    # before gave 4-8x: the prefill's wait for a core counted twice)
    assert np.mean(simulated) == pytest.approx(np.mean(probe), rel=0.2)
    again = probe_consistent(host, cal.dump, profile)
    assert again.path_slow == pytest.approx(host.path_slow)


def replace_bg(host, cores: float):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(host, background=np.full(host.background.size, cores))


def test_scale_windows_cover_a_start_up_and_a_removal() -> None:
    """Windows of 10 s: an added worker's whole start-up, a removed one's next interval."""
    events = [win.Event(12.0, "prefill", 1), win.Event(95.0, "decode", -1)]
    hit = win.scaling_windows(events, startup_s=25.0, end_s=120.0)
    assert hit.tolist() == [
        False,
        True,
        True,
        True,
        False,
        False,
        False,
        False,
        False,
        True,
        False,
        False,
    ]
    arrival = np.array([5.0, 15.0, 50.0, 99.0])
    ttft = np.array([0.01, 1.0, 0.02, 2.0])
    out = win.split_errors(arrival, ttft, arrival, ttft * 1.5, hit)
    assert out["sim_vs_real_ttft_p90_error_scaling"] == pytest.approx(0.5)
    assert out["sim_vs_real_ttft_p90_error_steady"] == pytest.approx(0.5)
    assert out["scaling"]["requests_real"] == 2
    sim: dict[str, list[float]] = {"t": [2.0, 4.0, 6.0], "prefill": [1, 3, 2], "decode": [1, 1, 1]}
    assert win.count(win.sim_events(sim)) == {"up": 2, "down": 1, "prefill": 3, "decode": 0}


def test_on_a_quiet_machine_the_doubled_staircase_still_scales() -> None:
    """--rate-scale 2, for the pair on a quiet machine: in the simulator on a quiet host
    (0.05 of a core of other jobs, a thread of ours gets a whole core; start-up 20 s, the
    eager forward on free cores) the real planner still adds >= 2 workers and removes
    one (measured: 3 and 3; at the rates as they are, 1 and 1: the issue asks for >= 2
    additions)."""
    from dataclasses import replace

    import sim_vs_real_scaling as scaling
    from sim_vs_real_host import runnable_threads

    from pdserve.planner.sim.replay import replay

    cal = scaling.Recording(scaling.CALIBRATION)
    cfg = cal.config(cal.dir / "profile.json")
    host = replace_bg(cal.host(cfg.profile), 0.05)
    quiet = replace(
        runnable_threads(host, 1.0),
        path_s=0.01,
        path_s_per_token=0.0,
        path_slow=1.0,
        startup_cores=0.9,
    )
    rates = tuple(2 * r for r in scaling.RATES)
    trace = scaling.staircase(scaling.SCORED_SEED, rates, scaling.PHASES)
    sim = replay(trace, cfg, (1, 1), 20.0, 2.0, scaling.DRAIN_S, host=quiet)
    events = win.count(win.sim_events(sim.timeline))
    assert events["up"] >= 2 and events["down"] >= 1, events
