"""bench/gpu_smoke.py is the prepared check for a lent GPU; here (no CUDA) it must run,
say that nothing was checked, and exit 0. The roofline's bandwidth table is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_smoke  # noqa: E402


def test_bandwidth_lookup() -> None:
    assert gpu_smoke.bandwidth_gbps("NVIDIA H200", None) == 4800
    assert gpu_smoke.bandwidth_gbps("NVIDIA H100 80GB HBM3", None) == 3350
    assert gpu_smoke.bandwidth_gbps("Some GPU", 123.0) == 123.0
    with pytest.raises(SystemExit, match="hbm-gbps"):
        gpu_smoke.bandwidth_gbps("Some GPU", None)


def test_runs_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: run bench/gpu_smoke.py itself")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_smoke.py")],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "cuda": False,
        "note": "no CUDA device: nothing checked",
    }
