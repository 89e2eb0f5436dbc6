"""``orchestrator/deploy/bare_host.sh`` set-ups that succeed, on small real shipments built here.

A shipment is laid out and its manifest written by ``orchestrator.deploy.ship`` itself (``file_entry``,
``make_manifest``: the batch-NN/ folders and ship-manifest.json that ``make ship`` writes), around tiny pure-Python
wheels built here with setuptools. It carries no Ray tarball, no model, no data and no tokenizer (the script says so
and sets up what it has: its import check finds the environment's own Ray, as a host with Ray would). No GPU, no
network. The failure paths before the set-up (a damaged piece, MPS) are in test_ship.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.deploy import ship

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "orchestrator" / "deploy" / "bare_host.sh"
NEEDS = {"name": "bare-host-test", "models": [], "tasks": [], "data_folders": [], "elsewhere": []}
PROJECTS = {   # name -> (package, dependencies, __init__.py)
    "ctxsparse-probe-alpha": ("ctxsparse_probe_alpha", [], "VALUE = 'alpha'\n"),
    "ctxsparse-probe-beta": ("ctxsparse_probe_beta", ["ctxsparse-probe-alpha>=1.0"],
                             "from ctxsparse_probe_alpha import VALUE as ALPHA\nVALUE = 'beta'\n"),
    # a gguf wheel that does not import here (what a wheel built for another Python or platform does)
    "gguf": ("gguf", [], "from gguf._quants_cp399 import dequantize  # noqa: F401\n"),
}
BUILD = """
import os, sys
from setuptools import build_meta
out = sys.argv[1]
for project in sys.argv[2:]:
    os.chdir(project)
    print(build_meta.build_wheel(out))
"""


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """{project name: its wheel}, built with the environment's setuptools (PEP 517 hook, offline)."""
    tmp = tmp_path_factory.mktemp("probe-wheels")
    for name, (pkg, deps, init) in PROJECTS.items():
        (tmp / name / pkg).mkdir(parents=True)
        (tmp / name / pkg / "__init__.py").write_text(init)
        (tmp / name / "pyproject.toml").write_text(
            f'[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
            f'[project]\nname = "{name}"\nversion = "1.0"\ndependencies = {json.dumps(deps)}\n'
            f'[tool.setuptools]\npackages = ["{pkg}"]\n')
    r = subprocess.run([sys.executable, "-c", BUILD, str(tmp / "dist"), *(str(tmp / n) for n in PROJECTS)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    built = {n: next((tmp / "dist").glob(f"{PROJECTS[n][0]}-1.0-*.whl")) for n in PROJECTS}
    return built


def _shipment(tmp_path: Path, wheels: dict[str, Path], names: list[str]) -> tuple[Path, dict]:
    out = tmp_path / "ship"
    out.mkdir()
    files = [ship.file_entry(wheels[n], out, "wheel") for n in names]
    manifest = ship.make_manifest(out, files, dists=names, models=[], evals=False, ray_version=None, needs=NEEDS,
                                  piece_mib=1, batch_mib=1)
    return out, manifest


def _env(ship_dir: Path, site: Path, **more) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CTXSPARSE_GIT_REV")}
    env.update(SHIP=str(ship_dir), SITE=str(site), PYTHON=sys.executable, **more)
    return env


def _bare_host(*args: str, env: dict, shell: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["bash", "-c", shell] if shell else ["bash", str(SCRIPT), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _files(site: Path) -> dict[str, int]:
    return {str(p.relative_to(site)): p.stat().st_mtime_ns for p in site.rglob("*")}


def test_set_up_once_then_nothing_then_sourced(tmp_path, wheels):
    """``--setup-only`` installs the shipment's wheels into SITE (their requirements met, everything imported) and
    stamps it with the shipment's commit; a second run installs nothing and says so; sourcing the script exports the
    environment into the calling shell, where the shipped packages import from SITE."""
    ship_dir, manifest = _shipment(tmp_path, wheels, ["ctxsparse-probe-alpha", "ctxsparse-probe-beta"])
    assert [p.name for p in ship_dir.iterdir() if p.is_dir()] == ["batch-00"]
    site = tmp_path / "site"
    env = _env(ship_dir, site)
    r = _bare_host("--setup-only", env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"assembling {ship_dir}" in r.stdout and "no Ray in this shipment" in r.stdout
    assert "0 unmet requirement(s) of the shipped distributions" in r.stdout     # beta's need of alpha, met
    assert "models none; data 0 folder(s)" in r.stdout and f"{site} set up from {ship_dir}" in r.stdout
    assert (site / "ctxsparse_probe_beta" / "__init__.py").is_file()
    assert not (site / "bin" / "ray").exists() and not Path(f"{site}.stage").exists()
    (stamp,) = site.glob(".ctxsparse-ship-*")
    assert stamp.read_text().strip() == manifest["git_rev"]
    before = _files(site)
    # again: nothing installed, nothing touched
    r = _bare_host("--setup-only", env=env)
    assert r.returncode == 0 and r.stdout == f"bare_host: {site} already set up from this shipment\n", r.stdout
    assert _files(site) == before and not Path(f"{site}.stage").exists()
    # sourced: the calling shell gets PYTHONPATH (SITE, then the tree), PATH, the offline switches, the commit
    probe = ("import json, os, ctxsparse_probe_beta as b; print(json.dumps({'file': b.__file__, 'value': b.VALUE, "
             "'alpha': b.ALPHA, 'pythonpath': os.environ['PYTHONPATH'], 'path': os.environ['PATH'], "
             "'rev': os.environ['CTXSPARSE_GIT_REV'], 'offline': os.environ['HF_HUB_OFFLINE']}))")
    shell = f'source "{SCRIPT}" && "$PYTHON" -c "{probe}"'
    r = _bare_host(env=env, shell=shell)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "already set up from this shipment" in r.stdout
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(site) and (got["value"], got["alpha"]) == ("beta", "alpha")
    assert got["pythonpath"].split(":")[:2] == [str(site), str(ROOT)]
    assert got["path"].split(":")[0] == f"{site}/bin" and got["rev"] == manifest["git_rev"] and got["offline"] == "1"
    # without it, this shell has none of that
    r = _bare_host(env=env, shell='"$PYTHON" -c "import ctxsparse_probe_beta"')
    assert r.returncode != 0 and "No module named 'ctxsparse_probe_beta'" in r.stderr


def test_a_shipped_wheel_that_does_not_import_stops_the_set_up(tmp_path, wheels):
    """A shipped gguf that does not import on this host: the import check names the module, where it was
    installed and its error; exit non-zero, and the SITE is not stamped (the next run sets up again)."""
    ship_dir, _ = _shipment(tmp_path, wheels, ["ctxsparse-probe-alpha", "gguf"])
    site = tmp_path / "site"
    r = _bare_host("--setup-only", env=_env(ship_dir, site))
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith(f"bare_host: import check failed: gguf ({site}/gguf/__init__.py): ModuleNotFoundError: "
                          "No module named 'gguf._quants_cp399'"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "set up from" not in r.stdout
    assert not list(site.glob(".ctxsparse-ship-*"))


def _bare_python(tmp_path: Path) -> Path:
    """A Python like a GPU host's before its set-up: PyYAML, no pydantic (nor anything else of the environment)."""
    import yaml

    lib = tmp_path / "host-lib"
    lib.mkdir()
    (lib / "yaml").symlink_to(Path(yaml.__file__).parent)
    exe = tmp_path / "host-python"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{lib}" exec "{sys.executable}" -S "$@"\n')
    exe.chmod(0o755)
    return exe


@pytest.mark.parametrize("case", ["missing", "invalid", "not carried", "unparsable on a bare host"])
def test_the_spec_is_checked_before_the_set_up(tmp_path, wheels, case):
    """A sweep's spec is checked before any set-up work: a wrong path, a spec that does not validate or that the
    shipment cannot run (this Python loads the spec loader), YAML that does not parse (a host's Python before its
    set-up, without pydantic): one message, exit 2, nothing assembled or installed."""
    ship_dir, _ = _shipment(tmp_path, wheels, ["ctxsparse-probe-alpha"])
    site = tmp_path / "site"
    spec = tmp_path / "spec.yaml"
    env = _env(ship_dir, site)
    if case == "missing":
        must = [f"bare_host: spec {spec} not found"]
    elif case == "invalid":
        spec.write_text("name: x\nmodels: [smollm3-135m]\nmethods: [{name: oracle, sparsity: [0.5]}]\n")
        must = ["models.0", "unknown model 'smollm3-135m'"]
    elif case == "not carried":
        spec.write_text("name: x\nmodels: [smollm2-135m]\nmethods: [{name: oracle, sparsity: [0.5]}]\n")
        must = [f"the shipment under {ship_dir} lacks what {spec} needs: model smollm2-135m"]
    else:
        spec.write_text("name: x\nmodels: [smollm2-135m\n")
        env["PYTHON"] = str(_bare_python(tmp_path))
        must = [f"ship: spec {spec} does not parse", "expected ',' or ']'"]
    r = _bare_host(str(spec), env=env)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    for m in must:
        assert m in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "assembling" not in r.stdout
    assert not site.exists() and not Path(f"{site}.stage").exists()


def test_before_the_set_up_a_bare_host_parses_and_says_the_rest_follows(tmp_path, wheels):
    """Where the spec loader does not import yet, a spec that parses passes the early check, which says that the
    full check (here: an unknown model) follows the set-up; with the loader, the same spec is refused."""
    ship_dir, _ = _shipment(tmp_path, wheels, ["ctxsparse-probe-alpha"])
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: x\nmodels: [smollm3-135m]\nmethods: [{name: oracle, sparsity: [0.5]}]\n")
    args = ["-m", "orchestrator.deploy.ship", "check-spec", str(spec), "--ship", str(ship_dir), "--before-setup"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(_bare_python(tmp_path)), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == (f"spec {spec} parses; its full check follows the set-up (the spec loader needs "
                                "pydantic)")
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "unknown model 'smollm3-135m'" in r.stderr, r.stderr[-3000:]
