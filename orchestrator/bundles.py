"""Export a chosen setting's bundle from the store, and fetch one someone exported or downloaded.

    ctxsparse bundle export FIT_UNIT --out DIR|FILE.tar.gz
    ctxsparse bundle export --best MODEL [--by latency|sparsity] [--metric M] [--device cpu] [--max-loss 0.05] --out ...
    ctxsparse bundle download SRC --out DIR        (SRC: a .tar.gz file or an http(s) URL to one)

Export reads the fit unit's ``bundle_file`` artifacts, checks each file's sha256 against both the store and the
bundle's own manifest, then copies the folder (or packs it). The copy's manifest records where the sweep timed the
setting (``measured``: device type, accelerator, thread count, ms per token, speedup over dense and its spread,
from the front of ``--device`` at its thread count: ``db.front.pareto.measurement``), so ``ctxsparse generate``
decodes at that thread count by default. Download unpacks only the bundle's two files and verifies them the same
way. Nothing is unpickled anywhere.
"""
from __future__ import annotations

import shutil
import tempfile
import urllib.request
from pathlib import Path

from db.front.pareto import choose, choose_sparsest
from db.store import Store
from workers.sparsity.bundle import BundleError, extract_bundle, load_bundle, pack_bundle, with_measurement
from workers.paths import sha256_file


def resolve_unit(store: Store, ref: str) -> str:
    ids = store.unit_ids_with_prefix(ref.lower())
    if not ids:
        raise BundleError(f"no unit with id {ref!r} in the store")
    if len(ids) > 1:
        raise BundleError(f"{ref!r} matches {len(ids)} units; give more characters")
    return ids[0]


def best_unit(store: Store, model: str, metric: str | None, device: str, max_loss: float, by: str = "latency",
              threads: int | None = None) -> str:
    """The fit unit ``bundle export --best`` ships: ``db.front.pareto.choose`` (by latency on ``device``, at
    ``threads``: default the front's largest count) or ``choose_sparsest`` (by realized sparsity, any device); see
    there for the rules."""
    if by not in ("latency", "sparsity"):
        raise BundleError(f"--by must be latency or sparsity, not {by!r}")
    _, front = store.front(model, metric, device, threads=threads)
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


def bundle_folder(store: Store, unit_id: str) -> Path:
    unit = store.unit(unit_id)
    if unit is None or unit.kind != "fit":
        raise BundleError(f"unit {unit_id[:12]} is not a fitted setting (kind {getattr(unit, 'kind', None)!r})")
    if unit.status != "done":
        raise BundleError(f"unit {unit_id[:12]} is {unit.status}, not done: no bundle yet")
    arts = store.artifacts(unit_id, "bundle_file")
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


def export(store: Store, unit_id: str, out: str | Path, measured: dict | None = None) -> tuple[Path, dict]:
    """Copy (or pack, for ``.tar.gz``) the fit unit's verified bundle to ``out``; ``measured`` (where the sweep timed
    it: ``Store.measurement``) goes into the copy's manifest (``workers.sparsity.bundle.with_measurement``). Returns
    (out, the copy's manifest)."""
    src = bundle_folder(store, unit_id)
    load_bundle(src)
    out = Path(out)
    if out.exists():
        raise BundleError(f"{out}: already exists")
    packed = out.name.endswith(".tar.gz")
    tmp = Path(tempfile.mkdtemp(dir=out.parent if out.parent.exists() else None, prefix=".export-"))
    try:
        folder = tmp / (out.name[: -len(".tar.gz")] if packed else out.name)     # the archive's top folder
        folder.mkdir()
        for name in ("manifest.json", "predictors.safetensors"):
            shutil.copy2(src / name, folder / name)
        b = with_measurement(folder, measured) if measured is not None else load_bundle(folder)
        if packed:
            pack_bundle(folder, out)
        else:
            folder.rename(out)
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
