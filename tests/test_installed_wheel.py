"""An installed copy works: the project's wheel, built from its sources and installed into a folder outside the
tree, holds every file its packages read at run time, and the native CPU kernels compile and run from it.

The wheel is built with the setuptools PEP 517 hook (what ``pip wheel`` / ``python -m build`` call; offline, no
build isolation) from a copy of the project's sources, installed with ``pip install --no-deps --target``, and
imported by a child interpreter that sees only that folder and the environment's site-packages (``-S``: no
``.pth`` files, so not the editable install's path to this tree), from a working directory outside the tree, with
an empty ``CTXSPARSE_HOME``: the kernels are built from the installed sources, not taken from a cache.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Files of the packages that belong to the project tree only, not to an installed copy (no installed code reads
# them): bare_host.sh runs from the tree a GPU host is given (its PYTHONPATH is that tree), demo.sh is `make demo`.
TREE_ONLY = {"orchestrator/deploy/bare_host.sh": "the GPU host's set-up, run from the project tree",
             "orchestrator/deploy/demo.sh": "`make demo`, run from the project tree",
             "kernels/NOTES.md": "developers' notes"}

PROBE = r"""
import json, os, sys
import torch
import kernels, kernels.cpu as C, kernels.cpu_quant as Q, kernels.native as N
from kernels.quant import QuantWeight

st = N.native_status()
out = {"kernels": kernels.__file__, "sys_path": sys.path, "native": C.native_available(),
       "quant": Q.native_available(), "describe": N.describe(st), "status": st,
       "built": sorted(os.listdir(os.path.join(os.environ["CTXSPARSE_HOME"], "cpu_kernels")))}
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 64, generator=g)
# kernels.cpu: dot products over some rows of W, against torch's product over those rows (fp64)
w = torch.randn(48, 64, generator=g)
rows = torch.tensor([3, 7, 40, 11])
want = x.double() @ w[rows].double().T
out["rows_dot_err"] = float((C.rows_dot(x, w, rows, 4).double() - want).abs().max() / want.abs().max())
# kernels.cpu_quant: x Wᵀ over Q8_0 blocks (fp16 scale + 32 int8 codes per 32 inputs), against torch's product over
# the weight dequantized by the numpy reference
codes = torch.randint(-127, 128, (16, 2, 32), generator=g, dtype=torch.int8)
scales = (torch.rand(16, 2, 1, generator=g) * 0.02 + 0.001).half()
blocks = torch.cat([scales.view(torch.uint8).reshape(16, 2, 2), codes.view(torch.uint8)], dim=2).reshape(16, 68)
qw = QuantWeight.of("Q8_0", blocks.contiguous(), 64)
want = x.double() @ qw.dequantize_reference().double().T
out["q8_err"] = float((Q.linear(x, qw).double() - want).abs().max() / want.abs().max())
print(json.dumps(out))
"""


def _package_patterns() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]


def _package_files() -> list[str]:
    """The files under the project's package folders (tracked, or new and not ignored), relative to the root."""
    tops = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and any(fnmatch.fnmatch(p.name, pat)
                                                                         for pat in _package_patterns()))
    r = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", *tops], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    if r.returncode == 0:
        files = r.stdout.split()
    else:                    # a copy of the tree without git: every file but the byte-compiled ones
        files = [str(p.relative_to(ROOT)) for t in tops for p in (ROOT / t).rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return sorted(f for f in files if (ROOT / f).is_file())       # (a deleted file git still lists: gone)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """(the install folder, the wheel, the package files of the tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, site = tmp / "src", tmp / "dist", tmp / "site"
    files = _package_files()
    for f in [*files, "pyproject.toml", "README.md"]:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    hook = f"from setuptools import build_meta; print(build_meta.build_wheel({str(dist)!r}))"
    r = subprocess.run([sys.executable, "-c", hook], cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = dist.glob("ctxsparse-*.whl")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                        "--disable-pip-version-check", "--target", str(site), str(wheel)],
                       cwd=tmp, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return site, wheel, files


def test_wheel_holds_every_file_of_the_packages(installed):
    """Every file under the package folders is in the wheel (C sources and headers, migrations, sweep specs, every
    module of every sub-package), except the few named tree-only; the console script is declared."""
    _, wheel, files = installed
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    missing = [f for f in files if f not in names and f not in TREE_ONLY]
    assert not missing, f"files of the packages not in the wheel (package data in pyproject.toml?): {missing}"
    assert "kernels/cpu_glue.h" in names and "kernels/cpu_native.c" in names and "db/alembic.ini" in names
    assert [f for f in TREE_ONLY if f in files] == list(TREE_ONLY)      # the list names files that exist
    assert "ctxsparse = orchestrator.cli:main" in entry_points


def test_native_kernels_build_and_run_from_the_installed_copy(installed, tmp_path):
    """From the installed copy alone: kernels.cpu and kernels.cpu_quant compile their native libraries into a
    fresh CTXSPARSE_HOME and run them; one product each agrees with torch's."""
    site, _, _ = installed
    purelib, platlib = sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CTXSPARSE_CPU_NATIVE")}
    env.update(PYTHONPATH=os.pathsep.join(dict.fromkeys([str(site), purelib, platlib])),
               CTXSPARSE_HOME=str(tmp_path / "home"))
    work = tmp_path / "elsewhere"
    work.mkdir()
    r = subprocess.run([sys.executable, "-S", "-c", PROBE], cwd=work, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["kernels"]).is_relative_to(site), got["kernels"]
    assert str(ROOT) not in got["sys_path"], got["sys_path"]
    assert got["native"] and got["quant"], (got["describe"], got["status"])
    assert got["status"]["cpu_native"]["built"] and got["status"]["cpu_quant"]["built"], got["status"]
    assert [n for n in got["built"] if n.endswith(".so")], got["built"]       # built now, in the fresh home
    assert got["rows_dot_err"] < 1e-5 and got["q8_err"] < 1e-5, got
