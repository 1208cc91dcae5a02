"""`pdserve up` start-up with the core zygote (the default) against a process per core.

Each repetition starts ``pdserve up --model tiny --enforce-eager`` (eager: a compile's
warm-up would dwarf what the zygote changes), once each way in turn (zygote, plain, zygote,
plain, ...), and times it from launch to the "pdserve is up" line (every worker healthy,
the router routing). One JSON line: per way, the median and range of seconds to ready, and
the ratio plain / zygote. (CPU is not reported: a core that dies with its parent is reaped
by init, and its CPU never reaches this process's rusage.)

    python bench/up_startup_zygote.py [--reps 3] [--prefill 1] [--decode 2] [--quick]
    python bench/up_startup.py --zygote [--reps 3] ...   (the same)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from pdserve.testing.up import running_up

WAYS = {"zygote": [], "plain": ["--no-core-zygote"]}


def start_once(extra: list[str], args: argparse.Namespace, port: int) -> float:
    """Seconds from launch to ready."""
    flags = ["--enforce-eager", "--prefill", str(args.prefill), "--decode", str(args.decode)]
    flags += ["--port", str(port), "--worker-port-base", str(port + 100), *extra]
    # none from the caller (a test session's): the cluster's own, as shipped
    environ = {k: v for k, v in os.environ.items() if k != "PDSERVE_CORE_ZYGOTE"}
    with running_up("tiny", *flags, env=environ, timeout=600, grace_s=60) as up:
        return up.ready_s


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--port", type=int, default=18700)
    p.add_argument("--quick", action="store_true", help="one repetition each way")
    args = p.parse_args(argv)
    reps = 1 if args.quick else args.reps
    ready: dict[str, list[float]] = {w: [] for w in WAYS}
    for rep in range(reps):
        for way, extra in WAYS.items():
            r = start_once(extra, args, args.port)
            ready[way].append(r)
            print(
                f"up_startup: rep {rep + 1}/{reps} {way}: ready {r:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    out = {
        "workers": args.prefill + args.decode,
        "reps": reps,
        **{f"ready_s_{w}": summary(v) for w, v in ready.items()},
        "ready_ratio_plain_over_zygote": round(
            statistics.median(ready["plain"]) / statistics.median(ready["zygote"]), 2
        ),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
