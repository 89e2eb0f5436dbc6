"""Predictor bundles: what a user takes home from a sweep, and ``apply_bundle`` to put one on a model.

A bundle is a folder of two files, never a pickle:

    manifest.json            format, model (ref, fingerprint, family, dims), method, s, r, attention sparsity,
                             allocation, options, per-layer budgets, the plan (mode, sequential filters, every
                             predictor's JSON config, input-sparsity thresholds {layer: {projection: t}} and
                             their score, and ``parts``: {kind: config} of every plan part, workers.sparsity.parts),
                             versions, git revision, the unit it came from, the
                             sha256 and size of every data file, and ``manifest_sha256`` over the rest of itself;
                             an exported copy also ``measured``: where, at which thread count and how fast
                             the sweep timed the setting (``with_measurement``; older bundles lack it)
    predictors.safetensors   every predictor tensor, keyed ``mlp.<layer>.<name>`` / ``attn.<layer>.<name>``, and
                             every part's, keyed ``<kind>.<the part's own name>`` (LaRoSA's rotations
                             ``larosa.<layer>.<group>``, a rotation shared by several inputs or layers stored once;
                             R-Sparse's factors ``rsparse.<layer>.<projection>.a`` / ``.b``)

Format versions: 1, plans of predictors and input thresholds (still written for them: older code reads them);
3, plans with parts (``plan.parts``). Version 2, written before parts were registered whole, had a rotated plan
under ``plan.rotated`` (tensors ``rot.<layer>.<group>``, named in full by the manifest) and a rank-sparse one
under ``plan.lowrank`` (tensors ``lowrank.<layer>.<projection>.a`` / ``.b``); it is read through each part type's
``legacy_key`` / ``legacy_prefix``. Parts run in masked mode (``apply_bundle``), whatever mode is asked for.

``load_bundle`` checks all of it (a truncated tensor file, an edited manifest, a foreign file name all fail
with ``BundleError``); ``apply_bundle(model, path)`` also checks that the model is the one the bundle was fitted
on (its fingerprint) and then swaps the sparse modules in (``.revert()`` undoes it). Only ``workers`` and
``kernels`` are imported: applying a bundle needs no Ray and no database.

    from workers.sparsity.bundle import apply_bundle
    applied = apply_bundle(model, "smollm2-svd-s0.5-r256/")   # HF model in, sparse model out
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from workers.paths import atomic_dir, sha256_file

FORMAT = "ctxsparse-bundle"
FORMAT_VERSION = 1          # plans of predictors and input thresholds
FORMAT_VERSION_LEGACY = 2   # plans with a rotated (LaRoSA) or rank-sparse (R-Sparse) part, under their own keys
FORMAT_VERSION_PARTS = 3    # plans with parts (plan.parts)
_READS = (FORMAT_VERSION, FORMAT_VERSION_LEGACY, FORMAT_VERSION_PARTS)
MANIFEST = "manifest.json"
MEASURED = "measured"       # manifest key of an exported bundle: where and at which thread count it was timed
TENSORS = "predictors.safetensors"
_DATA_FILES = (TENSORS,)
_KEY = re.compile(r"^(mlp|attn)\.(\d+)\.([A-Za-z0-9_.]+)$")


class BundleError(ValueError):
    """A bundle that is damaged, tampered with, or for another model."""


@dataclass
class Bundle:
    path: Path
    manifest: dict
    tensors: dict[str, torch.Tensor]
    parts: dict[str, tuple[dict, dict[str, torch.Tensor]]] = field(default_factory=dict)   # kind: (config, tensors)

    @property
    def fingerprint(self) -> str:
        return self.manifest["model"]["fingerprint"]

    def plan(self, model: torch.nn.Module, device: str | torch.device | None = None):
        """The SparsityPlan, rebuilt onto ``model``'s own FFN weights (for methods that read them), every predictor
        on ``device`` (default: the model's; fitting code that scores cached activations asks for the CPU)."""
        from workers.loading.adapters import adapter_for
        from workers.sparsity.predictors.base import SparsityPlan

        ad = adapter_for(model)
        layers = ad.decoder_layers(model)
        device = torch.device(device) if device is not None else next(model.parameters()).device
        p = self.manifest["plan"]
        classes = _predictor_classes()
        try:   # input thresholds are plain numbers: they live in the (digested) manifest
            inputs = {int(k): {str(proj): float(t) for proj, t in per.items()}
                      for k, per in p.get("inputs", {}).items()}
            plan = SparsityPlan(mlp_mode=p["mlp_mode"], dense_gate=p["dense_gate"],
                                seq_filter={int(k): float(v) for k, v in p["seq_filter"].items()},
                                seq_filter_on=p.get("seq_filter_on", "gate"),
                                info={int(k): v for k, v in p["info"].items()},
                                inputs=inputs, input_score=p.get("input_score", "abs"))
        except (AttributeError, TypeError, ValueError) as e:
            raise BundleError(f"{self.path}: bad plan in the manifest ({e})") from None
        for layer in inputs:
            if not 0 <= layer < len(layers):
                raise BundleError(f"{self.path}: input thresholds for layer {layer}, model has {len(layers)}")
        for comp, target in (("mlp", plan.mlp), ("attn", plan.attn)):
            for layer_s, cfg in p[comp].items():
                layer = int(layer_s)
                if not 0 <= layer < len(layers):
                    raise BundleError(f"{self.path}: {comp} predictor for layer {layer}, model has {len(layers)}")
                cls = classes.get((comp, cfg.get("method")))
                if cls is None:
                    raise BundleError(f"{self.path}: no {comp} predictor class for method {cfg.get('method')!r}")
                prefix = f"{comp}.{layer}."
                tensors = {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}
                weights = {k: v.detach().to(device, torch.float32) for k, v in ad.ffn_weights(layers[layer]).items()}
                try:
                    target[layer] = cls.from_parts(cfg, tensors, weights).to(device)
                except (KeyError, RuntimeError, ValueError) as e:
                    raise BundleError(f"{self.path}: {comp} layer {layer}: cannot rebuild the predictor ({e})") \
                        from None
        plan.parts = [self._part(kind, cfg, tensors, len(layers), device)
                      for kind, (cfg, tensors) in self.parts.items()]
        return plan

    def _part(self, kind: str, cfg: dict, tensors: dict, n_layers: int, device):
        typ = _part_types()[kind]
        try:
            part = typ.from_bundle(cfg, tensors, device)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise BundleError(f"{self.path}: bad {typ.label} plan in the manifest ({e})") from None
        bad = [l for l in part.layers() if not 0 <= l < n_layers]
        if bad:
            raise BundleError(f"{self.path}: {typ.label} part for layer {bad[0]}, model has {n_layers}")
        return part


def _predictor_classes() -> dict[tuple[str, str], type]:
    import workers.methods  # noqa: F401  (registers every method, defining its predictor classes)
    from workers.sparsity.predictors.base import HeadPredictor, MLPPredictor

    out: dict[tuple[str, str], type] = {}

    def walk(base, comp):
        for c in base.__subclasses__():
            # only our own method folders' classes: a subclass defined elsewhere (a test's, a user's) is not trusted
            if c.__dict__.get("method") and c.__module__.startswith("workers.methods."):
                if (comp, c.method) in out and out[(comp, c.method)] is not c:
                    raise RuntimeError(f"two {comp} predictor classes claim method {c.method!r}")
                out[(comp, c.method)] = c
            walk(c, comp)

    walk(MLPPredictor, "mlp")
    walk(HeadPredictor, "attn")
    return out


def _part_types() -> dict[str, type]:
    import workers.methods  # noqa: F401  (registers every method's part type)
    from workers.sparsity.parts import PART_TYPES

    return PART_TYPES


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _manifest_digest(manifest: dict) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in manifest.items() if k != "manifest_sha256"})).hexdigest()


def save_bundle(plan, lm, out: str | Path, *, method: str, sparsity: float, rank: int | None = None,
                attn_sparsity: float | None = None, allocation: str = "uniform", options: dict | None = None,
                per_layer_sparsity: dict[int, float] | None = None, unit_id: str | None = None,
                versions: dict[str, str] | None = None, git_rev: str | None = None,
                head: dict | None = None) -> Path:
    """Write ``plan`` (fitted on ``lm``, a workers.loading.models.LoadedModel) as a bundle folder at ``out``, atomically."""
    out = Path(out)
    tensors: dict[str, torch.Tensor] = {}
    cfgs: dict[str, dict[str, dict]] = {"mlp": {}, "attn": {}}
    for comp, preds in (("mlp", plan.mlp), ("attn", plan.attn)):
        for layer, pred in sorted(preds.items()):
            cfgs[comp][str(layer)] = pred.config()
            for name, t in pred.to_tensors().items():
                tensors[f"{comp}.{layer}.{name}"] = t.detach().to("cpu").contiguous().clone()
    parts = {}
    for part in plan.parts:
        parts[part.kind], own = part.to_bundle()
        for name, t in own.items():
            tensors[f"{part.kind}.{name}"] = t.detach().to("cpu").contiguous().clone()
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION_PARTS if parts else FORMAT_VERSION,
        "model": {"ref": lm.ref, "fingerprint": lm.fingerprint, "family": lm.family,
                  "dims": {k: int(v) for k, v in asdict(lm.dims).items()}},
        "method": method, "sparsity": float(sparsity), "rank": rank,
        "attn_sparsity": None if attn_sparsity is None else float(attn_sparsity),
        "allocation": allocation, "options": dict(options or {}), **({"head": dict(head)} if head else {}),
        "per_layer_sparsity": {str(k): float(v) for k, v in sorted((per_layer_sparsity or {}).items())},
        "plan": {"mlp_mode": plan.mlp_mode, "dense_gate": bool(plan.dense_gate),
                 "seq_filter": {str(k): float(v) for k, v in sorted(plan.seq_filter.items())},
                 "seq_filter_on": plan.seq_filter_on,
                 "info": {str(k): v for k, v in sorted(plan.info.items())},
                 "inputs": {str(k): {p: float(t) for p, t in sorted(per.items())}
                            for k, per in sorted(plan.inputs.items())},
                 "input_score": plan.input_score, **cfgs, **({"parts": parts} if parts else {})},
        "unit_id": unit_id, "versions": dict(versions or {}), "git_rev": git_rev,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / TENSORS), metadata={"format": FORMAT})
        manifest["files"] = {TENSORS: {"sha256": sha256_file(tmp / TENSORS),
                                       "size": (tmp / TENSORS).stat().st_size}}
        try:
            manifest["manifest_sha256"] = _manifest_digest(manifest)
        except (TypeError, ValueError) as e:
            raise BundleError(f"plan info is not plain JSON ({e})") from None
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return out


def with_measurement(path: str | Path, measured: dict) -> Bundle:
    """Record in the bundle folder ``path`` where, at which thread count and how fast the sweep timed its setting
    (``measured``: plain JSON; ``threads`` a count >= 1 or None), re-digest the manifest and return the verified
    bundle. ``bundle export`` does it on its copy, so ``ctxsparse generate`` runs at the thread count the setting
    was chosen at (:func:`measured_threads`)."""
    b = load_bundle(path)
    threads = measured.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise BundleError(f"measured threads must be a count >= 1 or None, not {threads!r}")
    manifest = {k: v for k, v in b.manifest.items() if k != "manifest_sha256"}
    manifest[MEASURED] = dict(measured)
    try:
        manifest["manifest_sha256"] = _manifest_digest(manifest)
    except (TypeError, ValueError) as e:
        raise BundleError(f"measurement is not plain JSON ({e})") from None
    tmp = b.path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    tmp.replace(b.path / MANIFEST)
    return load_bundle(b.path)


def measured_threads(manifest: dict, device_type: str = "cpu") -> int | None:
    """The thread count the bundle's setting was timed at on ``device_type`` (its ``measured`` record), or None
    (a bundle exported before it was recorded, or timed on another device type)."""
    m = manifest.get(MEASURED)
    if not isinstance(m, dict) or m.get("device_type") != device_type:
        return None
    t = m.get("threads")
    return t if isinstance(t, int) and not isinstance(t, bool) and t >= 1 else None


def load_bundle(path: str | Path) -> Bundle:
    """Read and verify a bundle folder (format, manifest digest, every file's size and sha256, tensor keys)."""
    path = Path(path)
    if not path.is_dir():
        raise BundleError(f"{path}: not a bundle folder")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise BundleError(f"{path}: no {MANIFEST}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}/{MANIFEST}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("format_version") not in _READS:
        raise BundleError(f"{path}: format version {manifest.get('format_version')!r}, this code reads "
                          f"{' and '.join(map(str, _READS))}")
    try:
        digest = _manifest_digest(manifest)
    except (TypeError, ValueError) as e:
        raise BundleError(f"{path}/{MANIFEST}: not canonical JSON ({e})") from None
    if manifest.get("manifest_sha256") != digest:
        raise BundleError(f"{path}/{MANIFEST}: manifest_sha256 does not match its content (edited or damaged)")
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != set(_DATA_FILES):
        raise BundleError(f"{path}: manifest lists files {sorted(files or {})}, expected {list(_DATA_FILES)}")
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            raise BundleError(f"{path}: missing {name}")
        if f.stat().st_size != want.get("size"):
            raise BundleError(f"{path}/{name}: {f.stat().st_size} bytes, manifest says {want.get('size')} "
                              "(truncated or replaced)")
        if sha256_file(f) != want.get("sha256"):
            raise BundleError(f"{path}/{name}: sha256 mismatch (damaged or replaced)")
    try:
        tensors = load_file(str(path / TENSORS))
    except (SafetensorError, OSError, ValueError) as e:
        raise BundleError(f"{path}/{TENSORS}: unreadable ({e})") from None
    plan = manifest.get("plan") or {}
    parts, claimed = _parts(path, manifest["format_version"], plan, tensors)
    for k in tensors:
        m = _KEY.match(k)
        if not (k in claimed or (m and str(int(m.group(2))) in plan[m.group(1)])):
            raise BundleError(f"{path}/{TENSORS}: unexpected tensor {k!r}")
    return Bundle(path, manifest, tensors, parts)


def _parts(path: Path, version: int, plan: dict, tensors: dict) -> tuple[dict, set[str]]:
    """({kind: (config, the part's tensors by its own names)}, the bundle's keys of those tensors): format 3's
    ``plan.parts``, or format 2's parts under their ``legacy_key`` (tensor keys starting ``legacy_prefix``)."""
    types = _part_types()
    if version == FORMAT_VERSION_PARTS:
        unknown = sorted(set(plan.get("parts") or {}) - set(types))
        if unknown:
            raise BundleError(f"{path}: plan part {unknown[0]!r} is not known here (known: {sorted(types)})")
        found = {kind: (cfg, f"{kind}.") for kind, cfg in (plan.get("parts") or {}).items()}
    else:
        found = {kind: (typ.legacy_config(plan[typ.legacy_key]), typ.legacy_prefix) for kind, typ in types.items()
                 if typ.legacy_key is not None and plan.get(typ.legacy_key) is not None}
    parts, claimed = {}, set()
    for kind, (cfg, prefix) in found.items():
        try:
            names = types[kind].tensor_keys(cfg)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise BundleError(f"{path}: bad {types[kind].label} plan in the manifest ({e})") from None
        own = {k[len(prefix):]: k for k in tensors if k.startswith(prefix)}
        missing = sorted(names - set(own))
        if missing:
            raise BundleError(f"{path}/{TENSORS}: no tensor {prefix + missing[0]!r}, which the manifest's "
                              f"{types[kind].label} plan names")
        parts[kind] = (cfg, {name: tensors[own[name]] for name in names})
        claimed |= {own[name] for name in names}
    return parts, claimed


def apply_bundle(model: torch.nn.Module, bundle: str | Path | Bundle, *, check_model: bool = True,
                 mode: str = "auto"):
    """Put a bundle on a Hugging Face model; returns ``AppliedSparsity`` (``.revert()`` restores the model).

    Refuses (``BundleError``) a damaged bundle, and one fitted on another model: the model's fingerprint
    (config + float32 weights) must equal the bundle's. Rotated and rank-sparse parts run masked whatever ``mode``.
    """
    from workers.loading.models import fingerprint
    from workers.sparsity.sparse_exec import apply_sparsity

    b = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    if check_model:
        fp = fingerprint(model)
        if fp != b.fingerprint:
            raise BundleError(f"{b.path}: fitted on model {b.manifest['model']['ref']} "
                              f"(fingerprint {b.fingerprint[:12]}), this model's fingerprint is {fp[:12]}")
    plan = b.plan(model)
    # mode: "kernel" (only the selected work), "masked" (dense products, unselected entries zeroed) or "auto"
    # (masked); see workers.sparsity.sparse_exec
    return apply_sparsity(model, plan, input_mode="kernel" if mode == "kernel" else "masked", mode=mode)


def pack_bundle(path: str | Path, out: str | Path) -> Path:
    """Verify a bundle folder and write it as a ``.tar.gz`` (the two files, under the folder's name)."""
    import tarfile

    b = load_bundle(path)
    out = Path(out)
    with tarfile.open(out, "w:gz") as tar:
        for name in (MANIFEST, *_DATA_FILES):
            tar.add(b.path / name, arcname=f"{b.path.name}/{name}", recursive=False)
    return out


def extract_bundle(archive: str | Path, out: str | Path) -> Bundle:
    """Unpack a bundle archive into the folder ``out`` and verify it.

    Only the bundle's own regular files are taken (``manifest.json``, ``predictors.safetensors``, optionally
    under one top folder); links, devices, other names and paths that would leave ``out`` are refused.
    """
    import tarfile

    out = Path(out)
    if out.exists():
        raise BundleError(f"{out}: already exists (choose a new folder)")
    wanted = {MANIFEST, *_DATA_FILES}
    try:
        tar = tarfile.open(archive, "r:*")
    except (OSError, tarfile.TarError) as e:
        raise BundleError(f"{archive}: not a readable bundle archive ({e})") from None
    with tar, atomic_dir(out) as tmp:
        found = set()
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if m.isdir() and len(parts) == 1 and ".." not in parts:
                continue
            name = parts[-1] if parts else ""
            if not m.isfile() or name not in wanted or len(parts) > 2 or ".." in parts or Path(m.name).is_absolute():
                raise BundleError(f"{archive}: unexpected member {m.name!r} (a bundle holds only {sorted(wanted)})")
            if name in found:
                raise BundleError(f"{archive}: {name} appears twice")
            src = tar.extractfile(m)
            (tmp / name).write_bytes(src.read())
            found.add(name)
        if found != wanted:
            raise BundleError(f"{archive}: missing {sorted(wanted - found)}")
        load_bundle(tmp)
    return load_bundle(out)
