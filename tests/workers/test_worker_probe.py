"""A model that raises, served by real worker processes (engine/startup_probe.py,
engine/step_fault.py): refused at start with the exception's class and message (the
worker exits non-zero), or, when it raises only after the worker is ready, taken out of
service visibly (``/health`` 503 naming the model and the exception, a metric, a log
line) rather than left answering errors while it says it is ready.

The fault is injected into the worker's engine core by a ``sitecustomize`` on its
``PYTHONPATH``: layer 0's MLP of the tiny Llama raises ``ValueError: too many values to
unpack (expected 3)`` (what issue #48's PhiMoE raised in decode) from its Nth call on.
The cores start as plain processes (no zygote: the fault is set up at interpreter start).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.workers.worker_helpers import AUTH, decode, metric, proc, worker_cluster

pytestmark = pytest.mark.cluster
MESSAGE = "too many values to unpack (expected 3)"
HOOK = """
import os, sys
AT = int(os.environ.get("PDSERVE_TEST_MLP_FAULT_AT") or 0)
TARGET = "transformers.models.llama.modeling_llama"


def _patch(module):
    forward, calls = module.LlamaMLP.forward, [0]

    def faulty(self, *args, **kwargs):
        if self is self._pdserve_first:
            calls[0] += 1
            if calls[0] >= AT:
                raise ValueError("too many values to unpack (expected 3)")
        return forward(self, *args, **kwargs)

    init = module.LlamaMLP.__init__

    def first_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not hasattr(module.LlamaMLP, "_pdserve_first"):
            module.LlamaMLP._pdserve_first = self

    module.LlamaMLP.forward, module.LlamaMLP.__init__ = faulty, first_init


class _Finder:
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = patched
        return spec


if AT:
    sys.meta_path.insert(0, _Finder())
"""


def _faulty_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, at: int) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    monkeypatch.setenv("PYTHONPATH", str(hook))
    monkeypatch.setenv("PDSERVE_TEST_MLP_FAULT_AT", str(at))


def test_a_model_that_raises_in_its_probe_is_refused_at_start(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _faulty_env(monkeypatch, tmp_path, at=4)  # the load check, two prefills, a decode
    with pytest.raises(RuntimeError) as info:  # noqa: SIM117
        with worker_cluster(tiny_model_dir, tmp_path, num_prefill=0, core_zygote=False):
            pass
    text = str(info.value)
    assert "decode-0 exited with code 1" in text
    assert "refused at start" in text and f"ValueError: {MESSAGE}" in text


def test_a_step_that_raises_after_ready_makes_the_worker_unready(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the load check and the probe's 6 forwards pass; the 13th forward after ready raises
    _faulty_env(monkeypatch, tmp_path, at=20)
    with worker_cluster(tiny_model_dir, tmp_path, num_prefill=0, core_zygote=False) as cluster:
        d = proc(cluster, "decode")
        assert httpx.get(d.url + "/health", timeout=10).status_code == 200

        async def run() -> tuple[int, list[dict[str, object]]]:
            async with httpx.AsyncClient() as client:
                return await decode(client, d.url, "r1", [5, 6, 7, 8], 30)

        status, lines = asyncio.run(run())
        assert status == 200 and MESSAGE in str(lines[-1].get("error")), lines[-1]
        health = httpx.get(d.url + "/health", timeout=10)
        assert health.status_code == 503
        why = health.json()["error"]["message"]
        assert why.startswith("engine step failed: model ") and f"ValueError: {MESSAGE}" in why
        assert metric(d.url, "pdserve_engine_step_failures_total") == 1
        assert metric(d.url, "pdserve_engine_faulted") == 1
        assert d.popen is not None and d.popen.poll() is None  # unready, not dead
        log = d.log_path.read_text()
        assert "engine step failed (model '" in log and MESSAGE in log
        stats = httpx.get(d.url + "/stats", timeout=10, auth=AUTH).json()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
