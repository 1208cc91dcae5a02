"""``bench/router_throughput.py --quick`` end to end: a ``pdserve router`` process in front
of the tests' fake workers (another process), decode-direct, full P/D and full P/D with the
decode worker calling the prefill worker (pd-chain), token-id and text prompts; requests/s,
the router's CPU per request from /proc, added latency."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from router_throughput import QUICK_REQUESTS, compare, summarise

from pdserve.testing.loopback import run_bench

pytestmark = pytest.mark.bench

# The paths and prompts every quick run measures. Router CPU per request, writes per
# request and req/s are figures of the full run (docs/router.md "Throughput"), not bounded
# here (issue 45); the writes' coalescing is checked directly by test_coalesce.py.
PATHS = ("direct", "pd", "pd-chain")


@pytest.mark.bench
@pytest.mark.timeout(240)
def test_router_throughput_quick(tmp_path: Path) -> None:
    """The client in two processes of its own (``--client-procs``; the in-process client
    runs in the floor test below)."""
    png = tmp_path / "router_throughput.png"
    result = run_bench(
        "router_throughput.py", "--quick", "--client-procs", "2", "--plot", str(png), timeout=220
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot of the run
    runs = {(r["path"], r["prompt"]): r for r in result["runs"]}
    assert set(runs) == {(p, k) for p in PATHS for k in ("ids", "text")}
    assert result["errors"] == 0, result  # every stream read to its end with a 200
    for run in runs.values():
        assert run["requests"] == QUICK_REQUESTS and run["rps"] > 0 and run["client_procs"] == 2
        assert 0 < run["router_cpu_us_per_req"] < math.inf, run  # its own process's CPU
        assert 0 < run["router_busy"] <= 1.5, run  # a share of one core (a little slack)
    # issue 47's figures: the P/D path's CPU per request and every path's wall req/s
    assert set(result["router_cpu_us_pd"]) == {"ids", "text"}
    assert result["router_cpu_us_pd"]["ids"] == runs[("pd", "ids")]["router_cpu_us_per_req"]
    assert result["wall_req_per_s_per_proc"] == {f"{p}/{k}": runs[(p, k)]["rps"] for p, k in runs}
    for path in PATHS:
        run = runs[(path, "ids")]
        assert run["paced_rps"] == pytest.approx(run["rps"] / 2, abs=0.1)
        assert run["routed_p50_ms"] > 0 and run["direct_p50_ms"] > 0
        assert run["added_p99_ms"] is not None
    # the call to the decode worker and at least one write to the client, counted
    assert runs[("direct", "ids")]["router_writes_per_req"] >= 1, runs
    # one round: each figure's median is the run's own
    summary = {(r["path"], r["prompt"]): r for r in result["summary"]}
    assert set(summary) == set(runs)
    for key, row in summary.items():
        cpu = runs[key]["router_cpu_us_per_req"]
        assert row["rounds"] == 1 and row["router_cpu_us_per_req"]["median"] == cpu


def test_rounds_are_summarised_by_median_and_range() -> None:
    runs = [
        {
            "path": "pd",
            "prompt": "ids",
            "router_cpu_us_per_req": cpu,
            "rps": 700.0,
            "router_writes_per_req": 5.0,
        }
        for cpu in (900.0, 1200.0, 1000.0)
    ]
    runs.append(
        {
            "path": "direct",
            "prompt": "ids",
            "router_cpu_us_per_req": 600.0,
            "rps": 1e3,
            "router_writes_per_req": 3.0,
            "added_p50_ms": 1.5,
        }
    )
    rows = {r["path"]: r for r in summarise(runs)}
    assert rows["pd"]["rounds"] == 3
    assert rows["pd"]["router_cpu_us_per_req"] == {"median": 1000.0, "range": [900.0, 1200.0]}
    assert "added_p50_ms" not in rows["pd"]  # no round measured it
    assert rows["direct"]["added_p50_ms"] == {"median": 1.5, "range": [1.5, 1.5]}


def test_a_compared_tree_is_summarised_apart_with_the_ratio() -> None:
    runs = [
        {
            "path": "pd",
            "prompt": "ids",
            "tree": tree,
            "router_cpu_us_per_req": cpu,
            "rps": 1e3,
            "router_writes_per_req": 5.0,
        }
        for tree, cpu in (("main", 600.0), ("compare", 800.0), ("main", 700.0), ("compare", 700.0))
    ]
    rows = summarise(runs)
    assert [r.get("tree", "main") for r in rows] == ["main", "compare"]
    assert rows[0]["router_cpu_us_per_req"]["median"] == 650.0
    assert rows[1]["router_cpu_us_per_req"]["median"] == 750.0
    assert compare(rows) == [{"path": "pd", "prompt": "ids", "cpu_ratio_main_over_compare": 0.867}]


@pytest.mark.bench
@pytest.mark.timeout(240)
def test_floor_and_a_compared_tree_quick() -> None:
    """``--floor``: bench/floor_apps.py's bare front and its two worker calls, driven by the
    same client; ``--compare-tree``: the path again from another checkout (here this one)."""
    root = str(Path(__file__).resolve().parents[2])
    result = run_bench(
        "router_throughput.py",
        "--quick",
        "--paths",
        "direct",
        "--floor",
        "--compare-tree",
        root,
        timeout=220,
    )
    runs = {(r["path"], r["prompt"], r.get("tree")): r for r in result["runs"]}
    floors = [(f"floor-{m}", "ids", None) for m in ("bare", "calls", "lean", "lean-stream")]
    assert {("direct", "ids", "main"), ("direct", "ids", "compare"), *floors} <= set(runs)
    assert result["errors"] == 0, result  # the floor's streams too, read to the end with a 200
    for key in floors:
        assert runs[key]["requests"] == QUICK_REQUESTS and runs[key]["rps"] > 0
    # lean-stream writes each token as it comes (the head before the decode call, then each
    # read): more writes per request than lean's one reply write beside its two calls
    lean, streamed = runs[("floor-lean", "ids", None)], runs[("floor-lean-stream", "ids", None)]
    assert streamed["router_writes_per_req"] >= 4 > lean["router_writes_per_req"], (lean, streamed)
    assert [c["path"] for c in result["compare"]] == ["direct", "direct"]  # ids and text
    assert all(c["cpu_ratio_main_over_compare"] > 0 for c in result["compare"])


@pytest.mark.bench
@pytest.mark.timeout(240)
def test_router_streams_quick() -> None:
    """200 streams at once through one router, each 20 tokens paced 0.1 s apart by the fake
    decode worker: every one read to its end, in time close to the pacing's own 2 s (not
    one after another: 200 × 2 s), and the router's memory back near idle afterwards.
    Measured here: ~40 KB per held stream at the peak, RSS after ≈ peak (allocator). The
    bounds (2 MB per stream, 150 MB left over) fail a router that buffers whole streams or
    keeps per-request state after the end, not one on a busy machine."""
    result = run_bench("router_streams.py", "--quick", timeout=220)
    assert result["streams"] == 200 and result["errors"] == 0, result
    assert result["wall_s"] < 10 * result["paced_floor_s"], result  # concurrent, not serial
    assert result["kb_per_stream_at_peak"] < 2048, result
    assert result["rss_after_mb"] - result["rss_idle_mb"] < 150, result


@pytest.mark.timeout(120)
def test_opt_venv_runs_the_router_from_this_venvs_packages(tmp_path: Path, capsys) -> None:
    """``bench/opt_venv.py`` makes a venv on another interpreter whose ``python -m pdserve``
    runs from the repository's root with this venv's packages (the repository's
    ``operator/`` must not shadow the standard library's there), and says how fast both
    run pure Python. Here the base is this venv's own interpreter, which every machine has."""
    import subprocess

    import opt_venv

    assert opt_venv.main(["--base", sys.executable, "--out", str(tmp_path / "v")]) == 0
    out = capsys.readouterr()
    python = out.out.strip()
    assert Path(python).exists() and "pure-Python loop" in out.err
    root = Path(__file__).resolve().parents[2]
    got = subprocess.run(
        [python, "-m", "pdserve", "router", "--help"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 0 and "--procs" in got.stdout, got.stderr[-2000:]
