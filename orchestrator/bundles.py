"""Export a chosen setting's bundle from the store, and fetch one someone exported or downloaded.

    ctxsparse bundle export FIT_UNIT --out DIR|FILE.tar.gz
    ctxsparse bundle export --best MODEL [--by latency|sparsity] [--metric M] [--device cpu] [--max-loss 0.05] --out ...
    ctxsparse bundle download SRC --out DIR        (SRC: a .tar.gz file or an http(s) URL to one)

Export reads the fit unit's ``bundle_file`` artifacts, checks each file's sha256 against both the store and the
bundle's own manifest, then copies the folder (or packs it). Download unpacks only the bundle's two files and
verifies them the same way. Nothing is unpickled anywhere.
"""
from __future__ import annotations

import shutil
import tempfile
import urllib.request
from pathlib import Path

from db import queries
from db.engine import session_scope
from orchestrator.pareto import choose, choose_sparsest, front_for
from workers.sparsity.bundle import BundleError, extract_bundle, load_bundle, pack_bundle
from workers.paths import sha256_file


def resolve_unit(session, ref: str) -> str:
    ids = queries.unit_ids_with_prefix(session, ref.lower())
    if not ids:
        raise BundleError(f"no unit with id {ref!r} in the store")
    if len(ids) > 1:
        raise BundleError(f"{ref!r} matches {len(ids)} units; give more characters")
    return ids[0]


def best_unit(session, model: str, metric: str | None, device: str, max_loss: float, by: str = "latency") -> str:
    """The fit unit ``bundle export --best`` ships: ``orchestrator.pareto.choose`` (by latency on ``device``)
    or ``choose_sparsest`` (by realized sparsity, any device); see there for the rules."""
    if by not in ("latency", "sparsity"):
        raise BundleError(f"--by must be latency or sparsity, not {by!r}")
    _, front = front_for(session, model, metric, device)
    if by == "sparsity":
        row = choose_sparsest(front, max_loss)
        if row is None:
            raise BundleError(f"no sparse setting of {model} is within {100 * max_loss:g}% of dense "
                              f"on {front.metric}")
        return row.setting.fit_unit
    if front.message:
        raise BundleError(f"cannot choose for {model} on {device}: {front.message}")
    row = choose(front, max_loss)
    if row is None:
        raise BundleError(f"no timed setting of {model} on {device} is within {100 * max_loss:g}% of dense "
                          f"on {front.metric}")
    return row.setting.fit_unit


def bundle_folder(session, unit_id: str) -> Path:
    unit = queries.get_unit(session, unit_id)
    if unit is None or unit.kind != "fit":
        raise BundleError(f"unit {unit_id[:12]} is not a fitted setting (kind {getattr(unit, 'kind', None)!r})")
    if unit.status != "done":
        raise BundleError(f"unit {unit_id[:12]} is {unit.status}, not done: no bundle yet")
    arts = queries.artifacts_for(session, unit_id, "bundle_file")
    if not arts:
        raise BundleError(f"unit {unit_id[:12]} has no bundle artifacts")
    folders = {Path(a.uri).parent for a in arts}
    if len(folders) != 1:
        raise BundleError(f"unit {unit_id[:12]}: bundle files in several folders {sorted(map(str, folders))}")
    for a in arts:
        p = Path(a.uri)
        if not p.is_file():
            raise BundleError(f"{p}: recorded in the store but missing on disk (is CTXSPARSE_HOME shared?)")
        if a.sha256 and sha256_file(p) != a.sha256:
            raise BundleError(f"{p}: sha256 differs from the store's record (damaged or replaced)")
    return folders.pop()


def export(session, unit_id: str, out: str | Path) -> tuple[Path, dict]:
    src = bundle_folder(session, unit_id)
    b = load_bundle(src)
    out = Path(out)
    if out.exists():
        raise BundleError(f"{out}: already exists")
    if out.name.endswith(".tar.gz"):
        pack_bundle(src, out)
    else:
        tmp = Path(tempfile.mkdtemp(dir=out.parent if out.parent.exists() else None, prefix=".export-"))
        try:
            for name in ("manifest.json", "predictors.safetensors"):
                shutil.copy2(src / name, tmp / name)
            load_bundle(tmp)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out, b.manifest


def download(src: str, out: str | Path, timeout_s: float = 60.0) -> tuple[Path, dict]:
    if src.startswith(("http://", "https://")):
        with tempfile.TemporaryDirectory() as d:
            local = Path(d) / "bundle.tar.gz"
            try:
                with urllib.request.urlopen(src, timeout=timeout_s) as r, open(local, "wb") as f:
                    shutil.copyfileobj(r, f)
            except OSError as e:
                raise BundleError(f"{src}: download failed ({e})") from None
            b = extract_bundle(local, out)
    else:
        b = extract_bundle(src, out)
    return Path(out), b.manifest
