"""Byte-compile what pdserve's processes and the test suite import (scripts/setup.sh).

uv installs without ``--compile-bytecode``: compiling every module of a fresh venv (~19,000:
torch, transformers, sympy, ...) was most of a fresh clone's set-up, where one process of
the suite imports ~2,700 of them. Importing these with byte-code writing on leaves a
``.pyc`` beside each module they load; make test writes the rest on first import
(scripts/test.sh unsets ``PYTHONDONTWRITEBYTECODE``). A module that fails to import here is
reported and skipped: it only compiles later.
"""

from __future__ import annotations

import importlib
import sys
import time

# The engine and both workers (torch, transformers' modelling stack, NIXL, ZeroMQ), the
# router and operator, the compiled forward (dynamo, inductor: sympy), the Triton
# interpreter, the planner's plots, the test runner with its plugins, and what the tests'
# helpers import beside them (the OpenAI client: ~700 modules; the Kubernetes client; kmock).
MODULES = (
    "torch",
    "transformers.modeling_utils",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "triton",
    "pdserve.cli",
    "pdserve.engine.llm_engine",
    "pdserve.worker.http",
    "pdserve.router.app",
    "pdserve.operator.handlers",
    "pdserve.planner.sim.cluster",
    "matplotlib.pyplot",
    "pytest",
    "xdist",
    "hypothesis",
    "openai",
    "kubernetes",
    "pdserve.testing.k8s_emulator",
    "pdserve.testing.up",
)


def main() -> int:
    began, failed = time.process_time(), []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any failure only means "compiled on first use"
            failed.append(f"{name} ({type(exc).__name__}: {exc})")
    print(
        f"setup: byte-compiled {len(sys.modules)} imported modules "
        f"({time.process_time() - began:.1f} CPU-s)"
    )
    for what in failed:
        print(f"setup: not imported, compiles on first use: {what}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
