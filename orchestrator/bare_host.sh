#!/usr/bin/env bash
# Run a sweep on a GPU host that has torch/triton/transformers but no pip index: the Ray, pydantic, SQLAlchemy
# and alembic wheels travel in SHIP (Ray as a slim .tar.xz without jars/rllib/serve), unpacked into a site folder.
#   SHIP=.gpuship bash orchestrator/bare_host.sh SPEC.yaml sqlite:///OUT/store.db
set -euo pipefail
SHIP=${SHIP:-.gpuship}
SITE=${SITE:-/tmp/ctxsparse-site}
mkdir -p "$SITE"
tar -xJf "$SHIP"/ray-*.tar.xz -C "$SITE"
# a wheel is a zip of importable files: unpacking it is installing it (no pip needed)
python -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" "$SHIP"/*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
export PATH="$SITE/bin:$PATH"
python -m orchestrator.driver "$1" --db "$2"
