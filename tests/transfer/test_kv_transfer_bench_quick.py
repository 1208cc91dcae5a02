"""bench/kv_transfer.py --quick runs end to end and prints its JSON line last."""

from __future__ import annotations

from tests.loopback import run_bench


def test_bench_quick(tmp_path) -> None:
    plot = tmp_path / "kv.png"
    args = ("--quick", "--threads", "1", "--plot", str(plot))
    result = run_bench("kv_transfer.py", *args, timeout=120)
    for key in ["nixl_gbps", "tcp_gbps", "memcpy_gbps", "nixl_vs_memcpy", "nixl_vs_tcp"]:
        assert isinstance(result[key], float) and result[key] > 0, (key, result)
    assert result["quick"] is True and result["bytes"] > 0
    assert plot.stat().st_size > 1000
