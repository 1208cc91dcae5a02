"""The host model's other jobs as CFS sees them (planner/sim/host.py, sim_vs_real_host.py).

A job measured beside the real replay took what it took; whether it would take the
same from the simulated workers depends on its priority: a job of higher priority
than ours was not squeezed (it wants what it took), a CPU-bound job of our priority
or lower took what was left and shares fairly (it wants whole cores). Pure functions
and a synthetic recording, no processes.
"""

from __future__ import annotations

import numpy as np
import pytest
from sim_vs_real_host import _jobs

from pdserve.planner.sim.host import Host, is_hog, job_groups, nice_weight

pytestmark = pytest.mark.unit


def _host(jobs: tuple, nice: int = 19) -> Host:
    return Host(
        2.0, np.array([0.0]), np.array([1.0]), 0.0, 0.0, 0.0, background_groups=(jobs,), nice=nice
    )


def test_cfs_weights_and_how_a_job_is_read() -> None:
    assert nice_weight(0) == 1024.0 and nice_weight(19) == pytest.approx(15, abs=0.3)
    # higher priority than ours: it took what it wanted, however much
    assert job_groups(0.9, 0, 19) == [(1.0, 0.9, 1024.0)]
    # our priority, CPU-bound: a whole core wanted, even in a window where it was squeezed
    assert job_groups(0.9, 19, 19)[0][1] == 1.0
    assert job_groups(0.2, 19, 19, hog=True)[0][1] == 1.0
    assert job_groups(0.2, 19, 19)[0][1] == pytest.approx(0.2)  # a light job: what it took
    assert job_groups(1.7, 10, 19)[0][:2] == (2.0, 0.85)  # two threads
    # ran in nearly every period, a quarter of a core or more on average: CPU-bound
    assert is_hog([0.9, 0.95, 0.1], 3) and not is_hog([0.1, 0.3, 0.2], 3)
    assert not is_hog([0.9, 0.9], 10) and not is_hog([], 3)  # came and went: not a hog


def test_a_job_of_our_priority_shares_and_one_above_it_does_not() -> None:
    engine = [1.0]  # one always-runnable engine of ours
    # a CPU-bound job at our nice on 2 cores: each gets a core (it took ~1.5 in the
    # recording only because ours were idle most of the time)
    assert _host(((1.0, 1.0, nice_weight(19)),)).cpu(0.0, engine, 0, 0.0) == 1.0
    # three of them: four runnable threads on two cores, half a core each
    three = ((3.0, 1.0, nice_weight(19)),)
    assert _host(three).cpu(0.0, engine, 0, 0.0) == pytest.approx(0.5, rel=1e-3)
    # two CPU-bound jobs at nice 0 against ours at 19: CFS gives ours ~15/1024 of theirs
    high = ((2.0, 1.0, nice_weight(0)),)
    assert _host(high).cpu(0.0, engine, 0, 0.0) == pytest.approx(0.0145, abs=1e-3)
    # ... and at our nice 0, a fair third of the two cores
    assert _host(high, nice=0).cpu(0.0, engine, 0, 0.0) == pytest.approx(2 / 3, rel=1e-3)


def test_jobs_from_a_recording_keep_a_cpu_bound_job_a_hog_where_it_was_squeezed() -> None:
    # samples every 0.5 s for 6 s; pid 7 (nice 19) ran flat out but got only 0.1 of a core
    # in the last window; pid 8 (nice 0) used 0.2 of a core throughout (2 s windows here)
    others = [[0.0, []]]
    for k in range(1, 13):
        got = 0.05 if k > 8 else 0.45  # CPU seconds per 0.5 s period
        others.append([k * 0.5, [[7, got, 19], [8, 0.1, 0]]])
    jobs = _jobs({"others": others}, 6.0, our_nice=19, window_s=2.0)
    assert len(jobs) == 3  # three 2-second windows
    for window in jobs:
        by_weight = {w: (n, want) for n, want, w in window}
        assert by_weight[nice_weight(19)] == (1.0, 1.0)  # a hog in every window
        assert by_weight[nice_weight(0)][1] == pytest.approx(0.2)
