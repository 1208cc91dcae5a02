"""bench/gpu_smoke.py is the prepared check for a lent GPU; here (no CUDA) it must run,
say that nothing was checked, and exit 0. The roofline's bandwidth table is checked, and
its verdict (the exit status) on injected results: any failed check, hand-off or (with
``--hbm-gbps``) missed roofline goal fails the run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import gpu_smoke
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit


def test_bandwidth_lookup() -> None:
    assert gpu_smoke.bandwidth_gbps("NVIDIA H200", None) == 4800
    assert gpu_smoke.bandwidth_gbps("NVIDIA H100 80GB HBM3", None) == 3350
    assert gpu_smoke.bandwidth_gbps("Some GPU", 123.0) == 123.0
    with pytest.raises(SystemExit, match="hbm-gbps"):
        gpu_smoke.bandwidth_gbps("Some GPU", None)


def test_runs_without_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The script's own entry, in this process (a child would import torch again, ~3 CPU-s;
    the module's imports ran above)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: run bench/gpu_smoke.py itself")
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "gpu_smoke.py")])
    capsys.readouterr()
    assert gpu_smoke.main() == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == {
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


def test_bf16_check_fails_on_a_wrong_token(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bfloat16 check can fail: the engine's greedy tokens with one replaced by the
    token transformers ranks last at that position fail it at the normal tolerance."""
    import torch

    monkeypatch.setattr(gpu_smoke, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_smoke, "MAX_TOKENS", 4)
    prompts = gpu_smoke._prompts()[1:2]
    hf = gpu_smoke._hf(tiny_model_dir, torch.bfloat16)
    greedy = gpu_smoke._greedy

    def one_wrong(engine: Any, ps: list[list[int]]) -> list[list[int]]:
        got = greedy(engine, ps)
        with torch.inference_mode():
            logits = hf(torch.tensor([ps[0] + got[0][:1]])).logits[0, -1]
        got[0][1] = int(logits.argmin())  # the second token: transformers' last choice
        return got

    monkeypatch.setattr(gpu_smoke, "_greedy", one_wrong)
    wrong = gpu_smoke.fidelity_bf16(tiny_model_dir, 0.15, prompts)
    assert not wrong["ok"] and wrong["worst_logit_gap"] > 1.0, wrong


GOOD: dict[str, Any] = {
    "fidelity_fp32": {"ok": True},
    "fidelity_bf16": {"ok": True},
    "fidelity_real": {"ok": True},
    "mla_latent": {"ok": True},
    "up_e2e": {"ok": True},
    "kv_two_processes": {"ok": True},
    "nixl_vram": {"ok": True},
    "tcp": {"ok": True},
    "roofline": [
        {"B": 32, "ctx": 512, "graphs": False, "roofline_ratio": 0.3},
        {"B": 32, "ctx": 512, "graphs": True, "roofline_ratio": 0.7},
        {"B": 1, "ctx": 512, "graphs": True, "roofline_ratio": 0.1},
    ],
}


@pytest.mark.parametrize("check", gpu_smoke.CHECKS)
def test_any_failed_check_fails_the_run(check: str) -> None:
    """Each check's ``ok`` counts, the hand-offs' byte comparisons included."""
    assert gpu_smoke.verdict(GOOD, roofline_goal=True) == []
    bad = {**GOOD, check: {"ok": False, "error": "bytes differ"}}
    assert [f.split(":")[0] for f in gpu_smoke.verdict(bad, roofline_goal=False)] == [check]


def test_roofline_goal_fails_the_run_only_with_hbm_gbps() -> None:
    slow = {**GOOD, "roofline": [{"B": 32, "ctx": 2048, "graphs": True, "roofline_ratio": 0.5}]}
    assert gpu_smoke.verdict(slow, roofline_goal=False) == []
    (failure,) = gpu_smoke.verdict(slow, roofline_goal=True)
    assert "0.5 < 0.6 at B=32 ctx=2048" in failure
    raised = {**GOOD, "roofline": [*GOOD["roofline"], {"ok": False, "error": "OOM"}]}
    assert gpu_smoke.verdict(raised, roofline_goal=True) == [
        "roofline point raised: {'ok': False, 'error': 'OOM'}"
    ]
