"""bench/kv_transfer.py --quick runs end to end and prints its JSON line last."""

from __future__ import annotations

import pytest

from pdserve.testing.loopback import run_bench

pytestmark = pytest.mark.bench


def test_bench_quick(tmp_path) -> None:
    plot = tmp_path / "kv.png"
    args = ("--quick", "--threads", "1", "--plot", str(plot))
    result = run_bench("kv_transfer.py", *args, timeout=120)
    for key in ["nixl_gbps", "tcp_gbps", "memcpy_gbps", "nixl_vs_memcpy", "nixl_vs_tcp"]:
        assert isinstance(result[key], float) and result[key] > 0, (key, result)
    assert result["quick"] is True and result["bytes"] > 0
    # The bench checks the bytes arrived (torch.equal). The one timing bound is a sanity
    # check: no transfer between processes beats a memcpy in one (a faster one moved nothing
    # or timed the wrong thing). NIXL against TCP is the bench's figure to report, not a
    # bound here: under a loaded CI host the quick run's 0.1 GB/s transfers swap order
    # (CI, 2026-12-03: NIXL 0.045 and TCP 0.050 GB/s; quiet: 0.14 and 0.045).
    assert result["nixl_vs_memcpy"] < 1.0, result
    assert plot.stat().st_size > 1000
