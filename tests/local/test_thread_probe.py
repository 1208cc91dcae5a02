"""The lone worker's thread count comes from a timed probe of the model's GEMMs, not its size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pdserve.local import thread_probe
from pdserve.local.processes import ClusterSpec
from tests.local.test_local_mode import _llama

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def test_weight_shapes_are_the_decoder_linears_and_the_head(tmp_path: Path) -> None:
    model = _llama(tmp_path / "m", 128, 256, 3)
    shapes = thread_probe.weight_shapes(str(model))
    # q, o: 128x128; k, v: 64x128; gate, up: 256x128; down: 128x256; per layer. Head 1000x128.
    assert shapes == {(128, 128): 6, (64, 128): 6, (256, 128): 6, (128, 256): 3, (1000, 128): 1}
    assert thread_probe.weight_shapes(str(tmp_path / "missing")) == {}


def test_the_probe_times_the_models_gemms(tiny_model_dir: Path) -> None:
    result = thread_probe.measure(str(tiny_model_dir), "float32", 2)
    assert result["weights"] == 4 * 7 + 1  # 4 layers of 7 linears, and the output head
    assert result["t1_ms"] > 0 and result["tn_ms"] > 0 and result["passes"] >= 3
    assert result["speedup"] == pytest.approx(result["t1_ms"] / result["tn_ms"], rel=0.01)


def test_the_probe_in_a_child_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    thread_probe.probe.cache_clear()
    result = thread_probe.probe(str(tiny_model_dir), "auto", 2)
    assert "error" not in result, result
    assert result["all_cores"] == (result["speedup"] >= thread_probe.ALL_CORES_MIN_SPEEDUP)
    empty = thread_probe.probe(str(tmp_path), "auto", 2)  # no weights: answered, no child
    assert "error" in empty


@pytest.mark.parametrize("speedup", [0.5, 1.2, 1.39, 1.4, 2.0])
def test_a_lone_worker_follows_the_measured_speedup(
    speedup: float, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One model (the size never changes here): only the measured speedup decides."""
    model = str(_llama(tmp_path / "m", 512, 1408, 8))
    calls: list[tuple[str, str, int]] = []

    def fake(model_dir: str, dtype: str, threads: int) -> dict[str, Any]:
        calls.append((model_dir, dtype, threads))
        return {"speedup": speedup, "all_cores": thread_probe.takes_all_cores({"speedup": speedup})}

    monkeypatch.setattr(thread_probe, "probe", fake)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2, 3})
    lone = ClusterSpec(model_dir=model, num_prefill=0, dtype="bfloat16")
    assert lone.threads_per_worker() == (4 if speedup >= 1.4 else 3)
    assert calls == [(model, "bfloat16", 4)]
    # Several workers, or an autoscaled one that others may join, share the cores unprobed.
    assert ClusterSpec(model_dir=model).threads_per_worker() == 1
    assert ClusterSpec(model_dir=model, num_prefill=0, autoscaled=True).threads_per_worker() == 3
    assert len(calls) == 1


def test_a_failed_probe_keeps_a_core_free(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(thread_probe, "probe", lambda *a: {"error": "thread probe took over 120s"})
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1})
    assert ClusterSpec(model_dir=str(tmp_path), num_prefill=0).threads_per_worker() == 1
