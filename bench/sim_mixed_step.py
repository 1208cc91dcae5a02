"""Is the simulator's colocated step what the engine does? One mixed step, timed.

    python bench/sim_mixed_step.py [--quick] [--model DIR]

A colocated replica (no prefill pool) runs steps that carry its decode batch and a
prefill chunk together (engine/scheduler.py: running sequences take one token each
of ``max_num_batched_tokens``, a waiting prompt chunks what is left). The step
simulator (planner/sim/goodput.py) charges such a step

    decode.step_time(B, C) + n / prefill.tokens_per_s + attention_s_per_token_sq * n^2

(the decode step's fixed cost paid once, no second ``chunk_overhead_s``). Here the real
engine (tiny model, CPU, one torch thread, compiled as a worker runs it) is profiled
the way ``pdserve profile --clock cpu`` does, then B sequences at context C are put in
decode and a prompt of n tokens added: the next ``engine.step()`` is that mixed step,
timed by the engine thread's CPU clock (waiting for a core not counted), best of
``--repeats``. Beside the additive model, the two other readings: the larger of the two
(the chunk hides the decode) and two separate steps (decode step + a whole prefill
chunk with its own overhead). Prints one JSON line last with the additive model's
error per point and its mean; writes bench/out/sim_mixed_step.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from figures import pyplot, save
from lib import flags

from pdserve.planner.capacity import Profile
from pdserve.planner.profile import EngineProbe, measure


class MixedProbe(EngineProbe):
    def mixed_step_seconds(self, batch: int, context_tokens: int, chunk: int) -> tuple[float, int]:
        """One step carrying ``batch`` decodes at ``context_tokens`` and a new prompt's
        first chunk; returns its time and the prefill tokens it carried."""
        ids = [self._add(context_tokens, 16) for _ in range(batch)]
        self._step_until(ids, -(-batch * context_tokens // self.chunk_tokens))
        rid = self._add(chunk, 2)
        start = self.clock()
        self.engine.step()
        elapsed = self.clock() - start
        carried = self.engine.requests[rid].num_computed_tokens
        if carried == 0:
            raise RuntimeError(f"the step carried no prefill (batch {batch}, chunk {chunk})")
        for r in [*ids, rid]:
            self.engine.abort(r)
        return elapsed, carried


def predictions(prof: Profile, b: int, c: int, n: int) -> dict[str, float]:
    p, d = prof.prefill, prof.decode
    chunk = n / p.tokens_per_s + p.attention_s_per_token_sq * n * n
    dec = d.step_time(b, c)
    return {
        "additive": dec + chunk,  # what planner/sim/goodput.py charges
        "max": max(dec, p.chunk_overhead_s + chunk),
        "two_steps": dec + p.chunk_overhead_s + chunk,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pdserve.engine.engine_args import add_engine_arguments, engine_config_from_args
    from pdserve.engine.llm_engine import LLMEngine

    ep = argparse.ArgumentParser()
    add_engine_arguments(ep)
    eargs = ep.parse_args(["--model", args.model, "--device", "cpu", "--cpu-threads", "1"])
    engine = LLMEngine(engine_config_from_args(eargs))
    probe = MixedProbe(engine, clock=time.thread_time)
    lengths, batches, contexts = (
        ([64, 256, 512], [1, 4], [64, 128])
        if args.quick
        else ([64, 128, 256, 512, 1024], [1, 4, 8], [64, 128])
    )
    prof = measure(probe, lengths, batches, contexts, repeats=args.repeats)
    grid = [(b, c, n) for b in (1, 8) for c in (64, 256) for n in (128, 512, 1024)]
    if args.quick:
        grid = [(1, 64, 256), (8, 128, 512)]
    rows = []
    for b, c, n in grid:
        probe.mixed_step_seconds(b, c, n)  # a new shape may compile once: not a step's cost
        got = [probe.mixed_step_seconds(b, c, n) for _ in range(args.repeats)]
        seconds, carried = min(got)
        # the same two parts timed alone, beside the profile's fit of them
        dec = min(probe.decode_step_seconds(b, c) for _ in range(args.repeats))
        alone = min(probe.prefill_seconds(carried) for _ in range(args.repeats))
        pred = predictions(prof, b, c, carried)
        rule = dec + alone - prof.prefill.chunk_overhead_s  # the rule on timed parts
        rows.append(
            {
                "batch": b,
                "context": c,
                "chunk": carried,
                "measured_ms": round(seconds * 1e3, 3),
                "decode_alone_ms": round(dec * 1e3, 3),
                "chunk_alone_ms": round(alone * 1e3, 3),
                **{f"{k}_ms": round(v * 1e3, 3) for k, v in pred.items()},
                "additive_error": round(pred["additive"] / seconds - 1, 3),
                "rule_on_timed_parts_error": round(rule / seconds - 1, 3),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr)
    errors = np.array([r["additive_error"] for r in rows])
    parts = np.array([r["rule_on_timed_parts_error"] for r in rows])
    out = {
        "mixed_step_additive_error_mean": round(float(errors.mean()), 3),
        "mixed_step_additive_error_abs_max": round(float(np.abs(errors).max()), 3),
        "mixed_step_rule_on_timed_parts_error_mean": round(float(parts.mean()), 3),
        "profile": {
            "prefill_tokens_per_s": round(prof.prefill.tokens_per_s, 1),
            "chunk_overhead_ms": round(prof.prefill.chunk_overhead_s * 1e3, 3),
            "decode_step_base_ms": round(prof.decode.step_base_s * 1e3, 3),
        },
        "rows": rows,
        "load_average": round(os.getloadavg()[0], 2),
        "quick": args.quick,
    }
    if not args.no_plot:
        print(f"plot: {plot(rows, args.out_dir)}", file=sys.stderr)
    print(json.dumps(out))
    return 0


def plot(rows: list[dict], out_dir: str) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 5))
    measured = [r["measured_ms"] for r in rows]
    for key, mark in (("additive", "o"), ("max", "v"), ("two_steps", "s")):
        ax.scatter(measured, [r[f"{key}_ms"] for r in rows], marker=mark, label=key)
    top = max(max(measured), *(r["two_steps_ms"] for r in rows)) * 1.1
    ax.plot([0, top], [0, top], "k--", lw=0.8)
    ax.set(
        xlabel="measured mixed step (ms, engine CPU)",
        ylabel="model (ms)",
        title="decode batch + prefill chunk in one step",
    )
    ax.legend()
    path = Path(out_dir) / "sim_mixed_step.png"
    save(fig, path, 90)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = flags.parser(__doc__, "2 points, a coarse profile")
    ap.add_argument("--model", default=os.environ.get("PDSERVE_TINY_MODEL", ""))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "out"))
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if not args.model:
        ap.error("--model (or $PDSERVE_TINY_MODEL) is required: `pdserve tiny-model DIR`")
    return args


if __name__ == "__main__":
    sys.exit(main())
