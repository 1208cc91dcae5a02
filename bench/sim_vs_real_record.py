"""A sim_vs_real.py run kept on disk, so the simulated side can be re-run on it later.

``pdserve up``'s side of a replay takes minutes of a shared machine and never comes out
the same twice; the simulated side is deterministic given what the real side measured.
So each run leaves, in its work directory (``--work-dir``; a temporary one by default):
``real.json`` (sim_vs_real_up.py: TTFTs, /proc CPU samples, the autoscaler's log),
``profile.json`` (the costs both sides used) and ``meta.json`` (the trace's parameters
and the real side's summary). ``python bench/sim_vs_real.py --replay DIR`` rebuilds the
trace, the planner's flags and the host model from them and runs only the simulator:
what a change to the simulator or the host model would have given on a recorded run.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from sim_vs_real_up import RealRun

TRACE_ARGS = (
    "model",
    "low",
    "high",
    "seed",
    "quick",
    "drain",
    "slo_ttft_ms",
    "slo_tpot_ms",
    "worker_startup",
    "unready_hold",
    "max_starting",
)
# What a real run records (sim_vs_real_up.RealRun's fields), and with its CPU figures.
RUN_FIELDS: tuple[str, ...] = ("replica_s", "times", "workers", "startup_s", "startup_source")
RUN_FIELDS += ("failed", "peak", "errors")
REAL_FIELDS = (*RUN_FIELDS, "cpu", "nice_up")


def save(work: Path, args: argparse.Namespace, real: RealRun, profile: str) -> None:
    if Path(profile).resolve() != (work / "profile.json").resolve():
        shutil.copyfile(profile, work / "profile.json")
    meta = {
        "args": {k: getattr(args, k) for k in TRACE_ARGS},
        "real": {k: getattr(real, k) for k in REAL_FIELDS},
    }
    (work / "meta.json").write_text(json.dumps(meta))


def load(work: Path, args: argparse.Namespace) -> RealRun:
    """The recorded real side; ``args`` takes the recorded trace parameters."""
    meta = json.loads((work / "meta.json").read_text())
    args.unready_hold = 0.0  # a recording without it ran before the planner had the hold
    args.max_starting = None  # ... and without one before up capped its start-ups
    for k, v in meta["args"].items():
        setattr(args, k, v)
    dump = json.loads((work / "real.json").read_text())
    every = np.array([np.nan if x is None else x for x in dump["ttft"]], dtype=float)
    run = RealRun(every[~np.isnan(every)], 0.0)
    for k, v in meta["real"].items():
        setattr(run, k, v)
    run.ttft_all, run.probe = every, dump["probe"]
    return run
