"""bench/structured.py --quick runs end to end and prints its JSON line last."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.loopback import run_bench


@pytest.mark.timeout(240)
def test_structured_bench_quick(tmp_path: Path) -> None:
    plot = tmp_path / "structured.png"
    result = run_bench("structured.py", "--quick", "--plot", str(plot), timeout=200)
    for key in ("free_tok_s", "constrained_tok_s", "ratio"):
        assert isinstance(result[key], float) and result[key] > 0, (key, result)
    assert result["quick"] is True and result["requests"] == 8
    assert plot.stat().st_size > 1000
