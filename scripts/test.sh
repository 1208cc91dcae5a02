#!/usr/bin/env bash
# The one test command (README and .ci/run): set up, lint, type-check, test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
# Byte-compiled modules: these machines set PYTHONDONTWRITEBYTECODE=1, so every process the
# suite starts (pdserve up's routers and workers, bench scripts, router processes: hundreds)
# compiled this checkout's modules from source again, and each pytest session rewrote and
# compiled every test module again. Unset, the first import writes __pycache__ (git-ignored,
# written atomically) and the rest read it. The venv's packages too: setup byte-compiles what
# the suite's processes import (scripts/warm_bytecode.py); the rest is written on first import.
# tests/router/test_router_process.py, pyc written against none, two pairs at load 9-12:
# 45.5 -> 27.1 and 41.8 -> 34.0 CPU-s; collecting tests/router 16.2-19.2 -> 12.9-13.7;
# collecting the whole suite 48 -> 12.5 CPU-s a process.
unset PYTHONDONTWRITEBYTECODE
# The k8s_real tier's control plane (etcd, kube-apiserver, kube-controller-manager): built once
# per machine from the Go module proxy into ~/.cache/pdserve/k8s/ (a no-op when cached, or
# with KUBEBUILDER_ASSETS). A failed build fails make test here; the tier never skips under it.
python scripts/build_k8s.py >/dev/null
export PDSERVE_REQUIRE_K8S_REAL=1
# The real Prometheus (Debian's package, scripts/setup.sh): its tests fail, not skip, without it.
export PDSERVE_REQUIRE_PROMETHEUS=1
# The router's compiled lane (scripts/setup.sh builds it wherever cargo is): its tests fail,
# not skip, when the build is missing or older than the tree.
if command -v cargo >/dev/null; then export PDSERVE_REQUIRE_LANE=1; fi
ruff check .
ruff format --check .
# mypy's cache outside the checkout: a fresh clone (CI) re-checks only the files that changed
# (its cache entries are keyed by module and content hash): ~20 s, where a cold run takes 1-2 min.
# It runs beside the parallel part (its seconds were the suite's wall before), and the run
# waits for it before the serial part, which measures alone; a type error fails make test.
mypy_log=$(mktemp)
MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-$HOME/.cache/pdserve/mypy} mypy -p pdserve >"$mypy_log" 2>&1 &
mypy_pid=$!
# Two xdist workers on the 2-core machine; tests/xdist_plan.py groups the tests (a shared
# service or a module's fixtures start once, on one worker) and sends the longest groups out
# first (--no-loadscope-reorder keeps that order). Tests marked serial measure a latency
# against an SLO: they run afterwards, alone. Both parts run; the worse exit code wins.
parallel=0
pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -m "not serial" "$@" || parallel=$?
typed=0
wait "$mypy_pid" || typed=$?
cat "$mypy_log"
rm -f "$mypy_log"
# Without arguments only the files that mark serial tests are collected again (collecting
# the whole suite costs ~40-70 s here); with arguments, the same selection as the first part.
if [ $# -gt 0 ]; then
  select=("$@")
else
  mapfile -t select < <(grep -rlE --include='test_*.py' 'mark\.serial\b' tests | sort)
fi
serial=0
pytest -q -m serial "${select[@]}" || serial=$?
# 5: no test selected, an error only when neither part had one (make test -k NAME runs one part)
if [ "$parallel" -eq 5 ] && [ "$serial" -ne 5 ]; then parallel=0; fi
if [ "$serial" -eq 5 ] && [ "$parallel" -ne 5 ]; then serial=0; fi
worst=$(( parallel > serial ? parallel : serial ))
exit $(( worst > typed ? worst : typed ))
