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


def test_checks_run_on_cpu(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The acceptance checks' own logic, on CPU (the script runs them on CUDA only): a
    bfloat16 greedy run judged by its logit gaps, a roofline point, a KV hand-off."""
    monkeypatch.setattr(gpu_smoke, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_smoke, "MAX_TOKENS", 4)
    prompts = gpu_smoke._prompts()[:3]
    bf16 = gpu_smoke.fidelity_bf16(tiny_model_dir, 0.15, prompts)
    assert bf16["ok"] and 0.0 <= bf16["worst_logit_gap"] <= 0.15, bf16
    strict = gpu_smoke.fidelity_bf16(tiny_model_dir, -1.0, prompts)  # can fail: it does
    assert not strict["ok"]
    point = gpu_smoke.roofline(tiny_model_dir, 2, 20, 100.0, graphs=False)
    assert point["step_ms"] > 0 and point["roofline_ratio"] > 0 and point["graph_replays"] == 0
    moved = gpu_smoke.kv_handoff("tcp", mib=4)
    assert moved["ok"] and moved["gbps"] > 0


def test_kv_handoff_between_processes_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two-process hand-off check (bench/kv_transfer.py with the prefill side's pool in
    its own process), run with host pools: NIXL and tcp move the bytes, checked one by one
    there; on a GPU the same command runs with --device cuda."""
    monkeypatch.setattr(gpu_smoke, "DEVICE", "cpu")
    moved = gpu_smoke.kv_handoff_processes(quick=True)
    assert moved["ok"] and moved["device"] == "cpu", moved
    assert moved["nixl_gbps"] > 0 and moved["tcp_gbps"] > 0, moved
    assert gpu_smoke.real_model_dir("none") is None
    assert gpu_smoke.real_model_dir("/some/dir") == Path("/some/dir")
