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
# One pytest process. Two xdist workers (tests/xdist_plan.py groups the tests for them:
# pytest -n 2 --dist loadgroup) halved single directories here, but a whole run under load
# hung in a shared fixture's set-up and ended in an xdist internal error; not the default
# until that is found.
pytest -q "$@"
