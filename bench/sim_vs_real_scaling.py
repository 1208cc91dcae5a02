"""Simulator vs the real thing through scale events: calibrate once, then predict.

    python bench/sim_vs_real_scaling.py --calibrate --model DIR [--rate-scale X] \
        [--work-dir DIR] [--profile FILE] [--quick]          # once: writes a recording
    python bench/sim_vs_real_scaling.py --model DIR --calibration DIR [--work-dir DIR]
    python bench/sim_vs_real_scaling.py --replay DIR   # the prediction again, on a scored run

The trace is a staircase (1 -> 5 -> 10 -> 1 req/s over 30, 70, 80 and 60 s; prompts
~256 tokens, outputs ~16) that makes the real planner of ``pdserve up --autoscale``
(pools 1..3 each, TTFT SLO 200 ms, the eager forward) add workers on the way up and
remove them on the way down. The rates are low because the 2 cores are shared with other
sessions (load average 15-20 at 12:20); on a quiet machine the planner has no reason to
scale at these rates (the simulator: one addition), so ``--rate-scale 2`` doubles them
(three). A scored run takes its calibration's rates, phases and drain (its meta.json).

``pdserve up`` runs as it ships, its engine cores forked from the core zygote
(``--no-core-zygote``: a process per core, as the recordings before 2026-12-04 ran; a
scored run does as its calibration did); the simulated start-up is then the added
workers' (sim_vs_real_up._account, sim_vs_real_host.measure_host).

*Calibrate*: one run of the trace (seed 11), with its profile measured just before
(``pdserve profile``; ``--profile FILE`` reuses one) is kept in ``recordings/sim_vs_real_scaling/``
(``*-scaling-calibration``). The simulator's host model and the workers' start-up time
come from that recording only; the planner and both sides use its profile. The host
model (``HOST_MODEL`` "runnable", Recording.host; docs/autoscaling.md, "What the first
model left out"): the other jobs as the always-runnable threads that left a prefill
engine of the calibration, while a request waited for it, the share of a core it got
(sim_vs_real_host.backlogged_share, runnable_threads); the CPU per request of the router,
the client and the workers' non-engine threads; the serving path refit so that the idle
probe comes back (probe_consistent); a starting worker's CPU (planner/sim/host.py); and the
simulated cluster's prefill costs, the profile's times what a prefill cost the
calibration's queued engines over what the profile says (backlogged_cost, scaled_prefill:
1.03x at load average 18, 1.55x at 25; the planner keeps the profile, as the real one).
*Predict*: a later run of the trace with other requests (seed 12) is scored against the
simulation built from the calibration alone; nothing measured in the scored run reaches
the simulation (its own host conditions give ``sim_hindsight``, printed beside it, for
how much of the error is the machine having changed; ``sim_speed_hindsight``: told only
how much more or less engine CPU the scored run's requests took than the calibration's;
``sim_timeline_host``: the errors of the host model before, sim_vs_real.py's). The host
model's tuned constants were fixed before the first scored run (``constants`` in the
JSON: BURST_WINDOW_S of planner/sim/cluster.py, chosen on the 2026-12-02 recordings; RHO_MAX of
planner/sim/host.py).

The last stdout line is JSON: ``sim_vs_real_ttft_p90_error`` (all requests),
``..._scaling`` (requests that arrived in a 10 s window touched by a scale event,
sim_vs_real_windows.py) and ``..._steady``, ``sim_vs_real_replica_s_error``,
``scale_events`` of both sides, the calibration's name, date and measured share, and the
load average (other sessions share the 2 cores: the real side slows, the prediction
cannot know).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import manifest
import numpy as np
import sim_vs_real_windows as win
from sim_vs_real import INTERVAL_S, measure_profile, stats, up_flags
from sim_vs_real_host import (
    MIN_BACKLOG_S,
    backlogged_cost,
    backlogged_share,
    describe,
    measure_host,
    probe_consistent,
    runnable_threads,
)
from sim_vs_real_record import RUN_FIELDS
from sim_vs_real_up import run_real

from pdserve.local.autoscale import default_max_starting
from pdserve.local.planner_loop import config_from_args
from pdserve.local.up import add_arguments as up_arguments
from pdserve.planner.capacity import Profile
from pdserve.planner.sim.cluster import BURST_WINDOW_S
from pdserve.planner.sim.host import RHO_MAX, Host
from pdserve.planner.sim.replay import SimReplay, Trace, replay

RATES = (1.0, 5.0, 10.0, 1.0)  # req/s per phase
PHASES = (30.0, 70.0, 80.0, 60.0)  # s
DRAIN_S = 20.0
# --quick: the same steps a quarter as long (an end-to-end check of both commands in ~3
# minutes each; too short for a worker started at the step to be ready, so not a figure)
QUICK_PHASES = tuple(p / 4 for p in PHASES)
QUICK_DRAIN_S = 10.0
CALIBRATION_SEED, SCORED_SEED = 11, 12
SLO_TTFT_MS, SLO_TPOT_MS = 200.0, 500.0
POOL_MAX = 3
RECORDINGS = Path(__file__).resolve().parent / "recordings" / "sim_vs_real_scaling"
CALIBRATION = RECORDINGS / "2026-12-03-1223-scaling-calibration"
# the host model's tuned constants, fixed before the first scored run
CONSTANTS = {
    "BURST_WINDOW_S": BURST_WINDOW_S,
    "RHO_MAX": RHO_MAX,
    "fixed": "2026-12-02, on the step-trace recordings (planner/sim: cluster.py, host.py)",
}
# the host model of the prediction (Recording.host); "timeline": the one of the 12:31 and
# 12:41 figures (0.932, 0.692), before the saturated machine's share was measured
HOST_MODEL = "runnable"
PROFILE_MARK = "@profile@"  # the profile's path in recorded flags (the recording's own)
MIN_SERVED = 100  # requests served while queued, to trust their CPU per request


def staircase(seed: int, rates: tuple = RATES, phases: tuple = PHASES) -> Trace:
    """Poisson arrivals at each of ``rates`` for its ``phases``; prompt and output lengths
    as in Trace.step (lognormal around 256 and 16 tokens)."""
    return Trace.staircase(tuple(rates), tuple(phases), seed)


def scaling_flags(model: str, port: int) -> list[str]:
    """sim_vs_real.py's ``pdserve up`` flags with pools of 1..3 and a 200 ms TTFT SLO."""
    ns = argparse.Namespace(
        model=model,
        slo_ttft_ms=SLO_TTFT_MS,
        slo_tpot_ms=SLO_TPOT_MS,
        worker_startup=8.0,
        unready_hold=30.0,
    )
    flags = up_flags(ns, PROFILE_MARK, port)
    for name in ("--prefill-max", "--decode-max"):
        flags[flags.index(name) + 1] = str(POOL_MAX)
    # the eager forward: what ``pdserve profile`` times, and a start-up of seconds, not the
    # minutes torch.compile takes on 2 shared cores (scale-ups land inside the trace).
    # --max-starting as up defaults it on this host, written out: the replay mirrors it
    return [*flags, "--enforce-eager", "--max-starting", str(default_max_starting())]


def with_profile(flags: list[str], profile: Path) -> list[str]:
    return [str(profile) if f == PROFILE_MARK else f for f in flags]


def record_real(
    work: Path, model: str, seed: int, profile: Path, shape: dict, extra: dict, zygote: bool
) -> dict:
    """Run the trace (``shape``: rates, phases, drain_s) against ``pdserve up``; keep
    real.json, up.log and meta.json in work. ``zygote``: the workers' cores fork from a
    core zygote, as ``pdserve up`` ships (an added worker starts in ~2 s, not ~10)."""
    port = 18000 + os.getpid() % 1000
    flags = scaling_flags(model, port)
    trace = staircase(seed, shape["rates"], shape["phases"])
    before, date = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    # not polite: the other sessions on the shared cores keep their autogroups at nice 0
    # (whatever their processes' nice), so ours, lowered to 10, got a tenth of their share
    # and the engines ~2% of a core (the first calibration attempt, 12:08, never finished)
    drain_s = float(shape["drain_s"])
    real = run_real(
        with_profile(flags, profile), port, trace, drain_s, work, polite=False, zygote=zygote
    )
    meta = {
        "date": date,
        "seed": seed,
        "rates": list(shape["rates"]),
        "phases": list(shape["phases"]),
        "drain_s": drain_s,
        "flags": flags,
        "core_zygote": zygote,
        "load_average_before_after": [list(before), list(os.getloadavg())],
        "real": {k: getattr(real, k) for k in RUN_FIELDS},
        **extra,
    }
    (work / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


# Recordings keep the flags they ran with: `up --routing` became `--picker` (docs/cli.md).
PICKER_OF_ROUTING = {"prefix": "max-score", "round-robin": "round-robin"}


def current_flags(recorded: list[str]) -> list[str]:
    """A recording's ``pdserve up`` flags in today's names."""
    flags = list(recorded)
    if "--routing" in flags:
        i = flags.index("--routing")
        flags[i : i + 2] = ["--picker", PICKER_OF_ROUTING[flags[i + 1]]]
    return flags


class Recording:
    """A recorded run of the staircase (calibration or scored) read back from its directory."""

    def __init__(self, work: Path) -> None:
        self.dir = work
        self.meta = json.loads((work / "meta.json").read_text())
        self.dump = json.loads((work / "real.json").read_text())
        self.trace = staircase(int(self.meta["seed"]), self.meta["rates"], self.meta["phases"])
        self.end_s = self.trace.duration_s + float(self.meta["drain_s"])
        ttft = self.dump["ttft"]
        self.ttft_all = np.array([np.nan if x is None else x for x in ttft], dtype=float)

    @property
    def core_zygote(self) -> bool:
        """Whether its cores forked from a core zygote (recordings before the option: no)."""
        return bool(self.meta.get("core_zygote", False))

    def host(self, profile: Profile, model: str = "runnable") -> Host:
        """The host model measured in this run. ``model``: "timeline" is sim_vs_real.py's
        (the other jobs per 0.5 s as CFS groups of what they used, the serving path as
        measured beside the prefill's CPU time); "runnable" (``HOST_MODEL``) has the other
        jobs as the always-runnable threads that left a prefill engine with a queue the
        share of a core it got in this run, and the serving path consistent with the idle
        probe (sim_vs_real_host.runnable_threads, probe_consistent)."""
        host = measure_host(self.dump, profile, int(self.trace.arrival.size), self.end_s)
        if model == "timeline":
            return host
        share = self.runnable_share(host)["share"]
        return probe_consistent(runnable_threads(host, share), self.dump, profile)

    def prefill_cost(self) -> dict:
        """The prefill engines' CPU per request served while queued over the profile's
        (sim_vs_real_host.backlogged_cost); 1 under MIN_SERVED requests so measured."""
        profile = self.config(self.dir / "profile.json").profile
        ratio, served = backlogged_cost(
            self.dump,
            self.trace.arrival,
            self.ttft_all,
            self.trace.prompt.astype(float),
            self.end_s,
            profile,
        )
        return {
            "ratio": ratio if served >= MIN_SERVED else 1.0,
            "measured": round(ratio, 3),
            "served_queued": served,
        }

    def runnable_share(self, host: Host) -> dict:
        """A prefill engine's share of a core while it had a queue (sim_vs_real_host), and
        the engine-seconds it was measured over; under MIN_BACKLOG_S of them (no queue
        built), a starting worker's (also always runnable: imports, weights, warm-up)."""
        share, seconds = backlogged_share(self.dump, self.trace.arrival, self.ttft_all, self.end_s)
        if seconds < MIN_BACKLOG_S:
            return {
                "share": host.startup_cores,
                "source": "starting workers",
                "backlog_engine_s": round(seconds, 1),
            }
        return {
            "share": share,
            "source": "prefill engines with a queue",
            "backlog_engine_s": round(seconds, 1),
        }

    def args(self, profile: Path) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        up_arguments(parser)
        return parser.parse_args(with_profile(current_flags(self.meta["flags"]), profile))

    def config(self, profile: Path):  # type: ignore[no-untyped-def]
        return config_from_args(self.args(profile))

    def work_cpu(self) -> dict[str, float]:
        """The CPU the run's work took: the whole machine over the run, and the engine
        threads per request served (/proc samples in real.json). The same requests cost
        159-239 CPU-s in runs minutes apart on this host (bench/sim_vs_real_repro.py)."""
        cpu = self.dump["cpu"]
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        for sample in cpu:
            for key, value in sample.items():
                if key.endswith("/engine"):
                    first.setdefault(key, value)
                    last[key] = value
        served = int(np.isfinite(self.ttft_all).sum())
        engines = sum(last[k] - first[k] for k in last)
        return {
            "machine_cpu_s": round(cpu[-1]["machine"] - cpu[0]["machine"], 1),
            "engine_cpu_ms_per_request": round(1000 * engines / max(served, 1), 2),
        }

    @property
    def max_starting(self) -> int:
        """Workers its autoscaler started at once (recordings before the flag: no cap)."""
        return self.args(self.dir / "profile.json").max_starting or 0


def predict(
    scored: Recording,
    calibration: Recording,
    hindsight: bool = False,
    model: str | None = None,
    speed: float = 1.0,
) -> SimReplay:
    """The scored trace in the simulator, on the calibration's host, start-up and profile
    (``hindsight``: on the scored run's own host and start-up instead, for comparison;
    ``speed``: every engine cost times this, the host's speed as the scored run found it,
    also hindsight)."""
    profile = calibration.dir / "profile.json"
    cfg = scored.config(profile)
    source = scored if hindsight else calibration
    startup = float(source.meta["real"]["startup_s"])
    model = HOST_MODEL if model is None else model
    host = source.host(cfg.profile, model)
    drain_s = float(scored.meta["drain_s"])
    truth = None
    if model == "runnable":  # a prefill's CPU as measured while queued, where enough were
        truth = scaled_prefill(cfg.profile, source.prefill_cost()["ratio"])
    if speed != 1.0:
        truth = slowed_engines(truth or cfg.profile, speed)
    return replay(
        scored.trace,
        cfg,
        (1, 1),
        startup,
        INTERVAL_S,
        drain_s,
        host=host,
        truth=truth,
        max_starting=scored.max_starting,
    )


def scaled_prefill(profile: Profile, ratio: float) -> Profile:
    """``profile`` with every prefill cost ``ratio`` times the profile's."""
    p = profile.prefill
    prefill = replace(
        p,
        chunk_overhead_s=p.chunk_overhead_s * ratio,
        tokens_per_s=p.tokens_per_s / ratio,
        attention_s_per_token_sq=p.attention_s_per_token_sq * ratio,
    )
    return replace(profile, prefill=prefill)


def slowed_engines(profile: Profile, factor: float) -> Profile:
    """``profile`` with every engine cost, prefill and decode, ``factor`` times longer."""
    d = profile.decode
    decode = replace(
        d,
        step_base_s=d.step_base_s * factor,
        step_per_seq_s=d.step_per_seq_s * factor,
        step_per_kv_token_s=d.step_per_kv_token_s * factor,
    )
    return replace(scaled_prefill(profile, factor), decode=decode)


def speed_hindsight(scored: Recording, calibration: Recording) -> dict:
    """The prediction with one number from the scored run: the engine CPU its requests
    took over the calibration's (the host's speed, which moved x0.87-1.33 between runs
    five minutes apart). Not the prediction: how much of its error is that number."""
    ratio = (
        scored.work_cpu()["engine_cpu_ms_per_request"]
        / calibration.work_cpu()["engine_cpu_ms_per_request"]
    )
    sim = predict(scored, calibration, speed=ratio)
    key = "sim_vs_real_ttft_p90_error_scaling"
    return {"engine_speed_ratio": round(ratio, 3), key: scaling_error(scored, sim, calibration)}


def scaling_error(scored: Recording, sim: SimReplay, calibration: Recording) -> float:
    """``sim``'s TTFT p90 error against ``scored`` in the 10 s windows that either side's
    scale events touch, each as long as the calibration's start-up: as ``score`` has it."""
    events = win.real_events(scored.dump["log"], scored.end_s) + win.sim_events(sim.timeline)
    return window_error(scored, events, calibration, sim.arrival, sim.ttft_by_arrival)


def window_error(
    scored: Recording, events: list, predictor: Recording, arrival: np.ndarray, ttft: np.ndarray
) -> float:
    """A prediction's (``arrival``, ``ttft``) TTFT p90 error against ``scored`` in the 10 s
    windows ``events`` touch, each as long as the ``predictor`` run's start-up (the
    simulator built from it, or its own TTFTs: bench/sim_vs_real_repro.py)."""
    startup = float(predictor.meta["real"]["startup_s"])
    hit = win.scaling_windows(events, startup, scored.end_s)
    split = win.split_errors(scored.trace.arrival, scored.ttft_all, arrival, ttft, hit)
    return split["sim_vs_real_ttft_p90_error_scaling"]


def score(scored: Recording, calibration: Recording) -> dict:
    sim = predict(scored, calibration)
    real_meta = scored.meta["real"]
    real_ok = scored.ttft_all[np.isfinite(scored.ttft_all)]
    real_ev = win.real_events(scored.dump["log"], scored.end_s)
    sim_ev = win.sim_events(sim.timeline)
    startup = float(calibration.meta["real"]["startup_s"])
    hit = win.scaling_windows(real_ev + sim_ev, startup, scored.end_s)
    split = win.split_errors(
        scored.trace.arrival, scored.ttft_all, sim.arrival, sim.ttft_by_arrival, hit
    )
    real_stats = stats(real_ok, float(real_meta["replica_s"]))
    sim_stats = stats(sim.ttft, sim.replica_s)
    look = predict(scored, calibration, hindsight=True)
    hindsight = stats(look.ttft, look.replica_s)
    hindsight["ttft_p90_error"] = win.error(win.p90(look.ttft), win.p90(real_ok))
    cfg_profile = scored.config(calibration.dir / "profile.json").profile
    # the same prediction under the host model of the first scored figures (0.932, 0.692)
    before = predict(scored, calibration, model="timeline")
    split_before = win.split_errors(
        scored.trace.arrival, scored.ttft_all, before.arrival, before.ttft_by_arrival, hit
    )
    return {
        "sim_vs_real_ttft_p90_error": win.error(win.p90(sim.ttft), win.p90(real_ok)),
        **{k: v for k, v in split.items() if k.startswith("sim_vs_real")},
        "sim_vs_real_replica_s_error": win.error(sim.replica_s, float(real_meta["replica_s"])),
        "scale_events": {"real": win.count(real_ev), "sim": win.count(sim_ev)},
        "scale_event_times": {
            "real": [[round(e.t, 1), e.pool, e.delta] for e in real_ev],
            "sim": [[round(e.t, 1), e.pool, e.delta] for e in sim_ev],
        },
        **{k: v for k, v in split.items() if not k.startswith("sim_vs_real")},
        "real": {**real_stats, "failed": real_meta["failed"], "errors": real_meta["errors"]},
        "sim": sim_stats,
        "sim_hindsight": hindsight,  # the scored run's own host: not the prediction
        "sim_speed_hindsight": speed_hindsight(scored, calibration),  # its speed: nor this
        "sim_timeline_host": {  # the host model before "runnable" (HOST_MODEL), same windows
            **{k: v for k, v in split_before.items() if k.startswith("sim_vs_real")},
            "ttft_p90_error": win.error(win.p90(before.ttft), win.p90(real_ok)),
        },
        "calibration": _about_calibration(calibration, cfg_profile),
        "scored": {
            "recording": str(scored.dir),
            "date": scored.meta["date"],
            "seed": scored.meta["seed"],
            "startup_s_observed": real_meta["startup_s"],
            "load_average_before_after": scored.meta["load_average_before_after"],
        },
        "constants": CONSTANTS,
        "trace": {
            "rates_rps": scored.meta["rates"],
            "phases_s": scored.meta["phases"],
            "requests": int(scored.trace.arrival.size),
            "slo_ttft_ms": SLO_TTFT_MS,
            "pool_max": POOL_MAX,
        },
    }


def _about_calibration(calibration: Recording, profile: Profile) -> dict:
    meta = calibration.meta
    n = int(calibration.trace.arrival.size)
    measured = measure_host(calibration.dump, profile, n, calibration.end_s)
    share = calibration.runnable_share(measured)
    host = calibration.host(profile)
    return {
        "recording": calibration.dir.name,
        "date": meta["date"],
        "seed": meta["seed"],
        "startup_s": round(float(meta["real"]["startup_s"]), 2),
        "startup_source": meta["real"]["startup_source"],
        "core_zygote": calibration.core_zygote,
        "load_average": meta["load_average_before_after"][0][0],
        "host_model": HOST_MODEL,
        "runnable_share": {**share, "share": round(share["share"], 4)},
        "background_threads": round(host.background_groups[0][0][0], 2)
        if host.background_groups
        else 0.0,
        "probe_slow": round(host.path_slow, 2),
        "prefill_cost": calibration.prefill_cost(),
        "host": describe(host),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.calibrate:
        work = Path(
            args.work_dir
            or RECORDINGS / time.strftime("%Y-%m-%d-%H%M-scaling-calibration", time.gmtime())
        )
        work.mkdir(parents=True, exist_ok=True)
        if args.profile:  # measured before (engine thread CPU time: little moved by load)
            shutil.copyfile(args.profile, work / "profile.json")
        else:
            measure_profile(args.model, str(work / "profile.json"), quick=True)
        shape = {
            "rates": [r * args.rate_scale for r in RATES],
            "phases": QUICK_PHASES if args.quick else PHASES,
            "drain_s": QUICK_DRAIN_S if args.quick else DRAIN_S,
        }
        meta = record_real(
            work,
            args.model,
            CALIBRATION_SEED,
            work / "profile.json",
            shape,
            {"role": "calibration", "quick": args.quick},
            args.core_zygote,
        )
        if not args.work_dir:  # a recording of its own making: its manifest, as every one has
            given = sys.argv[1:] if argv is None else argv
            manifest.write(work, shlex.join(["python", "bench/sim_vs_real_scaling.py", *given]))
        print(json.dumps({"calibration": str(work), **meta["real"]}))
        return 0
    calibration = Recording(Path(args.calibration))
    if args.replay:
        scored = Recording(Path(args.replay))
        calibration = Recording(_calibration_dir(scored.meta))
    else:
        work = Path(args.work_dir or tempfile.mkdtemp(prefix="sim-vs-real-scaling-"))
        work.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(calibration.dir / "profile.json", work / "profile.json")
        extra = {
            "role": "scored",
            "calibration": calibration.dir.name,
            "calibration_dir": str(calibration.dir.resolve()),
        }
        # the calibration's trace (rates, phases, drain), with other requests (the seed)
        shape = {k: calibration.meta[k] for k in ("rates", "phases", "drain_s")}
        # as the calibration ran
        record_real(
            work,
            args.model,
            SCORED_SEED,
            work / "profile.json",
            shape,
            extra,
            calibration.core_zygote,
        )
        scored = Recording(work)
    out = score(scored, calibration)
    out["load_average_now"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))
    return 0


def _calibration_dir(meta: dict) -> Path:
    """The calibration a scored run was predicted from: RECORDINGS/NAME, else the
    path it was recorded with (a calibration kept elsewhere, e.g. a --quick one)."""
    kept = RECORDINGS / meta["calibration"]
    return kept if kept.is_dir() else Path(meta.get("calibration_dir", kept))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default=os.environ.get("PDSERVE_TINY_MODEL", ""),
        help="model directory (default: $PDSERVE_TINY_MODEL)",
    )
    ap.add_argument("--calibrate", action="store_true", help="record a calibration run")
    ap.add_argument("--calibration", default=str(CALIBRATION), help="the calibration recording")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="--calibrate: the steps a quarter as long (an end-to-end check)",
    )
    ap.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="--calibrate: the rates x this (1: 1/5/10/1 req/s, for a machine at "
        "load average ~18; ~2 on a quiet one, see docs/autoscaling.md); a "
        "scored run takes its calibration's trace",
    )
    ap.add_argument(
        "--profile",
        default="",
        help="--calibrate: this profile instead of measuring one (pdserve profile "
        "--clock cpu, as bench/sim_vs_real.py measures it)",
    )
    ap.add_argument(
        "--core-zygote",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--calibrate: the workers' cores fork from pdserve up's core zygote, "
        "as shipped (--no-core-zygote: a process per core, as a pod starts; "
        "the recordings before 2026-12-04); a scored run does as its "
        "calibration did",
    )
    ap.add_argument("--work-dir", default="", help="where the run is recorded")
    ap.add_argument("--replay", default="", help="a scored recording: re-run the prediction")
    args = ap.parse_args(argv)
    if not args.replay and not args.model:
        ap.error("--model (or $PDSERVE_TINY_MODEL) is required: `pdserve tiny-model DIR`")
    return args


if __name__ == "__main__":
    sys.exit(main())
