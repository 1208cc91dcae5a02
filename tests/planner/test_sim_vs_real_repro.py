"""The noise floor under the simulator's scaling-window error (bench/sim_vs_real_repro.py):
recorded runs of one trace predicting each other, replayed from
bench/recordings/sim_vs_real_scaling/."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import sim_vs_real_repro as repro
from sim_vs_real_scaling import Recording

pytestmark = pytest.mark.unit

RECORDINGS = Path(__file__).resolve().parents[2] / "bench" / "recordings" / "sim_vs_real_scaling"
# every calibration run of `pdserve up` as it ships (the core zygote, --max-starting 1) on
# a quiet host, seed 11, --rate-scale 2; 17:05 left out (a replay script of ours ran
# beside it). The last three ran after the cores' speed was named as the cause (below).
QUIET = [
    "1636",
    "1641",
    "1646",
    "1655",
    "1714",
    "1724",
    "1912",
    "1922",
    "1931",
    "2030",
    "2035",
    "2039",
]


def _runs(names: list[str]) -> list[str]:
    return [str(RECORDINGS / f"2026-12-04-{n}-scaling-calibration") for n in names]


def _last_json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_run_predicts_itself_exactly() -> None:
    run = Recording(Path(_runs(["1912"])[0]))
    assert repro.pair_errors(run, run, simulate=False) == {"real_vs_real": 0.0}


def test_runs_of_another_trace_are_refused() -> None:
    scored = str(RECORDINGS / "2026-12-04-1917-scaling-scored")  # seed 12: other requests
    with pytest.raises(SystemExit, match="seed"):
        repro.main(["--no-sim", _runs(["1912"])[0], scored])


def test_the_real_service_does_not_reproduce_itself_within_the_goal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Twelve runs of the same requests minutes apart (132 ordered pairs): one run's TTFT
    p90 in the scaling windows misses another's by 0.452 at the median, and only a quarter
    of the pairs are within issue 28's goal (0.25). A simulator built from one run cannot
    be held to a closer figure than the service gives itself (docs/autoscaling.md,
    "The noise floor")."""
    assert repro.main(["--no-sim", *_runs(QUIET)]) == 0
    out = _last_json(capsys)
    floor = out["real_vs_real_ttft_p90_error_scaling"]
    assert floor["pairs"] == 132
    assert floor["median"] == pytest.approx(0.452, abs=0.001)
    assert floor["share_within_goal"] == pytest.approx(0.265, abs=0.001)
    assert floor["median"] > out["goal"]
    assert "sim_vs_real_ttft_p90_error_scaling" not in out  # --no-sim: no simulation
    runs = out["runs"]
    busy = np.array([r["ttft_p90_busy_step_ms"] for r in runs])
    assert busy.max() > 3 * busy.min()  # 46-153 ms at 20 req/s, the same requests
    # ... and the CPU the same work took says which: the line fit on the first nine
    # (p90 = -161.5 + 1.261 x machine CPU-s, residual sd 12.6 ms) was written down before
    # the last three ran, and each of them fell within one residual of it (5, 0, 8 ms)
    cpu = np.array([r["machine_cpu_s"] for r in runs])
    assert np.corrcoef(cpu, busy)[0, 1] > 0.9  # 0.95
    for r in runs[-3:]:
        assert abs(r["ttft_p90_busy_step_ms"] - (-161.5 + 1.261 * r["machine_cpu_s"])) < 12.6


def test_the_simulator_is_scored_on_the_same_pairs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    png = tmp_path / "repro.png"
    assert repro.main(["--plot", str(png), *_runs(["1912", "1922", "1931"])]) == 0
    out = _last_json(capsys)
    real = out["real_vs_real_ttft_p90_error_scaling"]
    sim = out["sim_vs_real_ttft_p90_error_scaling"]
    assert real["pairs"] == sim["pairs"] == 6
    # as replayed under the shipped host model: the simulator from one run is as close to
    # another run as that run's own TTFTs are (0.378 against 0.387 at the median)
    assert sim["median"] == pytest.approx(0.378, abs=0.01)
    assert real["median"] == pytest.approx(0.387, abs=0.001)
    assert png.stat().st_size > 10_000


def test_the_host_speed_is_most_of_a_pairs_error() -> None:
    """19:36 from 19:31: the scored run's engines took 1.33x the CPU per request its
    calibration's had (the same load, five minutes later). Told that one number in
    hindsight, the simulator is within the goal; as predicted it is not."""
    import sim_vs_real_scaling as scaling

    scored = Recording(RECORDINGS / "2026-12-04-1936-scaling-scored")
    calibration = Recording(RECORDINGS / scored.meta["calibration"])
    out = scaling.score(scored, calibration)
    speed = out["sim_speed_hindsight"]
    assert speed["engine_speed_ratio"] == pytest.approx(1.326, abs=0.001)
    assert speed["sim_vs_real_ttft_p90_error_scaling"] < 0.1  # 0.086
    assert out["sim_vs_real_ttft_p90_error_scaling"] == pytest.approx(0.400, abs=0.001)
    # the simulated TTFT was short of the real one: the host had slowed, not the model
    assert out["scaling"]["ttft_p90_sim_s"] < out["scaling"]["ttft_p90_real_s"]


def test_slowed_engines_scale_every_engine_cost() -> None:
    from sim_vs_real_scaling import slowed_engines

    from pdserve.planner.presets import CPU_TINY

    slow = slowed_engines(CPU_TINY, 1.5)
    assert slow.prefill.service_time(256) == pytest.approx(1.5 * CPU_TINY.prefill.service_time(256))
    assert slow.decode.step_time(8, 300) == pytest.approx(1.5 * CPU_TINY.decode.step_time(8, 300))
    assert slow.decode.kv_capacity_tokens == CPU_TINY.decode.kv_capacity_tokens
