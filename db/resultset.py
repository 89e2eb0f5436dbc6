"""A sweep's rows as JSON lines, and loading such a file into any store (SQLite or PostgreSQL).

A result set is what a store knows about one sweep: the sweep, its units (status, config, worker, timings,
errors), the models and datasets they point at, and every accuracy, latency and per-layer row of those units, and
the scored requests of the task shards whose task is not assembled yet, so a sweep loaded elsewhere can still
assemble it (``request_scores``: ``"unassembled"``; ``"all"``: every shard's, which a full grid makes millions of
rows; ``"none"``: no shard's, a sweep's rows published while it still runs). Artifacts are left out: they name
files on the host that ran the sweep (activation caches, bundles).

    {"format": "ctxsparse-resultset-1", "sweep": NAME, "schema_revision": REV, "exported_at": ISO}
    {"table": "models", "row": {...}}
    ...

One line per row (every column of its table), tables in dependency order; a file written before a column existed
loads with that column NULL (e.g. latency rows' ``cpu_flags`` / ``isa``, the CPU build they were timed under).
Loading maps the store-local integer keys through the natural ones (model and dataset fingerprints, the sweep's
spec hash; units are keyed by their content hash already) and inserts what the store lacks: loading twice, or into
a store that ran some of the same units, adds nothing twice (a unit timed under another CPU build adds that
build's latency rows beside the store's own). The whole file loads in one transaction: a bad line stops it with
the line number and writes nothing.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.models import (AccuracyResult, Dataset, LatencyResult, LayerMetric, Model, RequestScore, Sweep, SweepUnit,
                       WorkUnit)
from db.queries import _insert, _refresh_sweep_counts, _table, get_or_create_sweep, upsert_dataset, upsert_model
from db.units import TaskEvalConfig, unit_config

FORMAT = "ctxsparse-resultset-1"
RESULT_TABLES = {"accuracy_results": AccuracyResult, "latency_results": LatencyResult,
                 "layer_metrics": LayerMetric, "request_scores": RequestScore}
TABLES = ("models", "datasets", "sweeps", "work_units", "sweep_units", *RESULT_TABLES)
REQUEST_SCORES = ("unassembled", "all", "none")    # which task shards' scored requests an export carries
_DATETIMES = ("created_at", "started_at", "finished_at")


class ResultSetError(ValueError):
    """A result-set file that cannot be loaded (the message names the line)."""


def _row(obj) -> dict[str, Any]:
    out = {}
    for c in obj.__table__.columns:
        v = getattr(obj, c.key)
        out[c.key] = v.isoformat() if isinstance(v, datetime) else v
    return out


def _assembled_shards(units: list) -> set[str]:
    """The shard units (eval config with ``shard``) whose task's unit (the same config without it: the id of the
    unsharded unit, ``orchestrator.plan.task_units``) is done among ``units``: nothing reads their scores again."""
    def key(c: TaskEvalConfig) -> str:
        return json.dumps(c.canonical(), sort_keys=True)

    evals = [(u, unit_config("eval", u.config)) for u in units if u.kind == "eval"]
    tasks = [(u, c) for u, c in evals if isinstance(c, TaskEvalConfig)]
    done = {key(c) for u, c in tasks if u.status == "done" and c.shard is None}
    return {u.id for u, c in tasks if c.shard is not None and key(c.whole) in done}


def export_sweep(session: Session, sweep: str | int, schema_revision: str | None = None,
                 request_scores: str = "unassembled") -> Iterator[dict]:
    """The records of one sweep (by name, newest of that name, or id): a header, then rows in TABLES order.
    Request scores (``REQUEST_SCORES``): of the shards whose task is not assembled yet, of every shard, or none."""
    if request_scores not in REQUEST_SCORES:
        raise ResultSetError(f"request_scores is one of {list(REQUEST_SCORES)}, not {request_scores!r}")
    stmt = select(Sweep).where(Sweep.id == sweep) if isinstance(sweep, int) else \
        select(Sweep).where(Sweep.name == sweep).order_by(Sweep.id.desc()).limit(1)
    sw = session.scalars(stmt).first()
    if sw is None:
        known = sorted(set(session.scalars(select(Sweep.name))))
        raise ResultSetError(f"no sweep {sweep!r} in this store (sweeps: {', '.join(known) or 'none'})")
    unit_ids = list(session.scalars(select(SweepUnit.unit_id).where(SweepUnit.sweep_id == sw.id)
                                    .order_by(SweepUnit.unit_id)))
    units = list(session.scalars(select(WorkUnit).where(WorkUnit.id.in_(unit_ids)).order_by(WorkUnit.id)))
    yield {"format": FORMAT, "sweep": sw.name, "schema_revision": schema_revision,
           "exported_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    model_ids = sorted({u.model_id for u in units})
    dataset_ids = sorted({u.dataset_id for u in units if u.dataset_id is not None})
    for m in session.scalars(select(Model).where(Model.id.in_(model_ids)).order_by(Model.id)):
        yield {"table": "models", "row": _row(m)}
    for d in session.scalars(select(Dataset).where(Dataset.id.in_(dataset_ids)).order_by(Dataset.id)):
        yield {"table": "datasets", "row": _row(d)}
    yield {"table": "sweeps", "row": _row(sw)}
    for u in units:
        yield {"table": "work_units", "row": _row(u)}
    for uid in unit_ids:
        yield {"table": "sweep_units", "row": {"sweep_id": sw.id, "unit_id": uid}}
    if request_scores == "none":
        skip = set(unit_ids)
    else:
        skip = set() if request_scores == "all" else _assembled_shards(units)
    for name, entity in RESULT_TABLES.items():
        ids = [u for u in unit_ids if u not in skip] if entity is RequestScore else unit_ids
        for r in session.scalars(select(entity).where(entity.unit_id.in_(ids))
                                 .order_by(entity.unit_id, entity.id)):
            yield {"table": name, "row": _row(r)}


def write_jsonl(records: Iterable[dict], path: str | Path) -> int:
    """Write records one per line (atomically: a temp file renamed into place); returns the number of lines."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    try:
        with tmp.open("w") as f:
            for r in records:
                f.write(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n")
                n += 1
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return n


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, record) of every non-blank line; a line that is not a JSON object is an error naming it."""
    out = []
    with Path(path).open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ResultSetError(f"{path}:{i}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ResultSetError(f"{path}:{i}: a record must be a JSON object")
            out.append((i, rec))
    return out


def _insert_new(session: Session, entity, vals: dict) -> int:
    """Insert unless a row with the same key exists; 1 when inserted (RETURNING: rowcount is not portable here)."""
    t = _table(entity)
    stmt = _insert(session, t).values(**vals).on_conflict_do_nothing().returning(list(t.primary_key.columns)[0])
    return len(session.execute(stmt).all())


def _known_columns(entity, vals: dict, where: str, line: int) -> None:
    extra = set(vals) - {c.key for c in entity.__table__.columns}
    if extra:
        raise ResultSetError(f"{where}:{line}: {entity.__tablename__} has no column(s) {sorted(extra)} in this "
                             "store's schema (export and load with the same ctxsparse version, or upgrade the "
                             "store: python -m db upgrade)")


def _dt(row: dict) -> dict:
    return {k: (datetime.fromisoformat(v) if k in _DATETIMES and isinstance(v, str) else v) for k, v in row.items()}


def load_records(session: Session, records: list[tuple[int, dict]], where: str = "file") -> dict[str, int]:
    """Insert what the store lacks; returns rows inserted per table. Raises ResultSetError (nothing is written
    when the caller's transaction rolls back) on a wrong header, an unknown table or a row that points at a
    model, dataset, sweep or unit the file does not carry."""
    if not records or records[0][1].get("format") != FORMAT:
        raise ResultSetError(f"{where}:{records[0][0] if records else 1}: not a ctxsparse result set "
                             f"(the first line must be a header with format {FORMAT!r})")
    models: dict[int, int] = {}
    datasets: dict[int, int] = {}
    sweeps: dict[int, int] = {}
    units: set[str] = set()
    added = {t: 0 for t in TABLES}
    order = {t: i for i, t in enumerate(TABLES)}
    last = 0
    for line, rec in records[1:]:
        table, row = rec.get("table"), rec.get("row")
        if table not in order or not isinstance(row, dict):
            raise ResultSetError(f"{where}:{line}: expected {{\"table\": one of {list(TABLES)}, \"row\": {{...}}}}")
        if order[table] < last:
            raise ResultSetError(f"{where}:{line}: {table} row after {TABLES[last]} rows (tables must come in "
                                 f"the order {', '.join(TABLES)})")
        last = order[table]
        try:
            if table in ("models", "datasets"):
                entity = Model if table == "models" else Dataset
                added[table] += session.scalar(select(entity.id).where(
                    entity.fingerprint == row["fingerprint"])) is None
            if table == "models":
                models[row["id"]] = upsert_model(session, name=row["name"], fingerprint=row["fingerprint"],
                                                 family=row.get("family"), config=row.get("config"),
                                                 n_params=row.get("n_params"))
            elif table == "datasets":
                datasets[row["id"]] = upsert_dataset(session, name=row["name"], fingerprint=row["fingerprint"],
                                                     source=row.get("source"), n_tokens=row.get("n_tokens"),
                                                     split=row.get("split"))
            elif table == "sweeps":
                sid, created = get_or_create_sweep(session, name=row["name"], spec_hash=row["spec_hash"],
                                                   spec=row["spec"])
                if created:
                    session.execute(_table(Sweep).update().where(_table(Sweep).c.id == sid).values(
                        status=row["status"], finished_at=_dt(row)["finished_at"]))
                sweeps[row["id"]] = sid
                added[table] += created
            elif table == "work_units":
                if row["model_id"] not in models or (row.get("dataset_id") is not None
                                                     and row["dataset_id"] not in datasets):
                    raise ResultSetError(f"{where}:{line}: unit {row['id']} points at a model or dataset the "
                                         "file does not carry")
                vals = {**_dt(row), "model_id": models[row["model_id"]],
                        "dataset_id": datasets.get(row.get("dataset_id"))}
                _known_columns(WorkUnit, vals, where, line)
                added[table] += _insert_new(session, WorkUnit, vals)
                units.add(row["id"])
            else:
                unknown_sweep = table == "sweep_units" and row["sweep_id"] not in sweeps
                if unknown_sweep or row["unit_id"] not in units:
                    raise ResultSetError(f"{where}:{line}: {table} row points at a sweep or unit the file does "
                                         "not carry")
                if table == "sweep_units":
                    vals = {"sweep_id": sweeps[row["sweep_id"]], "unit_id": row["unit_id"]}
                    entity = SweepUnit
                else:
                    vals = {k: v for k, v in _dt(row).items() if k != "id"}
                    entity = RESULT_TABLES[table]
                    _known_columns(entity, vals, where, line)
                added[table] += _insert_new(session, entity, vals)
        except KeyError as e:
            raise ResultSetError(f"{where}:{line}: {table} row lacks {e.args[0]!r}") from None
    _refresh_sweep_counts(session, sorted(set(sweeps.values())))
    return added
