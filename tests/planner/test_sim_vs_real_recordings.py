"""The recorded sim_vs_real.py runs (bench/recordings/sim_vs_real/): the simulated side
re-run on what the real side measured, sim-only and deterministic (no processes, a few seconds)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import sim_vs_real
import sim_vs_real_record as record
from sim_vs_real import INTERVAL_S, up_flags
from sim_vs_real_host import measure_host

from pdserve.local.planner_loop import config_from_args
from pdserve.local.up import add_arguments
from pdserve.planner.sim.replay import Trace, replay
from pdserve.testing.loopback import run_bench

pytestmark = pytest.mark.bench

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _step_recording(path: Path) -> bool:
    """A recording of sim_vs_real.py's step trace: its meta holds the trace's ``args``
    (the staircase's, *-scaling-*, are test_sim_vs_real.py's; other benches' folders too)."""
    meta = path / "meta.json"
    return meta.is_file() and "args" in json.loads(meta.read_text())


RECORDINGS = sorted(p for p in (BENCH / "recordings/sim_vs_real").iterdir() if _step_recording(p))
HOG = BENCH / "recordings/sim_vs_real/2026-12-01-0431-quick-nice19-hog"


def _p90_error(work: Path, fixed_load: bool = False) -> float:
    """What sim_vs_real.py --replay computes, with the host model's variant chosen here."""
    args = argparse.Namespace()
    real = record.load(work, args)
    phases = (4.0, 10.0, 4.0) if args.quick else (30.0, 90.0, 30.0)
    drain = 5.0 if args.quick else args.drain
    trace = Trace.step(args.low, args.high, phases, args.seed)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(up_flags(args, str(work / "profile.json"), 18000)))
    dump = json.loads((work / "real.json").read_text())
    host = measure_host(dump, cfg.profile, int(trace.arrival.size), trace.duration_s + drain)
    if fixed_load:  # the other jobs as a load taken off the top (the model before 04:30)
        host = replace(host, background_groups=())
    assert real.startup_s is not None  # every recording has its measured start-up
    sim = replay(trace, cfg, (1, 1), real.startup_s, INTERVAL_S, drain, host=host)
    real_p90, sim_p90 = np.percentile(real.ttft, 90), np.percentile(sim.ttft, 90)
    return float(abs(sim_p90 - real_p90) / real_p90)


@pytest.mark.parametrize("work", RECORDINGS, ids=[p.name for p in RECORDINGS])
def test_a_recording_replays(work: Path) -> None:
    meta = json.loads((work / "meta.json").read_text())
    # the bench's main() in this process (a process each paid its imports eleven times);
    # the command itself runs in the busy-loop test below
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert sim_vs_real.main(["--replay", str(work), "--no-plot"]) == 0
    result = json.loads(printed.getvalue().strip().splitlines()[-1])
    assert result["real"]["replica_s"] == pytest.approx(meta["real"]["replica_s"], abs=0.05)
    assert result["sim"]["requests"] == result["trace"]["requests"]
    assert result["host"]["cores"] == 2.0  # the recorded machine's, not this one's
    # Replays are deterministic; recorded errors are 0.03-0.80
    # (bench/recordings/sim_vs_real/README.md).
    # A simulator predicting no wait scores ~1.0, one 2x too slow 1.0 and more: both fail.
    assert result["sim_vs_real_ttft_p90_error"] < 0.9, result["sim_vs_real_ttft_p90_error"]
    assert result["sim_vs_real_replica_s_error"] < 0.5  # recordings: 0-0.29
    assert result["sim_vs_real_ttft_p90_error"] == pytest.approx(_p90_error(work), abs=1e-3)


def test_the_busy_loop_beside_a_recording_is_read_as_a_job_of_our_priority() -> None:
    """The nice-19 busy loop of that recording is one always-runnable thread at our
    priority in every period (it shares the cores with the simulated workers), and the
    fixed-load variant still runs on the same recording (the docs compare the two)."""
    result = run_bench("sim_vs_real.py", "--replay", str(HOG), "--no-plot", timeout=120)
    assert result["host"]["background_hogs_by_nice"].get("19", 0.0) >= 0.9
    assert math.isfinite(_p90_error(HOG, fixed_load=True))
