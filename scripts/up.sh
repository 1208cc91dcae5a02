#!/usr/bin/env bash
# The main job: set everything up, then run the whole service locally
# (router + 1 prefill + 1 decode worker on a tiny model it creates). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve up "$@"
