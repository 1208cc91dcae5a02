"""The colocated step: what the step simulator charges, and the engine timed against it.

``disagg_goodput_ratio`` rests on what a colocated replica's step costs when it
carries a decode batch and a prefill chunk together. planner/sim/goodput.py charges the
decode step plus the chunk's token and attention cost (one fixed cost); the first
test pins that rule, the second runs ``bench/sim_mixed_step.py --quick`` on the real
engine (tiny model, CPU, engine-thread CPU clock) and checks the path and that a
mixed step costs at least most of its larger part (it does both jobs).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pdserve.planner.capacity import load_profile
from pdserve.planner.sim.goodput import Link, Req, StepSim
from pdserve.testing.loopback import run_bench

pytestmark = pytest.mark.bench

PROFILE = Path(__file__).resolve().parents[2] / "bench/profiles/cpu-tiny-1thread-cputime.json"


def test_a_colocated_step_costs_the_decode_step_plus_the_chunk() -> None:
    prof = load_profile(PROFILE)
    prof = replace(prof, prefill=replace(prof.prefill, chunk_tokens=64))
    p, d = prof.prefill, prof.decode
    sim = StepSim(prof, 0, 1, Link(1, 1e9, 0.0))
    rep = sim.reps[0]
    rep.running = [Req(0.0, 8, 100, done=8, first=0.0, made=1) for _ in range(10)]
    rep.pq.append(Req(0.0, 1000, 10))
    dt = sim._step(0, 0.0)
    n = 64 - 10  # the chunk gets what the decode tokens leave of the budget
    ctx = float(np.mean([r.prompt + r.made for r in rep.running]) - 1)  # before the step
    expected = d.step_time(10, ctx) + n / p.tokens_per_s + p.attention_s_per_token_sq * n * n
    assert dt == pytest.approx(expected)
    # without a decode batch the chunk pays its own fixed cost
    alone = StepSim(prof, 0, 1, Link(1, 1e9, 0.0))
    alone.reps[0].pq.append(Req(0.0, 1000, 10))
    dt_alone = alone._step(0, 0.0)
    assert dt_alone == pytest.approx(
        p.chunk_overhead_s + 64 / p.tokens_per_s + p.attention_s_per_token_sq * 64 * 64
    )


@pytest.mark.timeout(240)
def test_sim_mixed_step_quick(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ("--quick", "--model", str(tiny_model_dir), "--out-dir", str(tmp_path))
    result = run_bench("sim_mixed_step.py", *args, timeout=230)
    rows = result["rows"]
    assert len(rows) == 2
    for r in rows:
        assert r["chunk"] > 0 and r["measured_ms"] > 0
        # one step does the decode and the chunk: never much less than the larger part
        # (0.65 of it was seen once in a full suite run, with the suite's own load beside
        # the quick form's few timed steps; the sanity bound leaves room for that)
        assert r["measured_ms"] >= 0.5 * max(r["decode_alone_ms"], r["chunk_alone_ms"]), r
        assert np.isfinite(r["additive_error"]) and np.isfinite(r["rule_on_timed_parts_error"])
    assert (tmp_path / "sim_mixed_step.png").stat().st_size > 0


def test_the_fluid_ceiling_of_the_long_prompt_scenario() -> None:
    """sim_mix.fluid_ceiling: what the best P:D mix can gain over colocation from mean
    rates, when chunked prefill costs a colocated replica exactly the prompts' prefill."""
    from sim_mix import fluid_ceiling

    from pdserve.planner.presets import H100_LLAMA3_8B as H100

    got = fluid_ceiling(H100, 8000, 500, 0.012)  # simulate.py's long prompts, 12 ms TPOT
    assert got == pytest.approx(1.65, abs=0.01)
    x = 0.012 / (0.012 - H100.decode.step_base_s)  # T / (T - a): the bound
    assert got < fluid_ceiling(H100, 8000, 150, 0.012) < fluid_ceiling(H100, 8000, 5, 0.012) < x
    assert fluid_ceiling(H100, 8000, 5, 0.012) == pytest.approx(x, rel=0.02)
    assert fluid_ceiling(H100, 8000, 500, 0.005) == float("inf")  # TPOT under one step
