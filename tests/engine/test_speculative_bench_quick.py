"""bench/speculative.py --quick: two real `pdserve up` services (speculation off and on, the
tiny model), both workloads, and the JSON line's shape. No performance bound here: the
figures are the benchmark's (docs/speculative.md)."""

from __future__ import annotations

import pytest

from pdserve.testing.loopback import free_port, run_bench

pytestmark = [pytest.mark.bench, pytest.mark.timeout(400)]


def test_speculative_bench_quick() -> None:
    result = run_bench("speculative.py", "--quick", "--port", str(free_port()), timeout=360)
    for w in ("repetitive", "chat"):
        assert result[f"spec_speedup_{w}"] > 0
        assert result[f"identical_share_{w}"] == 1.0  # greedy: the same text either way
    (row,) = result["rounds"]
    assert row["repetitive"]["off_tok_s"] > 0 and row["chat"]["on_tok_s"] > 0
    assert set(result["spec_metrics"]) == {"acceptance_rate", "tokens_per_step"}
    assert result["speculative"] == "ngram:k=4"
