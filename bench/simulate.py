"""Simulate a P/D cluster under the real planner, a queue-blind planner and static provisioning.

    python bench/simulate.py [--quick] [--cost h100-llama3-8b|cpu-tiny|PROFILE.json]

Runs the diurnal, burst (10x in one minute) and long-prompt-surge traces at 100+
replicas per pool at peak (``--peak-replicas``), prints a table per scenario and,
last, ONE JSON line: ``attainment_min`` and ``queue_blind_attainment`` (share of
requests within both the TTFT and TPOT SLOs, worst scenario) and
``replica_hours_saving_min`` (planner vs static-for-peak, worst scenario), with the
per-scenario detail under ``scenarios``; ``attainment_heldout`` (and
``replica_hours_saving_heldout``, detail under ``heldout_scenarios``): the same on the
trace the knobs were not tuned on (a product launch and a reminder, each a step up that
decays); ``attainment_formerly_heldout`` (and ``replica_hours_saving_formerly_heldout``,
detail under ``formerly_heldout_scenarios``): the worst of the three traces held out once
and looked at since (a week with a holiday and a flash crowd; six growing two-peak days
with an outage, its retry surge and a failover; two tenants, a batch tenant's long-prompt
waves and a regional failover-in);
then the P:D split (``sim_mix.py``):
``disagg_goodput_ratio`` (8k-token prompts, 100-token outputs, a 12 ms TPOT: 1.62x one
decode step; ``..._long_outputs``: 500-token outputs), the same ratio as a curve over the
TPOT's strictness (``disagg_goodput_curve``) and ``colocated_chosen_short``.
Writes bench/out/simulate.png and bench/out/simulate_tpot.png (the curve).
``--check`` holds the figures to their bounds (``simulate_check.py``) and exits 1 on a miss;
``--quick`` (the suite's run) is the smallest run that takes every path, its figures not
bounded.
The model and its assumptions: docs/autoscaling.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import figures
import numpy as np
import simulate_check
from lib import flags
from sim_mix import mix_section
from sim_mix_sweep import plot_curve
from tqdm import tqdm

from pdserve.planner.config import SLO, Bounds, PlannerConfig, Stability
from pdserve.planner.decision import PlannerState
from pdserve.planner.model import decode_need, prefill_need
from pdserve.planner.plan import plan
from pdserve.planner.sim.cluster import Cluster
from pdserve.planner.sim.scenarios import (
    Mix,
    Scenario,
    Setup,
    formerly_heldout_scenarios,
    heldout_scenarios,
    scenarios,
    setup,
)
from pdserve.planner.snapshot import MetricsSnapshot, PoolStatus

POLICIES = ("planner", "queue_blind", "static")


@dataclass
class Result:
    policy: str
    requests: int = 0
    within_slo: int = 0
    replica_hours: float = 0.0
    timeline: dict[str, list[float]] = field(default_factory=dict)
    minute_attainment: list[float] = field(default_factory=list)

    @property
    def attainment(self) -> float:
        return self.within_slo / self.requests if self.requests else 1.0


def steady_need(cfg: PlannerConfig, rate: float, prompt: float, output: float) -> tuple[int, int]:
    """Replicas the load model asks for at a steady ``rate`` (no queue): static sizing."""
    running = rate * output * cfg.tpot_budget_s  # Little's law
    snap = MetricsSnapshot(
        0.0,
        1.0,
        PoolStatus(1, 1),
        PoolStatus(1, 1),
        request_rate=rate,
        prompt_token_rate=rate * prompt,
        output_token_rate=rate * output,
        decode_running=running,
    )
    p = prefill_need(snap, cfg, 1.0).need
    d = decode_need(snap, cfg, 1.0).need
    return math.ceil(p), math.ceil(d)


@functools.cache
def mean_lengths(mix: Mix, long_share: float) -> tuple[float, float]:
    """Mean prompt and output lengths of ``mix`` (200k draws, seeded: the same for the same
    arguments, so cached; ``sizing`` asks 241 times a scenario, mostly one share)."""
    prompt, output = mix.sample(np.random.default_rng(123), 200_000, long_share)
    return float(prompt.mean()), float(output.mean())


def run_one(
    sc: Scenario,
    policy: str,
    st: Setup,
    cfg: PlannerConfig,
    peak_rate: float,
    static: tuple[int, int],
    initial: tuple[int, int],
    args: argparse.Namespace,
) -> Result:
    rng = np.random.default_rng(args.seed)
    mix = Mix()
    if policy == "queue_blind":
        cfg = replace(cfg, queue_aware=False)
    start = static if policy == "static" else initial
    cluster = Cluster(st.cost, *start, st.ttft_s, st.tpot_s)
    state, res = PlannerState(), Result(policy)
    tl: dict[str, list[float]] = {k: [] for k in ("t", "rate", "prefill", "decode", "ttft_p90")}
    dt, every = args.dt, max(1, round(args.interval / args.dt))
    n_ticks = int((sc.duration_s + args.drain) / dt)
    replica_s = 0.0
    bar = tqdm(
        range(n_ticks),
        desc=f"{sc.name}/{policy}",
        leave=False,
        mininterval=1.0,
        disable=args.no_progress,
    )
    for i in bar:
        t = i * dt
        if t < sc.duration_s:
            n = int(rng.poisson(sc.load(t) * peak_rate * dt))
            if n:
                prompt, output = mix.sample(rng, n, sc.long_share(t))
                cluster.arrive(np.sort(t + rng.random(n) * dt), prompt, output)
        cluster.tick(t, dt)
        replica_s += (len(cluster.prefill.ready_at) + len(cluster.decode.ready_at)) * dt
        if (i + 1) % every == 0:
            snap = cluster.snapshot(t + dt, every * dt)
            if policy != "static":
                decision, state = plan(snap, state, cfg)
                cluster.prefill.scale(decision.prefill.desired, t + dt)
                cluster.decode.scale(decision.decode.desired, t + dt)
            for key, value in (
                ("t", t + dt),
                ("rate", snap.request_rate),
                ("prefill", len(cluster.prefill.ready_at)),
                ("decode", len(cluster.decode.ready_at)),
                ("ttft_p90", snap.ttft.p90),
            ):
                tl[key].append(float(value))
    return _finish(cluster, res, tl, replica_s, sc.duration_s)


def _finish(
    cluster: Cluster, res: Result, tl: dict[str, list[float]], replica_s: float, duration: float
) -> Result:
    arrival = np.concatenate([*cluster.done_arrival, cluster.unfinished_arrivals()])
    ok = np.concatenate([*cluster.done_ok, np.zeros(cluster.unfinished_arrivals().size, np.int8)])
    res.requests, res.within_slo = int(arrival.size), int(ok.sum())
    res.replica_hours = replica_s / 3600.0
    minute = (arrival // 60).astype(int)
    bins = int(duration // 60) + 1
    total = np.bincount(minute, minlength=bins)[:bins]
    good = np.bincount(minute, weights=ok, minlength=bins)[:bins]
    res.minute_attainment = [float(g / n) if n else 1.0 for g, n in zip(good, total, strict=True)]
    res.timeline = tl
    return res


def planner_config(st: Setup, profile_override=None, max_replicas: int = 1000) -> PlannerConfig:  # type: ignore[no-untyped-def]
    return PlannerConfig(
        slo=SLO(st.ttft_s, st.tpot_s),
        profile=profile_override or st.planner_profile,
        prefill=Bounds(1, max_replicas),
        decode=Bounds(1, max_replicas),
        startup_s=st.cost.startup_s,
        # a backlog is sized for once (at the pods' ready time), so it can be drained fast;
        # the forecast floor guards scale-down, so the window can be short
        queue_drain_s=15.0,
        stability=Stability(scale_down_window_s=120.0, scale_down_cooldown_s=60.0),
    )


def sizing(sc: Scenario, st: Setup, peak_rate: float) -> tuple[tuple[int, int], tuple[int, int]]:
    """(static-for-peak counts, sized with the cluster's TRUE costs; initial planner counts)."""
    truth_cfg = planner_config(st, st.cost.truth)
    mix, best = Mix(), (0, 0)
    for t in np.linspace(0, sc.duration_s, 241):
        prompt, output = (
            mean_lengths(mix, sc.long_share(float(t)))
            if sc.long_share(float(t))
            else mean_lengths(mix, 0.0)
        )
        p, d = steady_need(truth_cfg, sc.load(float(t)) * peak_rate, prompt, output)
        best = (max(best[0], p), max(best[1], d))
    prompt, output = mean_lengths(mix, sc.long_share(0.0))
    initial = steady_need(planner_config(st), sc.load(0.0) * peak_rate, prompt, output)
    return best, initial


def reference_peak_rate(st: Setup, replicas: int) -> float:
    """Request rate at which the normal mix needs ``replicas`` prefill replicas (true costs)."""
    cfg = planner_config(st, st.cost.truth)
    prompt, _output = mean_lengths(Mix(), 0.0)
    snap = MetricsSnapshot(
        0.0, 1.0, PoolStatus(1, 1), PoolStatus(1, 1), request_rate=1.0, prompt_token_rate=prompt
    )
    return replicas / prefill_need(snap, cfg, 1.0).need


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.dt = args.dt or (1.0 if args.quick else 0.2)
    began = time.perf_counter()
    st = setup(args.cost, args.truth_factor)
    scale = args.scale or (0.1 if args.quick else 1.0)
    peak_replicas = args.peak_replicas or (6 if args.quick else 120)
    peak_rate = reference_peak_rate(st, peak_replicas)
    results: dict[str, dict[str, Result]] = {}
    detail: dict[str, dict] = {}
    every = scenarios(scale) + formerly_heldout_scenarios(scale) + heldout_scenarios(scale)
    chosen = [s for s in every if not args.scenario or s.name in args.scenario]
    for sc in chosen:
        static, initial = sizing(sc, st, peak_rate)
        cfg = planner_config(st)
        results[sc.name] = {
            pol: run_one(sc, pol, st, cfg, peak_rate, static, initial, args)
            for pol in POLICIES
            if pol in args.policies or pol == "static"
        }
        detail[sc.name] = summarize(results[sc.name], static)
        print(table(sc.name, detail[sc.name]), file=sys.stderr)
    if not args.no_plot:
        path = plot(chosen, results, args.out_dir)
        print(f"plot: {path}", file=sys.stderr)
    mix = {} if args.no_mix else mix_section(args.quick)
    for case in mix.get("cases", []):
        print(
            f"== {case['name']}: goodput/replica {case['goodput_per_replica']} -> "
            f"planner: {case['planner_reason']}",
            file=sys.stderr,
        )
    curves = {
        f"{mix[lengths]['prompt']}/{mix[lengths]['output']} tokens": mix[key]
        for lengths, key in (
            ("disagg_goodput_lengths", "disagg_goodput_curve"),
            ("disagg_goodput_lengths_long_outputs", "disagg_goodput_curve_long_outputs"),
        )
        if mix.get(key)
    }
    for label, curve in curves.items():
        for row in curve:
            print(
                f"   {label}, TPOT {row['tpot_ms']} ms ({row['step_multiple']}x a step): ratio "
                f"{row['ratio']} (ceiling {row['fluid_ceiling']})",
                file=sys.stderr,
            )
    if curves and not args.no_plot:
        where = str(Path(args.out_dir) / "simulate_tpot.png")
        multiple = mix["disagg_goodput_tpot_step_multiple"]
        print(f"plot: {plot_curve(curves, multiple, where)}", file=sys.stderr)
    out = final_json(detail, args, st, peak_rate, time.perf_counter() - began)
    print(json.dumps({**out, **mix}))
    if args.check:
        missed = simulate_check.failures({**out, **mix})
        for line in missed:
            print(f"check failed: {line}", file=sys.stderr)
        return 1 if missed else 0
    return 0


def summarize(res: dict[str, Result], static: tuple[int, int]) -> dict:
    s = res["static"].replica_hours
    out = {
        pol: {
            "attainment": round(r.attainment, 4),
            "replica_hours": round(r.replica_hours, 2),
            "requests": r.requests,
            "peak_prefill": max(r.timeline["prefill"], default=0),
            "peak_decode": max(r.timeline["decode"], default=0),
        }
        for pol, r in res.items()
    }
    for pol in [p for p in ("planner", "queue_blind") if p in res]:
        out[pol]["replica_hours_saving"] = round(1 - res[pol].replica_hours / s, 4)
    out["static_replicas"] = {"prefill": static[0], "decode": static[1]}
    return out


def table(name: str, d: dict) -> str:
    rows = [f"== {name}: static-for-peak = {d['static_replicas']}"]
    for pol in [p for p in POLICIES if p in d]:
        r = d[pol]
        saving = r.get("replica_hours_saving", 0.0)
        rows.append(
            f"  {pol:12s} attainment {r['attainment']:.3f}  replica-h {r['replica_hours']:8.1f}"
            f"  saving {saving:+.1%}  peak P/D {r['peak_prefill']:.0f}/{r['peak_decode']:.0f}"
        )
    return "\n".join(rows)


def final_json(every: dict, args: argparse.Namespace, st: Setup, rate: float, secs: float) -> dict:
    held_names = {s.name for s in heldout_scenarios(1.0)}
    former_names = {s.name for s in formerly_heldout_scenarios(1.0)}
    detail = {k: v for k, v in every.items() if k not in held_names | former_names}
    held = {k: v for k, v in every.items() if k in held_names}
    former = {k: v for k, v in every.items() if k in former_names}
    attainment = min((d["planner"]["attainment"] for d in detail.values()), default=None)
    saving = min((d["planner"]["replica_hours_saving"] for d in detail.values()), default=None)
    return {
        "attainment_min": attainment,
        "replica_hours_saving_min": saving,
        "attainment": attainment,
        "replica_hours_saving": saving,
        "queue_blind_attainment": min(
            (d["queue_blind"]["attainment"] for d in detail.values() if "queue_blind" in d),
            default=None,
        ),
        "static_attainment": min(
            (d["static"]["attainment"] for d in detail.values()), default=None
        ),
        "scenarios": detail,
        # the trace the forecast and the knobs were not tuned on, scored apart (sim_scenarios)
        "attainment_heldout": min(
            (d["planner"]["attainment"] for d in held.values()), default=None
        ),
        "replica_hours_saving_heldout": min(
            (d["planner"]["replica_hours_saving"] for d in held.values()), default=None
        ),
        "heldout_scenarios": held,
        # held out once, looked at since to change the planner: apart from both of the above
        "attainment_formerly_heldout": min(
            (d["planner"]["attainment"] for d in former.values()), default=None
        ),
        "replica_hours_saving_formerly_heldout": min(
            (d["planner"]["replica_hours_saving"] for d in former.values()), default=None
        ),
        "formerly_heldout_scenarios": former,
        "cost_model": args.cost,
        "startup_s": st.cost.startup_s,  # pods and planner alike
        "startup_source": st.planner_profile.startup_source or "assumed (the profile has none)",
        "slo": {"ttft_s": st.ttft_s, "tpot_s": st.tpot_s},
        "reference_peak_rps": round(rate, 1),
        "quick": args.quick,
        "trace_scale": args.scale or (0.1 if args.quick else 1.0),
        "elapsed_s": round(secs, 1),
    }


def plot(chosen: list[Scenario], results: dict[str, dict[str, Result]], out_dir: str) -> Path:
    plt = figures.pyplot()

    fig, axes = plt.subplots(len(chosen), 3, figsize=(16, 3.6 * len(chosen)), squeeze=False)
    styles = {"planner": "-", "queue_blind": "--", "static": ":"}
    for row, sc in zip(axes, chosen, strict=True):
        res = results[sc.name]
        tl = res["planner"].timeline
        minutes = np.array(tl["t"]) / 60
        row[0].plot(minutes, tl["rate"], color="black")
        row[0].set(title=f"{sc.name}: load", xlabel="minute", ylabel="requests/s")
        for pol, r in res.items():
            m = np.array(r.timeline["t"]) / 60
            row[1].plot(m, r.timeline["prefill"], "C0" + styles[pol], label=f"prefill {pol}")
            row[1].plot(m, r.timeline["decode"], "C1" + styles[pol], label=f"decode {pol}")
            row[2].plot(
                r.minute_attainment, "C2" + styles[pol], label=f"{pol} ({r.attainment:.1%})"
            )
        row[1].set(title="replicas per pool", xlabel="minute", ylabel="replicas")
        row[2].set(title="requests within both SLOs", xlabel="minute (arrival)", ylim=(0, 1.05))
        row[1].legend(fontsize=7)
        row[2].legend(fontsize=7)
    path = Path(out_dir) / "simulate.png"
    figures.save(fig, path, dpi=90)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = flags.parser(__doc__, "short traces at ~6 replicas, every path, no bounds (seconds)")
    ap.add_argument(
        "--cost",
        default="h100-llama3-8b",
        help="h100-llama3-8b | cpu-tiny | a profile JSON from `pdserve profile`",
    )
    ap.add_argument(
        "--truth-factor",
        type=float,
        default=1.15,
        help="the cluster is this much slower than the planner's profile",
    )
    ap.add_argument("--peak-replicas", type=int, default=0, help="prefill replicas at the peak")
    ap.add_argument("--scenario", action="append", help="run only these (repeatable)")
    ap.add_argument("--scale", type=float, default=0.0, help="trace length (default 1, quick 0.1)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a figure misses its bound")
    ap.add_argument("--dt", type=float, default=0.0, help="tick, s (default 0.2, quick 1)")
    ap.add_argument("--interval", type=float, default=5.0, help="planner interval, seconds")
    ap.add_argument("--drain", type=float, default=120.0, help="seconds after the trace ends")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated subset (static always runs)"
    )
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "out"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-mix", action="store_true", help="skip the P:D split measurement")
    return ap.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
