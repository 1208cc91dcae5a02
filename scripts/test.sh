#!/usr/bin/env bash
# The one test command (README and .ci/run): set up, lint, type-check, test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
ruff check .
ruff format --check .
mypy -p pdserve
pytest -q "$@"
