"""What importing the light parts loads, in a fresh interpreter (this process has torch).

The router and a worker's HTTP front end import only ``pdserve.protocol`` and the
engine's torch-free config: the engine, and torch with it, lives in the worker's core
process. A front end that pulls torch back in (an import of ``pdserve.engine.llm_engine``
for a constant, say) starts seconds slower and fails here, naming what it loaded.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import pdserve.protocol

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers")
FRONT_ENDS = [
    "pdserve.router.app",
    "pdserve.router.main",
    "pdserve.prefill_worker.main",
    "pdserve.decode_worker.main",
    "pdserve.worker.http",
    "pdserve.worker.core.client",
    "pdserve.engine.config",  # the front end parses the engine flags and builds the config
]
PROTOCOL = [f"pdserve.protocol.{m.name}" for m in pkgutil.iter_modules(pdserve.protocol.__path__)]

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


# One interpreter imports the modules in turn and names, for each, the heavy modules that
# first appeared with it: the first front end to pull torch in is the one reported.
PROBE = """
import importlib, sys
for name in sys.argv[2:]:
    before = set(sys.modules)
    importlib.import_module(name)
    new = [m for m in sys.argv[1].split(",") if m in sys.modules and m not in before]
    print(name, *new)
"""


def _loaded(modules: list[str], heavy: tuple[str, ...] = HEAVY) -> dict[str, list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(heavy), *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}


def test_front_ends_and_protocol_load_no_torch() -> None:
    loaded = _loaded(FRONT_ENDS + PROTOCOL)
    assert set(loaded) == set(FRONT_ENDS + PROTOCOL)
    assert {m: new for m, new in loaded.items() if new} == {}


def test_protocol_lists_its_modules() -> None:
    # the probe above is only as good as this list
    assert {"contract", "codec", "outputs", "sampling_params", "hashing"} <= {
        m.rsplit(".", 1)[1] for m in PROTOCOL
    }


def test_the_probe_sees_a_loaded_module() -> None:
    # proves the check above can fail: the codec loads json, and the probe says so
    assert _loaded(["pdserve.protocol.codec"], heavy=("json",)) == {
        "pdserve.protocol.codec": ["json"]
    }


def test_stdlib_operator_from_the_repo_root() -> None:
    # operator/ is pdserve.operator (pyproject's package mapping), and the interpreter
    # imports the standard library's operator before it looks at the working directory,
    # so the top-level folder does not shadow it for tools run from the repo root.
    code = "import operator, collections; print(operator.itemgetter(1)('ab'), collections.Counter)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("b <class 'collections.Counter'>")
    assert (ROOT / "operator" / "__init__.py").exists()  # the shadowing candidate is there
