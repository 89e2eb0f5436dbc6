"""Every query of the store, as a typed function taking a ``Session``.

Transactions belong to the caller (``with session_scope(engine) as s: ...``), except
that ``finish_unit`` wraps its own writes in a SAVEPOINT, so a failure inside it never
leaves partial rows even when the caller catches the exception and commits.

Idempotence and concurrency rest on the unique keys: inserts are
``INSERT ... ON CONFLICT DO NOTHING`` (SQLite and PostgreSQL), and unit status changes
are conditional ``UPDATE ... WHERE status ...`` whose row count says who won.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from pydantic import BaseModel
from sqlalchemy import Table, case, func, select, update
from sqlalchemy.orm import Session

from db.models import (
    SWEEP_STATUSES,
    AccuracyResult,
    Artifact,
    Dataset,
    LatencyResult,
    LayerMetric,
    Model,
    RequestScore,
    Sweep,
    SweepUnit,
    WorkUnit,
    utcnow,
)
from db.schemas import (
    AccuracyRecord,
    AccuracyRow,
    ArtifactRecord,
    ArtifactRow,
    LatencyRecord,
    LatencyRow,
    LayerRecord,
    LayerRow,
    ModelInfo,
    RequestScoreRow,
    SweepInfo,
    UnitInfo,
    UnitSpec,
)

MAX_ERROR_CHARS = 20_000
_T = TypeVar("_T", bound=BaseModel)


class UnitNotFound(LookupError):
    pass


class SweepNotFound(LookupError):
    pass


class SweepProgress(NamedTuple):
    done: int
    failed: int
    total: int


# ---------------------------------------------------------------- helpers


def _insert(session: Session, table: Table):
    """Dialect-specific INSERT (both support ``.on_conflict_do_nothing()``)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover
        raise NotImplementedError(f"no upsert support for {dialect}")
    return insert(table)


def _table(entity: type) -> Table:
    return entity.__table__  # type: ignore[attr-defined,return-value]


def _coerce(cls: type[_T], rows: Iterable[_T | Mapping[str, Any]]) -> list[_T]:
    return [r if isinstance(r, cls) else cls.model_validate(r) for r in rows]


def _check_unique(rows: Sequence[BaseModel], key: tuple[str, ...], what: str) -> None:
    counts = Counter(tuple(getattr(r, k) for k in key) for r in rows)
    dups = [k for k, n in counts.items() if n > 1]
    if dups:
        raise ValueError(f"duplicate {what} rows for key {key}: {dups[:5]}")


def _scalars(session: Session, stmt):
    """ORM select that refreshes objects already in the session (our writes bypass the ORM)."""
    return session.scalars(stmt.execution_options(populate_existing=True))


def _unit_exists(session: Session, unit_id: str) -> bool:
    return session.scalar(select(WorkUnit.id).where(WorkUnit.id == unit_id)) is not None


def _lock_sweeps(session: Session, sweep_ids: Sequence[int]) -> list[int]:
    """Row-lock sweeps in id order (PostgreSQL; SQLite already holds the write lock)."""
    stmt = select(Sweep.id).where(Sweep.id.in_(sweep_ids)).order_by(Sweep.id).with_for_update()
    return list(session.scalars(stmt))


def _refresh_sweep_counts(session: Session, sweep_ids: Sequence[int]) -> None:
    """Recompute the cached n_units_total / n_units_done of (locked) sweeps."""
    if not sweep_ids:
        return
    total = (
        select(func.count()).select_from(SweepUnit).where(SweepUnit.sweep_id == Sweep.id)
    ).scalar_subquery()
    done = (
        select(func.count())
        .select_from(SweepUnit)
        .join(WorkUnit, WorkUnit.id == SweepUnit.unit_id)
        .where(SweepUnit.sweep_id == Sweep.id, WorkUnit.status == "done")
    ).scalar_subquery()
    session.execute(
        update(Sweep)
        .where(Sweep.id.in_(sweep_ids))
        .values(n_units_total=total, n_units_done=done)
        .execution_options(synchronize_session=False)
    )


# ---------------------------------------------------------------- models, datasets, sweeps


def upsert_model(
    session: Session,
    *,
    name: str,
    fingerprint: str,
    family: str | None = None,
    config: Mapping[str, Any] | None = None,
    n_params: int | None = None,
) -> int:
    """Id of the model with this fingerprint, inserting it if new (first-seen name wins)."""
    session.execute(
        _insert(session, _table(Model))
        .values(name=name, fingerprint=fingerprint, family=family, config=dict(config or {}), n_params=n_params)
        .on_conflict_do_nothing()
    )
    return session.scalars(select(Model.id).where(Model.fingerprint == fingerprint)).one()


def upsert_dataset(
    session: Session,
    *,
    name: str,
    fingerprint: str,
    source: str | None = None,
    n_tokens: int | None = None,
    split: str | None = None,
) -> int:
    """Id of the dataset with this fingerprint, inserting it if new."""
    session.execute(
        _insert(session, _table(Dataset))
        .values(name=name, fingerprint=fingerprint, source=source, n_tokens=n_tokens, split=split)
        .on_conflict_do_nothing()
    )
    return session.scalars(select(Dataset.id).where(Dataset.fingerprint == fingerprint)).one()


def get_or_create_sweep(
    session: Session,
    *,
    name: str,
    spec_hash: str,
    spec: Mapping[str, Any],
    submission_id: str | None = None,
) -> tuple[int, bool]:
    """``(sweep_id, created)``. A re-submitted spec finds its sweep (and records the new submission id)."""
    created = session.execute(
        _insert(session, _table(Sweep))
        .values(name=name, spec_hash=spec_hash, spec=dict(spec), submission_id=submission_id)
        .on_conflict_do_nothing()
        .returning(_table(Sweep).c.id)
    ).scalar_one_or_none()
    if created is not None:
        return created, True
    sweep_id = session.scalars(select(Sweep.id).where(Sweep.spec_hash == spec_hash)).one()
    if submission_id is not None:
        session.execute(
            update(Sweep)
            .where(Sweep.id == sweep_id)
            .values(submission_id=submission_id)
            .execution_options(synchronize_session=False)
        )
    return sweep_id, False


def set_sweep_status(session: Session, sweep_id: int, status: str) -> None:
    """Set a sweep's status (terminal ones stamp finished_at) and refresh its cached counters."""
    if status not in SWEEP_STATUSES:
        raise ValueError(f"sweep status must be one of {SWEEP_STATUSES}, not {status!r}")
    if not _lock_sweeps(session, [sweep_id]):
        raise SweepNotFound(sweep_id)
    terminal = status in ("done", "failed", "cancelled")
    session.execute(
        update(Sweep)
        .where(Sweep.id == sweep_id)
        .values(status=status, finished_at=utcnow() if terminal else None)
        .execution_options(synchronize_session=False)
    )
    _refresh_sweep_counts(session, [sweep_id])


# ---------------------------------------------------------------- unit lifecycle


def register_units(session: Session, sweep_id: int, units: Iterable[UnitSpec | Mapping[str, Any]]) -> int:
    """Create the units that don't exist yet and link all of them to the sweep.

    Idempotent: registering a known hash is a no-op (a finished unit stays finished and
    is reused). Returns how many units were newly linked to this sweep.
    """
    specs = _coerce(UnitSpec, units)
    if not _lock_sweeps(session, [sweep_id]):
        raise SweepNotFound(sweep_id)
    if not specs:
        return 0
    linked = select(func.count()).select_from(SweepUnit).where(SweepUnit.sweep_id == sweep_id)
    before = session.scalar(linked) or 0
    # Insert only units not seen yet, in id order: an INSERT that meets an existing row
    # being updated by a running finish_unit would wait for it (and deadlock, as that
    # finish_unit waits for this sweep's lock); sorted ids keep concurrent registrars
    # of overlapping new units from deadlocking each other.
    by_id = {u.id: u for u in specs}
    ids = sorted(by_id)
    known = {k for i in range(0, len(ids), 1000)  # chunks: SQLite caps bound parameters
             for k in session.scalars(select(WorkUnit.id).where(WorkUnit.id.in_(ids[i : i + 1000])))}
    new = [by_id[k] for k in sorted(by_id.keys() - known)]
    if new:
        now = utcnow()
        session.execute(
            _insert(session, _table(WorkUnit)).on_conflict_do_nothing(),
            [{**u.model_dump(), "status": "pending", "attempts": 0, "created_at": now} for u in new],
        )
    session.execute(
        _insert(session, _table(SweepUnit)).on_conflict_do_nothing(),
        [{"sweep_id": sweep_id, "unit_id": k} for k in ids],
    )
    _refresh_sweep_counts(session, [sweep_id])
    return (session.scalar(linked) or 0) - before


def _to_running(
    session: Session,
    unit_id: str,
    worker: str,
    from_statuses: tuple[str, ...],
    git_rev: str | None,
    package_versions: Mapping[str, str] | None,
) -> bool:
    values: dict[str, Any] = {
        "status": "running",
        "attempts": WorkUnit.attempts + 1,
        "worker": worker,
        "started_at": utcnow(),
        "finished_at": None,
    }
    if git_rev is not None:
        values["git_rev"] = git_rev
    if package_versions is not None:
        values["package_versions"] = dict(package_versions)
    result = session.execute(
        update(WorkUnit)
        .where(WorkUnit.id == unit_id, WorkUnit.status.in_(from_statuses))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 1:  # type: ignore[attr-defined]
        return True
    if not _unit_exists(session, unit_id):
        raise UnitNotFound(unit_id)
    return False


def claim_unit(
    session: Session,
    unit_id: str,
    worker: str,
    *,
    retry_failed: bool = True,
    git_rev: str | None = None,
    package_versions: Mapping[str, str] | None = None,
) -> bool:
    """Atomically take a pending (or, with ``retry_failed``, failed) unit: True if this caller got it."""
    allowed = ("pending", "failed") if retry_failed else ("pending",)
    return _to_running(session, unit_id, worker, allowed, git_rev, package_versions)


def mark_running(
    session: Session,
    unit_id: str,
    worker: str,
    *,
    git_rev: str | None = None,
    package_versions: Mapping[str, str] | None = None,
) -> bool:
    """Mark a unit running on ``worker`` even if another attempt was running (a dead worker's).

    False (and no change) when the unit is already done.
    """
    return _to_running(
        session, unit_id, worker, ("pending", "running", "failed"), git_rev, package_versions
    )


def finish_unit(
    session: Session,
    unit_id: str,
    accuracy_rows: Iterable[AccuracyRow | Mapping[str, Any]] = (),
    latency_rows: Iterable[LatencyRow | Mapping[str, Any]] = (),
    layer_rows: Iterable[LayerRow | Mapping[str, Any]] = (),
    artifacts: Iterable[ArtifactRow | Mapping[str, Any]] = (),
    duration_s: float | None = None,
    request_scores: Iterable[RequestScoreRow | Mapping[str, Any]] = (),
) -> bool:
    """Write a unit's results and flip it to done, all or nothing.

    Returns True if this call finished the unit, False if it was already done (then
    nothing is written). The status flip (a conditional UPDATE) precedes the inserts, so
    of concurrent finishers of one unit exactly one proceeds; inserts are
    ON CONFLICT DO NOTHING as a second guard.
    Everything runs in a SAVEPOINT: on any error no row of this unit lands and the
    exception propagates (the caller's transaction stays usable, e.g. for fail_unit).
    """
    acc = _coerce(AccuracyRow, accuracy_rows)
    lat = _coerce(LatencyRow, latency_rows)
    lay = _coerce(LayerRow, layer_rows)
    art = _coerce(ArtifactRow, artifacts)
    scores = _coerce(RequestScoreRow, request_scores)
    _check_unique(acc, ("suite", "task", "metric"), "accuracy")
    _check_unique(lat, ("device_type", "accelerator_name", "batch", "prompt_len", "runtime", "isa"), "latency")
    _check_unique(lay, ("layer", "component"), "layer")
    _check_unique(art, ("kind", "uri"), "artifact")
    _check_unique(scores, ("request",), "request score")

    with session.begin_nested():
        # Lock order everywhere: sweeps (by id), then units. Sweep locks first also
        # serialize the cached-counter refresh below (PostgreSQL; SQLite has one writer).
        sweeps = _lock_sweeps(
            session, session.scalars(select(SweepUnit.sweep_id).where(SweepUnit.unit_id == unit_id)).all()
        )
        now = utcnow()
        flipped = session.execute(
            update(WorkUnit)
            .where(WorkUnit.id == unit_id, WorkUnit.status != "done")
            .values(status="done", finished_at=now, duration_s=duration_s, error=None)
            .execution_options(synchronize_session=False)
        )
        if flipped.rowcount != 1:  # type: ignore[attr-defined]
            if not _unit_exists(session, unit_id):
                raise UnitNotFound(unit_id)
            return False
        for entity, rows, stamped in (
            (AccuracyResult, acc, True),
            (LatencyResult, lat, True),
            (LayerMetric, lay, False),
            (Artifact, art, True),
            (RequestScore, scores, False),
        ):
            if rows:
                extra = {"unit_id": unit_id, **({"created_at": now} if stamped else {})}
                session.execute(
                    _insert(session, _table(entity)).on_conflict_do_nothing(),
                    [{**r.model_dump(), **extra} for r in rows],
                )
        _refresh_sweep_counts(session, sweeps)
    return True


def fail_unit(session: Session, unit_id: str, error: str) -> bool:
    """Record a failed attempt. False (and no change) if the unit is already done."""
    if len(error) > MAX_ERROR_CHARS:
        error = error[: MAX_ERROR_CHARS // 2] + "\n...[truncated]...\n" + error[-MAX_ERROR_CHARS // 2 :]
    result = session.execute(
        update(WorkUnit)
        .where(WorkUnit.id == unit_id, WorkUnit.status != "done")
        .values(status="failed", finished_at=utcnow(), error=error)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 1:  # type: ignore[attr-defined]
        return True
    if not _unit_exists(session, unit_id):
        raise UnitNotFound(unit_id)
    return False


# ---------------------------------------------------------------- reads


def get_unit(session: Session, unit_id: str) -> UnitInfo | None:
    unit = session.get(WorkUnit, unit_id, populate_existing=True)
    return None if unit is None else UnitInfo.model_validate(unit)


def unit_ids_with_prefix(session: Session, prefix: str, limit: int = 10) -> list[str]:
    """Unit ids starting with ``prefix`` (hex only), at most ``limit``."""
    if not prefix or any(c not in "0123456789abcdef" for c in prefix):
        return []
    stmt = select(WorkUnit.id).where(WorkUnit.id.like(prefix + "%")).order_by(WorkUnit.id).limit(limit)
    return list(session.scalars(stmt))


def unit_statuses(session: Session, unit_ids: Sequence[str]) -> dict[str, str]:
    """``{unit id: status}`` for the known ones among ``unit_ids``."""
    ids = list(unit_ids)
    out: dict[str, str] = {}
    for i in range(0, len(ids), 1000):  # chunks: SQLite caps bound parameters
        stmt = select(WorkUnit.id, WorkUnit.status).where(WorkUnit.id.in_(ids[i : i + 1000]))
        out.update({k: v for k, v in session.execute(stmt)})
    return out


def pending_units(
    session: Session, sweep_id: int, *, include_failed: bool = False, max_attempts: int | None = None
) -> list[UnitInfo]:
    """Units of the sweep still to run (pending; with ``include_failed`` also failed ones
    that have had fewer than ``max_attempts`` attempts)."""
    statuses = ("pending", "failed") if include_failed else ("pending",)
    stmt = (
        select(WorkUnit)
        .join(SweepUnit, SweepUnit.unit_id == WorkUnit.id)
        .where(SweepUnit.sweep_id == sweep_id, WorkUnit.status.in_(statuses))
        .order_by(WorkUnit.created_at, WorkUnit.id)
    )
    if max_attempts is not None:
        stmt = stmt.where(WorkUnit.attempts < max_attempts)
    return [UnitInfo.model_validate(u) for u in _scalars(session, stmt)]


def sweep_progress(session: Session, sweep_id: int) -> SweepProgress:
    """``(done, failed, total)`` counted from the units themselves (authoritative)."""
    row = session.execute(
        select(
            func.count(),
            func.coalesce(func.sum(case((WorkUnit.status == "done", 1), else_=0)), 0),
            func.coalesce(func.sum(case((WorkUnit.status == "failed", 1), else_=0)), 0),
        )
        .select_from(SweepUnit)
        .join(WorkUnit, WorkUnit.id == SweepUnit.unit_id)
        .where(SweepUnit.sweep_id == sweep_id)
    ).one()
    total, done, failed = (int(x) for x in row)
    return SweepProgress(done=done, failed=failed, total=total)


def units_for_model(
    session: Session, model_id: int, device_type: str | None = None, *, status: str | None = None
) -> list[UnitInfo]:
    """Units of a model, optionally only those for one device type and/or status."""
    stmt = select(WorkUnit).where(WorkUnit.model_id == model_id)
    if device_type is not None:
        stmt = stmt.where(WorkUnit.device_type == device_type)
    if status is not None:
        stmt = stmt.where(WorkUnit.status == status)
    return [UnitInfo.model_validate(u) for u in _scalars(session, stmt.order_by(WorkUnit.created_at, WorkUnit.id))]


_UNIT_COLUMNS = (
    WorkUnit.id.label("unit_id"),
    WorkUnit.model_id,
    Model.name.label("model_name"),
    WorkUnit.method,
    WorkUnit.sparsity,
    WorkUnit.rank,
    WorkUnit.attn_sparsity,
)


def accuracy_table(
    session: Session,
    *,
    model_id: int | None = None,
    sweep_id: int | None = None,
    suite: str | None = None,
    task: str | None = None,
    metric: str | None = None,
) -> list[AccuracyRecord]:
    """Accuracy rows joined with their unit's coordinates (model, method, sparsity, rank)."""
    a = AccuracyResult
    stmt = (
        select(*_UNIT_COLUMNS, a.suite, a.task, a.metric, a.higher_is_better, a.value, a.stderr, a.n, a.git_rev,
               a.package_versions, a.created_at)
        .join(WorkUnit, WorkUnit.id == a.unit_id)
        .join(Model, Model.id == WorkUnit.model_id)
    )
    if sweep_id is not None:
        stmt = stmt.join(SweepUnit, SweepUnit.unit_id == WorkUnit.id).where(SweepUnit.sweep_id == sweep_id)
    for column, value in ((WorkUnit.model_id, model_id), (a.suite, suite), (a.task, task), (a.metric, metric)):
        if value is not None:
            stmt = stmt.where(column == value)
    stmt = stmt.order_by(Model.name, WorkUnit.method, WorkUnit.sparsity, WorkUnit.rank, a.suite, a.task, a.metric)
    return [AccuracyRecord.model_validate(row, from_attributes=True) for row in session.execute(stmt)]


def latency_table(
    session: Session,
    *,
    model_id: int | None = None,
    sweep_id: int | None = None,
    device_type: str | None = None,
    accelerator_name: str | None = None,
    runtime: str | None = None,
    batch: int | None = None,
) -> list[LatencyRecord]:
    """Latency rows joined with their unit's coordinates. ``threads``: the row's own, else the ``threads`` of its
    unit's config (rows written before they carried it, rows loaded from an older result set). ``cpu_flags`` /
    ``isa``: the CPU build a row was timed under (None: GPU/NPU rows, rows from before they were recorded); one
    unit may have rows of several builds."""
    r = LatencyResult
    threads = func.coalesce(r.threads, WorkUnit.config["threads"].as_integer()).label("threads")
    stmt = (
        select(*_UNIT_COLUMNS, r.device_type, r.accelerator_name, r.batch, r.prompt_len, r.gen_len,
               r.p50_ms_per_token, r.p90_ms_per_token, r.tokens_per_s, r.realized_sparsity,
               r.runtime, threads, r.speedup_min, r.speedup_max, r.weights, r.cpu_flags, r.isa, r.git_rev,
               r.package_versions, r.created_at)
        .join(WorkUnit, WorkUnit.id == r.unit_id)
        .join(Model, Model.id == WorkUnit.model_id)
    )
    if sweep_id is not None:
        stmt = stmt.join(SweepUnit, SweepUnit.unit_id == WorkUnit.id).where(SweepUnit.sweep_id == sweep_id)
    for column, value in (
        (WorkUnit.model_id, model_id),
        (r.device_type, device_type),
        (r.accelerator_name, accelerator_name),
        (r.runtime, runtime),
        (r.batch, batch),
    ):
        if value is not None:
            stmt = stmt.where(column == value)
    stmt = stmt.order_by(Model.name, WorkUnit.method, WorkUnit.sparsity, WorkUnit.rank, r.device_type,
                         r.accelerator_name, r.runtime, r.batch, r.prompt_len, r.isa)
    return [LatencyRecord.model_validate(row, from_attributes=True) for row in session.execute(stmt)]


class ShardScores(NamedTuple):
    """The scored requests of one shard unit, in request order."""

    request: list[int]
    loglikelihood: list[float]
    greedy: list[bool]


def request_scores(session: Session, unit_ids: Sequence[str]) -> dict[str, ShardScores]:
    """``{unit id: its scored requests}`` for the units among ``unit_ids`` that recorded any (a shard that scored
    nothing, or is not done, is absent)."""
    ids = list(unit_ids)
    rows: dict[str, list] = {}
    for i in range(0, len(ids), 1000):  # chunks: SQLite caps bound parameters
        r = RequestScore
        stmt = (select(r.unit_id, r.request, r.loglikelihood, r.greedy).where(r.unit_id.in_(ids[i : i + 1000]))
                .order_by(r.unit_id, r.request))
        for unit_id, req, ll, greedy in session.execute(stmt):
            rows.setdefault(unit_id, []).append((req, ll, greedy))
    return {k: ShardScores([q for q, _, _ in v], [float(x) for _, x, _ in v], [bool(g) for _, _, g in v])
            for k, v in rows.items()}


def layer_metrics_for(session: Session, unit_id: str) -> list[LayerRecord]:
    stmt = (
        select(LayerMetric)
        .where(LayerMetric.unit_id == unit_id)
        .order_by(LayerMetric.component, LayerMetric.layer)
    )
    return [LayerRecord.model_validate(m) for m in _scalars(session, stmt)]


def artifacts_for(session: Session, unit_id: str, kind: str | None = None) -> list[ArtifactRecord]:
    stmt = select(Artifact).where(Artifact.unit_id == unit_id)
    if kind is not None:
        stmt = stmt.where(Artifact.kind == kind)
    return [ArtifactRecord.model_validate(a) for a in _scalars(session, stmt.order_by(Artifact.kind, Artifact.id))]


def list_models(session: Session) -> list[ModelInfo]:
    return [ModelInfo.model_validate(m) for m in _scalars(session, select(Model).order_by(Model.name, Model.id))]


def sweeps_for_unit(session: Session, unit_id: str) -> list[SweepInfo]:
    """The sweeps a unit belongs to (a unit shared by several sweeps has several), newest first."""
    stmt = (
        select(Sweep)
        .join(SweepUnit, SweepUnit.sweep_id == Sweep.id)
        .where(SweepUnit.unit_id == unit_id)
        .order_by(Sweep.created_at.desc(), Sweep.id.desc())
    )
    return [SweepInfo.model_validate(s) for s in _scalars(session, stmt)]


def list_sweeps(session: Session) -> list[SweepInfo]:
    """Newest first."""
    stmt = select(Sweep).order_by(Sweep.created_at.desc(), Sweep.id.desc())
    return [SweepInfo.model_validate(s) for s in _scalars(session, stmt)]
