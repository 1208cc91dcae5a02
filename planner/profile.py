"""``pdserve profile``: measure per-replica capacities and store them as a profile JSON.

The measuring code talks to a small :class:`Probe` interface (time one prefill of
L tokens; time one decode step of B sequences at context C), so it is tested with
a fake and runs on the real engine through :class:`EngineProbe`. The fits are
least squares of the cost model in ``capacity.py``; negative coefficients (noise)
are dropped and the fit repeated without them.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pdserve.planner.capacity import DecodeProfile, PrefillProfile, Profile, save_profile

log = logging.getLogger(__name__)


class Probe(Protocol):
    chunk_tokens: int  # the engine's token budget per step
    max_num_seqs: int
    kv_capacity_tokens: int

    def prefill_seconds(self, prompt_tokens: int) -> float:
        """Wall time to prefill one prompt of this length on an idle replica."""

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        """Mean wall time of one decode step over ``batch`` sequences of this context."""


def measure(
    probe: Probe,
    prompt_lengths: list[int],
    batches: list[int],
    contexts: list[int],
    *,
    model: str = "",
    hardware: str = "",
    repeats: int = 3,
    source: str = "",
) -> Profile:
    """Time the probe over a grid and fit the profile's coefficients."""
    if not prompt_lengths or not batches or not contexts or repeats < 1:
        raise ValueError("need at least one prompt length, batch, context and repeat")
    # the first calls pay one-time costs (kernel load, allocator growth): not a cost per step
    probe.prefill_seconds(prompt_lengths[0])
    probe.decode_step_seconds(batches[0], contexts[0])
    lengths, times = [], []
    for n in prompt_lengths:
        lengths.append(n)
        times.append(min(probe.prefill_seconds(n) for _ in range(repeats)))
    grid, step_times = [], []
    for b in batches:
        for c in contexts:
            grid.append((b, c))
            step_times.append(min(probe.decode_step_seconds(b, c) for _ in range(repeats)))
    prefill = fit_prefill(lengths, times, probe.chunk_tokens)
    decode = fit_decode(grid, step_times, probe.max_num_seqs, probe.kv_capacity_tokens)
    grid_text = f"prompts {prompt_lengths}, batches {batches} x contexts {contexts}"
    prefill = replace(prefill, source=f"{source}; fit to prefill times of {prompt_lengths}")
    decode = replace(decode, source=f"{source}; fit to step times of {grid_text}")
    return Profile(model=model, hardware=hardware, prefill=prefill, decode=decode, source=source)


def fit_prefill(lengths: list[int], seconds: list[float], chunk_tokens: int) -> PrefillProfile:
    columns: dict[str, list[float]] = {
        "chunk_overhead_s": [float(max(1, math.ceil(n / chunk_tokens))) for n in lengths],
        "inv_tokens_per_s": [float(n) for n in lengths],
        "attention_s_per_token_sq": [float(n) ** 2 for n in lengths],
    }
    coef = _nonnegative_fit(columns, seconds, keep="inv_tokens_per_s")
    return PrefillProfile(
        chunk_overhead_s=coef["chunk_overhead_s"],
        tokens_per_s=1.0 / coef["inv_tokens_per_s"],
        chunk_tokens=chunk_tokens,
        attention_s_per_token_sq=coef["attention_s_per_token_sq"],
    )


def fit_decode(
    grid: list[tuple[int, int]], seconds: list[float], max_num_seqs: int, kv_tokens: int
) -> DecodeProfile:
    columns: dict[str, list[float]] = {
        "step_base_s": [1.0] * len(grid),
        "step_per_seq_s": [float(b) for b, _ in grid],
        "step_per_kv_token_s": [float(b * c) for b, c in grid],
    }
    coef = _nonnegative_fit(columns, seconds, keep="step_base_s")
    return DecodeProfile(
        step_base_s=coef["step_base_s"],
        step_per_seq_s=coef["step_per_seq_s"],
        step_per_kv_token_s=coef["step_per_kv_token_s"],
        max_num_seqs=max_num_seqs,
        kv_capacity_tokens=kv_tokens,
    )


def _nonnegative_fit(
    columns: dict[str, list[float]], y: list[float], keep: str
) -> dict[str, float]:
    """Least squares; drop the most negative coefficient and refit until none is negative.
    When ``keep`` itself comes out non-positive (a curve so steep that a higher-order term
    takes all of it, e.g. attention over a long prefill), the last other column in
    ``columns`` order (the highest order) is dropped and the fit is tried again."""
    active = list(columns)
    while True:
        a = np.array([columns[k] for k in active], dtype=float).T
        sol, *_ = np.linalg.lstsq(a, np.array(y, dtype=float), rcond=None)
        coef = dict(zip(active, (float(x) for x in sol), strict=True))
        worst = min((k for k in active if k != keep), key=coef.__getitem__, default=None)
        if worst is not None and coef[worst] < 0:
            active.remove(worst)
        elif coef[keep] <= 0 and worst is not None:
            active.remove([k for k in active if k != keep][-1])
        else:
            break
    if coef[keep] <= 0:
        raise ValueError(f"measurements give a non-positive {keep}: too noisy to fit")
    return {k: max(0.0, coef.get(k, 0.0)) for k in columns}


class EngineProbe:
    """Times the real engine (``pdserve.engine.llm_engine.LLMEngine``) in-process."""

    def __init__(self, engine: Any, seed: int = 0, clock: Any = time.perf_counter) -> None:
        self.engine = engine
        self.clock = clock  # perf_counter: wall time; thread_time: this thread's CPU time
        self.chunk_tokens = engine.config.max_num_batched_tokens
        self.max_num_seqs = engine.config.max_num_seqs
        self.kv_capacity_tokens = engine.kv.num_blocks * engine.config.block_size
        self._rng = np.random.default_rng(seed)
        self._n = 0

    def _prompt(self, n: int) -> list[int]:
        # random ids: no prefix-cache hits between probes
        return [int(x) for x in self._rng.integers(10, self.engine.vocab_size, n)]

    def _add(self, n: int, max_tokens: int) -> str:
        from pdserve.protocol.sampling_params import SamplingParams

        self._n += 1
        rid = f"profile-{self._n}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, self._prompt(n), params)
        return rid

    def prefill_seconds(self, prompt_tokens: int) -> float:
        """Time to the first token of one prompt (prefill plus one sample), then abort it."""
        rid = self._add(prompt_tokens, 2)
        start = self.clock()
        self._step_until([rid], math.ceil(prompt_tokens / self.chunk_tokens))
        elapsed = self.clock() - start
        self.engine.abort(rid)
        return elapsed

    def decode_step_seconds(self, batch: int, context_tokens: int, steps: int = 4) -> float:
        ids = [self._add(context_tokens, steps + 8) for _ in range(batch)]
        self._step_until(ids, math.ceil(batch * context_tokens / self.chunk_tokens))
        start = self.clock()
        for _ in range(steps):
            self.engine.step()
        elapsed = (self.clock() - start) / steps
        for r in ids:
            self.engine.abort(r)
        return elapsed

    def _step_until(self, ids: list[str], expected_steps: int) -> None:
        """Step until every request has its first output token; bounded, never hangs."""
        for _ in range(4 * expected_steps + 16):
            if all(self.engine.requests[r].output_token_ids for r in ids):
                return
            self.engine.step()
        for r in ids:
            self.engine.abort(r)
        raise RuntimeError(
            f"engine produced no first token for {len(ids)} request(s) within "
            f"{4 * expected_steps + 16} steps"
        )


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere since this module was
    imported, which misses the interpreter's own start)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        started = int(stat[stat.rindex(")") + 2 :].split()[19]) / os.sysconf("SC_CLK_TCK")
        return float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


def measured_source(hardware: str, repeats: int) -> str:
    when = time.strftime("%Y-%m-%d", time.gmtime())
    where = hardware or f"{platform.machine()}, {os.cpu_count()} CPUs"
    return f"measured: pdserve profile on {platform.node()} ({where}), {when}, best of {repeats}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdserve.engine.engine_args import add_engine_arguments

    add_engine_arguments(parser)
    parser.add_argument("--out", required=True, help="where to write the profile JSON")
    parser.add_argument("--prompt-lengths", type=_ints, default=[32, 128, 512, 1024])
    parser.add_argument("--batches", type=_ints, default=[1, 4, 16])
    parser.add_argument("--contexts", type=_ints, default=[64, 256])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hardware", default="", help="free text stored in the profile")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time (default); cpu: the engine thread's CPU time, i.e. the "
        "cost without waiting for a busy core (needs --cpu-threads 1: the model then runs on "
        "that thread), for a simulator that shares the cores itself (planner/sim/host.py)",
    )


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.engine_args import engine_config_from_args
    from pdserve.engine.llm_engine import LLMEngine

    if args.clock == "cpu" and args.cpu_threads != 1:
        print(
            "pdserve profile: --clock cpu needs --cpu-threads 1 (the CPU time of other "
            "torch threads is not counted)",
            file=sys.stderr,
        )
        return 2
    engine = LLMEngine(engine_config_from_args(args))
    startup = process_age_s()  # imports, weights load, compile warm-up: a replica's start-up
    probe = EngineProbe(
        engine, clock=time.thread_time if args.clock == "cpu" else time.perf_counter
    )
    try:
        profile = measure(
            probe,
            args.prompt_lengths,
            args.batches,
            args.contexts,
            model=engine.served_model_name,
            hardware=args.hardware,
            repeats=args.repeats,
            source=measured_source(args.hardware, args.repeats)
            + ("; engine thread CPU time, not wall time" if args.clock == "cpu" else ""),
        )
    except (ValueError, RuntimeError) as exc:
        print(f"pdserve profile: {exc}", file=sys.stderr)
        return 1
    profile = replace(
        profile,
        startup_s=round(startup, 2),
        startup_source=f"measured: pdserve profile on {platform.node()}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}: process start to engine ready "
        "(imports, weights load, compile warm-up), once; a worker also starts its HTTP server",
    )
    save_profile(profile, args.out)
    print(f"wrote {args.out}: {profile.to_dict()}")
    return 0


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
