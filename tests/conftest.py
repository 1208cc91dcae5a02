"""Shared pytest setup: offline Hugging Face, few threads, and the tiny test model.

The environment defaults are set at import time, before any test module imports
torch or huggingface_hub (both read them once, at import). Values already set in
the environment win, so ``OMP_NUM_THREADS=4 pytest ...`` still works.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import early_release
from tests.tiers import TIERS, mark_tiers, tier_of
from tests.xdist_plan import Durations, plan

# The machine is shared and small: one compute thread per test process by default.
for _name, _value in {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RAYON_NUM_THREADS": "1",  # tokenizers' training / batch encoding pool
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",  # nothing may download models at run time
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    # Every router, worker and `pdserve up` a test starts shares this service secret, so
    # the suite runs authenticated; helpers send it (pdserve/testing/loopback.py: secret_headers).
    "PDSERVE_SERVICE_SECRET": "pdserve-tests-secret",
    # Workers the suite starts run the eager forward: a compile per worker start would
    # cost seconds each. tests/engine/test_fidelity.py (test_compiled_forward) runs the
    # compiled path.
    "PDSERVE_ENFORCE_EAGER": "1",
}.items():
    os.environ.setdefault(_name, _value)

REPO_ROOT = Path(__file__).resolve().parent.parent
# Git-ignored (/.cache/ in .gitignore); shared by test sessions, written atomically.
MODEL_CACHE = Path(os.environ.get("PDSERVE_TEST_CACHE", REPO_ROOT / ".cache" / "test-models"))


@pytest.fixture(scope="session", autouse=True)
def _torch_threads() -> None:
    """Match torch's intra-op threads to OMP_NUM_THREADS if torch is in use."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The ``tiny`` preset model (seed 0), written once and reused across sessions."""
    from pdserve.engine.tiny_model import write_tiny_model

    return write_tiny_model(MODEL_CACHE / "tiny-seed0", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    """The tiny model's tokenizer, loaded once per session through AutoTokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _start_reaper() -> None:
    """Every service this pytest process starts inherits ``PDSERVE_TEST_OWNER=<our pid>``;
    tests/reaper.py kills them all once this process is gone, teardown or not."""
    from tests.reaper import OWNER

    os.environ[OWNER] = str(os.getpid())  # an xdist worker: its own pid, not its controller's
    argv = [sys.executable, str(Path(__file__).with_name("reaper.py")), str(os.getpid())]
    # Its own session: a Ctrl-C to the terminal's group spares it.
    _REAPER.append(subprocess.Popen(argv, stdin=subprocess.PIPE, start_new_session=True))


_REAPER: list[subprocess.Popen[bytes]] = []  # referenced for the process's life: its pipe
_ZYGOTE: list[Any] = []  # this process's engine-core zygote, if the run starts cores
# Each test's seconds, recorded by the process that sees every report (a plain run, or the
# xdist controller): the next run's plan orders its groups by them (tests/xdist_plan.py).
_DURATIONS = Durations()


def pytest_configure(config: pytest.Config) -> None:
    _start_reaper()
    for name, meaning in TIERS.items():  # the tiers (tests/tiers.py), for --strict-markers
        config.addinivalue_line("markers", f"{name}: {meaning}")
    # pytest-xdist's own marker, named here too so --strict-markers passes without xdist.
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one xdist worker")
    config.addinivalue_line(
        "markers",
        "serial: a latency or a speed ratio measured against a bound: make test runs these "
        "after the parallel part, alone on the machine (scripts/test.sh)",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's hook reads the xdist_group markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_tiers(items)  # each test's tier marker: -m unit is make test-fast
    # groups and order for make test's two workers (tests/xdist_plan.py); loadgroup: set by
    # xdist in a worker of a --dist loadgroup run
    plan(items, loadgroup=bool(config.getoption("loadgroup", False)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """A run that starts engine cores (a test outside the unit tier) gets one core zygote
    per pytest process: every worker its tests start, directly or through ``pdserve up``,
    forks its core from it (``PDSERVE_CORE_ZYGOTE``, worker/core/zygote.py) instead of
    importing torch and transformers anew, ~6 CPU-s each for the suite's ~80 cores. A test
    that changes the environment gets a core of its own (the zygote refuses it), and
    tests/workers/test_core_zygote.py starts cores without one."""
    early_release.SESSION.plan(session.items)  # the run's order, deselection done
    from pdserve import env

    if env.get(env.CORE_ZYGOTE) or all(tier_of(i) == "unit" for i in session.items):
        return
    from pdserve.worker.core.zygote import ZygoteProcess

    _ZYGOTE.append(ZygoteProcess(log=subprocess.DEVNULL))
    os.environ[env.CORE_ZYGOTE] = _ZYGOTE[0].path


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    try:
        return (yield)
    finally:  # a session service whose last test this was stops now (tests/early_release.py)
        early_release.SESSION.after_teardown(item, nextitem)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _DURATIONS.add(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _DURATIONS.save()


def pytest_unconfigure(config: pytest.Config) -> None:
    for zygote in _ZYGOTE:
        zygote.stop()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The real control plane's tier, counted apart (issue 42): how many of its tests ran,
    passed, failed or skipped (``make test`` must show it ran, and not skipped)."""
    counts = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        reports = terminalreporter.stats.get(outcome, [])
        counts[outcome] = sum(
            1
            for r in reports
            if getattr(r, "nodeid", "").startswith("tests/k8s_real/")
            and (outcome != "passed" or getattr(r, "when", "call") == "call")
        )
    if any(counts.values()):
        line = ", ".join(f"{n} {outcome}" for outcome, n in counts.items() if n)
        terminalreporter.write_line(f"k8s_real tier (a real kube-apiserver, etcd): {line}")
