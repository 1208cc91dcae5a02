#!/usr/bin/env bash
# The one test command (README and .ci/run): set up, lint, type-check, test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
ruff check .
ruff format --check .
# mypy's cache outside the checkout: a fresh clone (CI) re-checks only the files that changed
# (its cache entries are keyed by module and content hash): ~20 s, where a cold run takes 1-2 min.
MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-$HOME/.cache/pdserve/mypy} mypy -p pdserve
# Two xdist workers on the 2-core machine; tests/xdist_plan.py groups the tests (a shared
# service or a module's fixtures start once) and sends the longest groups out first.
# Tests marked serial measure latency against an SLO: they run afterwards, alone.
pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -m "not serial" "$@"
pytest -q -m serial "$@" || [ $? -eq 5 ]  # 5: no serial test among those selected
