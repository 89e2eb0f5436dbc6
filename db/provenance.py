"""Provenance stamped on every result row: package versions and the git revision.

Reads distribution metadata only (importlib.metadata): importing this module never
imports torch, Ray or anything heavy.
"""

from __future__ import annotations

import os
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path

TRACKED_PACKAGES = (
    "ctxsparse",
    "torch",
    "torch_npu",
    "triton",
    "transformers",
    "accelerate",
    "safetensors",
    "datasets",
    "lm_eval",
    "gguf",
    "numpy",
    "ray",
    "sqlalchemy",
    "pydantic",
)

_PROJECT_ROOT = Path(__file__).resolve().parent.parent


def package_versions(names: tuple[str, ...] = TRACKED_PACKAGES) -> dict[str, str]:
    """``{distribution: version}`` for the installed ones among ``names`` (missing ones skipped)."""
    return dict(_package_versions(tuple(names)))


@lru_cache(maxsize=8)
def _package_versions(names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    found = []
    for name in names:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return tuple(found)


@lru_cache(maxsize=1)
def git_rev() -> str:
    """``$CTXSPARSE_GIT_REV`` where set (a shipped tree: the commit the shipment was built at, which a copy of the
    tree with another .git would misreport), else HEAD of the project checkout, else ``"unknown"``.

    A checkout with uncommitted changes gets a ``-dirty`` suffix.
    """
    if os.environ.get("CTXSPARSE_GIT_REV"):
        return os.environ["CTXSPARSE_GIT_REV"]
    try:
        run = dict(cwd=_PROJECT_ROOT, capture_output=True, text=True, timeout=10, check=True)
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], **run).stdout.strip()
        rev = subprocess.run(["git", "rev-parse", "HEAD"], **run).stdout.strip()
        # Only our own checkout counts (an installed copy may sit inside some other repo).
        if rev and Path(top).resolve() == _PROJECT_ROOT:
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], **run
            ).stdout.strip()
            return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def stamp() -> dict[str, object]:
    """``{"package_versions": ..., "git_rev": ...}`` to splat into AccuracyRow / LatencyRow."""
    return {"package_versions": package_versions(), "git_rev": git_rev()}
