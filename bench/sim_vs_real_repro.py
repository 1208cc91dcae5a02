"""How well the real service predicts itself: the noise floor under the simulator's error.

    python bench/sim_vs_real_repro.py \
        bench/recordings/sim_vs_real_scaling/2026-12-04-*-scaling-calibration \
        [--plot repro.png]

Every calibration run of bench/sim_vs_real_scaling.py replays the same staircase with the
same requests (seed 11). For each ordered pair of runs (A, B) this prints two errors of
B's TTFT p90 in the 10 s windows a scale event touches (sim_vs_real_windows.py, the events
of both sides, as the scored figure has them):

- ``real_vs_real``: run A's own TTFTs as the prediction of run B. The same requests, the
  same trace, the same service, minutes apart on the same host: what is left is the
  host and the real planner's timing. A simulator cannot be expected to beat it.
- ``sim_vs_real``: the simulator built from run A alone (sim_vs_real_scaling.predict, the
  shipped host model) predicting run B: the figure the scored pairs report, here on more
  pairs.

The runs must share their trace (seed, rates, phases) and `pdserve up` flags. The last
stdout line is JSON: per side the median, quartiles and share of pairs <= 0.25 (the goal
of issue 28 item 1), and per run its scale events, TTFT p90 at 20 req/s, the other jobs'
cores and the CPU the same work took (``machine_cpu_s``, ``engine_cpu_ms_per_request``:
on this host the cores' speed moved by up to a third between runs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import sim_vs_real_windows as win
from sim_vs_real_host import describe, measure_host
from sim_vs_real_scaling import (
    Recording,
    current_flags,
    predict,
    scaling_error,
    window_error,
)

GOAL = 0.25


def pair_errors(a: Recording, b: Recording, simulate: bool = True) -> dict[str, float]:
    """Run ``a`` (its TTFTs, and the simulator built from it) predicting run ``b``."""
    events = win.real_events(a.dump["log"], a.end_s) + win.real_events(b.dump["log"], b.end_s)
    out = {"real_vs_real": window_error(b, events, a, a.trace.arrival, a.ttft_all)}
    if simulate:
        out["sim_vs_real"] = scaling_error(b, predict(b, a), a)
    return out


def summary(errors: list[float]) -> dict[str, float]:
    x = np.array(errors)
    q1, med, q3 = np.percentile(x, [25, 50, 75])
    return {
        "median": round(float(med), 3),
        "q1": round(float(q1), 3),
        "q3": round(float(q3), 3),
        "share_within_goal": round(float(np.mean(x <= GOAL)), 3),
        "pairs": int(x.size),
    }


def describe_run(r: Recording) -> dict:
    """What differed between runs of the same requests: the real planner's scale events,
    the TTFT at the busiest step, and what the host showed of other jobs (/proc: the
    cores they used, steal time included; the load average before)."""
    busy = (r.trace.arrival >= 100.0) & (r.trace.arrival < 180.0)  # the 20 req/s step
    profile = r.config(r.dir / "profile.json").profile
    host = measure_host(r.dump, profile, int(r.trace.arrival.size), r.end_s)
    return {
        "run": r.dir.name,
        "date": r.meta["date"],
        "scale_events": win.count(win.real_events(r.dump["log"], r.end_s)),
        "ttft_p90_busy_step_ms": round(1000 * win.p90(r.ttft_all[busy]), 1),
        "background_cores_mean": describe(host)["background_cores_mean"],
        **r.work_cpu(),
        "load_average_before": round(float(r.meta["load_average_before_after"][0][0]), 2),
    }


def check_same_trace(runs: list[Recording]) -> None:
    keys = ("seed", "rates", "phases", "drain_s")
    first = runs[0]
    for r in runs[1:]:
        for k in keys:
            if r.meta[k] != first.meta[k]:
                theirs = f"{first.dir.name}'s {first.meta[k]}"
                raise SystemExit(
                    f"{r.dir.name}: {k} {r.meta[k]} differs from {theirs}: not the same trace"
                )
        if _flags(r) != _flags(first):
            raise SystemExit(f"{r.dir.name}: pdserve up ran with other flags than {first.dir.name}")


LOCAL = ("--model", "--port", "--worker-port-base")  # where it ran, not how


def _flags(r: Recording) -> list[str]:
    flags = current_flags(r.meta["flags"])
    for name in LOCAL:
        if name in flags:
            del flags[flags.index(name) : flags.index(name) + 2]
    return flags


def plot(pairs: list[dict], path: str) -> None:
    from figures import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    data = [[p["real_vs_real"] for p in pairs], [p["sim_vs_real"] for p in pairs]]
    ax.boxplot(data, orientation="horizontal", showfliers=True)
    rng = np.random.default_rng(0)
    for i, xs in enumerate(data, start=1):
        ax.scatter(xs, i + rng.uniform(-0.12, 0.12, len(xs)), s=9, alpha=0.6)
    ax.axvline(GOAL, color="red", linestyle="--", label=f"goal {GOAL}")
    ax.set_yticks([1, 2], ["run A's TTFTs\n(real vs real)", "simulator from A\n(sim vs real)"])
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("TTFT p90 error in the scaling windows of run B (|pred - B| / B)")
    ax.set_title(f"{len(pairs)} ordered pairs of runs of the same trace")
    ax.legend(loc="lower right")
    save(fig, path, 120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="calibration recordings of one trace (>= 2)")
    ap.add_argument("--plot", default="", help="write the two distributions to this PNG")
    ap.add_argument("--no-sim", action="store_true", help="the real side only (a second)")
    args = ap.parse_args(argv)
    runs = [Recording(Path(d)) for d in args.runs]
    if len(runs) < 2:
        ap.error("two runs at least")
    check_same_trace(runs)
    pairs = []
    for a, b in itertools.permutations(runs, 2):
        errors = pair_errors(a, b, simulate=not args.no_sim)
        pairs.append({"from": a.dir.name, "to": b.dir.name, **errors})
        print(
            f"{a.dir.name} -> {b.dir.name}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in errors.items()),
            flush=True,
        )
    out: dict = {
        f"{side}_ttft_p90_error_scaling": summary([p[side] for p in pairs])
        for side in pairs[0]
        if side not in ("from", "to")
    }
    if args.plot and not args.no_sim:
        plot(pairs, args.plot)
    out |= {
        "goal": GOAL,
        "runs": [describe_run(r) for r in runs],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
