"""Load GPU benchmark results (JSON written where no database client exists) into the SQL store.

The GPU machines run ``python -m benchmarks.kernels --json FILE`` (``kernels/`` never imports the DB); this module
turns each row into a finished work unit of kind ``kernel`` with one latency row, idempotently: a unit's id is
the hash of the row's identity, so loading the same file twice adds nothing.

How a kernel row maps onto a latency row (the store's latency table is per decode token):
  * the "model" is the shape with random weights (``llama2-7b-shape``: d, D), named and fingerprinted by
    ``workers.names.shape_identity`` (as a sweep's ``shape:NAME`` model is, so both land on one model);
  * ``p50/p90_ms_per_token`` = the FFN op's median / p90 time (µs / 1000) for one decode step of ``batch``
    tokens, ``tokens_per_s`` = batch / that time: one FFN layer, not a whole model;
  * ``runtime`` = ``kernel:<variant>`` (dense, triton_fused, torch_index, triton_seq50, attn_triton, ...), ``prompt_len`` 0,
    ``gen_len`` 1, ``realized_sparsity`` = the row's sparsity.

    ctxsparse ingest-kernels benchmarks/results/h200_2026-11-29.json [--db URL]
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from db.schemas import LatencyRow, ModelSpec, NewUnit
from db.store import Store
from workers.names import shape_identity

CODE_VERSION = "kernels-bench-1"
_REQUIRED = ("device_type", "accelerator_name", "shape", "d", "D", "dtype", "batch", "sparsity", "variant",
             "us_median", "us_p90")


class IngestError(ValueError):
    pass


def _flat(row: dict) -> dict:
    """A ``benchmarks.harness.Row`` (files written since the shared harness) in the flat fields of the first
    result files: op -> variant, device -> accelerator_name, median / p90 -> µs, ``extra`` on top."""
    if "bench" not in row or "extra" not in row:
        return row
    scale = {"us": 1.0, "ms": 1e3, "s": 1e6}.get(row.get("unit"))
    if scale is None or row.get("median") is None or row.get("p90") is None:
        return row          # reported as missing fields below
    flat = {**row["extra"], "us_median": row["median"] * scale, "us_p90": row["p90"] * scale}
    for key, src in (("accelerator_name", "device"), ("shape", "shape"), ("dtype", "dtype"), ("batch", "batch"),
                     ("variant", "op")):
        if src in row:
            flat[key] = row[src]
    return flat


def _unit_id(row: dict) -> str:
    ident = [row[k] for k in ("accelerator_name", "shape", "dtype", "batch", "sparsity", "variant")]
    ident.append(row.get("run", ""))
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:40]


def ingest_kernel_results(path: str | Path, db_url: str | None = None) -> tuple[int, int]:
    """-> (rows in the file, units newly finished). Raises IngestError on a malformed file."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise IngestError(f"{path}: cannot read benchmark JSON ({e})") from None
    rows = doc.get("rows") if isinstance(doc, dict) else doc
    if not isinstance(rows, list) or not rows:
        raise IngestError(f"{path}: expected a list of rows (or {{'meta', 'rows'}})")
    rows = [_flat(r) if isinstance(r, dict) else r for r in rows]
    for i, r in enumerate(rows):
        missing = [k for k in _REQUIRED if k not in r]
        if missing:
            raise IngestError(f"{path}: row {i} lacks {missing}")
    meta = doc.get("meta", {}) if isinstance(doc, dict) else {}
    store = Store(db_url)
    store.migrate()
    spec = {"kind": "kernel-bench", "file": Path(path).name, "meta": meta}
    spec_hash = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    units = _units(rows)
    store.record_sweep(name=f"kernel-bench {Path(path).stem}", spec_hash=spec_hash, spec=spec, units=units)
    versions = {k: v for k, v in (("torch", meta.get("torch")), ("triton", meta.get("triton"))) if v}
    new = 0
    for r, u in zip(rows, units):
        # lazy: the row is made and checked once the unit is claimed (one already finished is skipped unread)
        lat = (_latency_row(r, versions) for _ in (0,))
        new += store.claim_and_finish_unit(u.unit["id"], "ingest", latency_rows=lat)
    return len(rows), new


def _latency_row(r: dict, versions: dict) -> LatencyRow:
    return LatencyRow(device_type=r["device_type"], accelerator_name=r["accelerator_name"],
                      batch=r["batch"], prompt_len=0, gen_len=1, p50_ms_per_token=r["us_median"] / 1000,
                      p90_ms_per_token=r["us_p90"] / 1000,
                      tokens_per_s=r["batch"] / (r["us_median"] * 1e-6),
                      realized_sparsity=r["sparsity"], runtime=f"kernel:{r['variant']}",
                      package_versions=versions or {"unknown": "unknown"}, git_rev=r.get("git_rev", "unknown"))


def _units(rows: list[dict]) -> list[NewUnit]:
    """Each row's unit of kind ``kernel``, on its shape's model (``workers.names.shape_identity``; of rows naming
    one shape, the first row's dimensions)."""
    models: dict[str, ModelSpec] = {}
    out = []
    for r in rows:
        name, fp = shape_identity(r["shape"], r["d"], r["D"])
        model = models.setdefault(name, ModelSpec(name=name, fingerprint=fp, family="shape",
                                                  config={"d": r["d"], "D": r["D"], "weights": "random"}))
        out.append(NewUnit(model=model, unit=dict(id=_unit_id(r), kind="kernel", method=r["variant"],
                                                  sparsity=r["sparsity"], device_type=r["device_type"], config=r,
                                                  code_version=CODE_VERSION)))
    return out
