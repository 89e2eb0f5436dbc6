"""The store as one object: ``Store(url)`` and the operations the layers above ``db`` use, each by what it does.

One ``Store`` per URL (as optuna's storages): it holds the engine, and every operation runs in a transaction of
its own (``db.engine.session_scope``), so no caller outside ``db`` sees a session or a query. The driver records
a sweep and its units and reads their statuses; the Ray actors start, finish and fail units; the kernel ingest
records finished units; the CLI and the dashboard read sweeps, units, rows, settings and their front
(``db.front``). ``open_store`` opens one for work, reachable (and migrated) now: a store that cannot be opened is
one ``StoreError``, one message, exit status 2.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import inspect
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from db import queries
from db.engine import default_url, display_url, get_engine, session_scope, upgrade
from db.front.pareto import DEFAULT_ISA, Front, FrontPick, front_for, front_pick_in_store, measurement
from db.front.settings import Setting, settings_for_model
from db.resultset import load_records, read_jsonl
from db.schemas import (AccuracyRecord, AccuracyRow, ArtifactRecord, ArtifactRow, LatencyRow, LayerRecord, LayerRow,
                        ModelInfo, NewUnit, RequestScoreRow, SweepInfo, UnitInfo, UnitSpec)


class StoreError(RuntimeError):
    """The store cannot be opened (server unreachable, bad URL, no permission): one message, exit status 2."""


def first_line(e: BaseException) -> str:
    """The first non-blank line of an exception's message (its type's name when it has none)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def open_store(url: str | None = None, *, migrate: bool = True) -> Store:
    """The store, connected (and migrated) now: a store that cannot be reached is one StoreError, raised before
    any work starts, not a traceback later."""
    try:
        store = Store(url)
    except SQLAlchemyError as e:
        raise StoreError(f"cannot open the store: bad database URL ({first_line(e)})") from None
    try:
        if migrate:
            store.migrate()
        else:
            store.connect()
    except SQLAlchemyError as e:
        where = display_url(store.engine.url)
        raise StoreError(f"cannot open the store at {where}: {first_line(getattr(e, 'orig', None) or e)}") from None
    return store


class SweepStatus(NamedTuple):
    """A sweep, its progress counted from its units, and its failed units (oldest first)."""
    sweep: SweepInfo
    progress: queries.SweepProgress
    failures: list[UnitInfo]


@dataclass(frozen=True)
class StoreState:
    ok: bool                    # tables present and readable (possibly empty)
    empty: bool                 # no model and no sweep yet
    message: str | None = None  # why not ok / what to do


def _unit_specs(s: Session, units: Sequence[NewUnit]) -> list[UnitSpec]:
    """The units' rows, their models and data recorded where new (each once, in the order the units name them)."""
    model_ids: dict[str, int] = {}
    dataset_ids: dict[str, int] = {}
    out = []
    for u in units:
        m, d = u.model, u.dataset
        if m.fingerprint not in model_ids:
            model_ids[m.fingerprint] = queries.upsert_model(s, name=m.name, fingerprint=m.fingerprint,
                                                            family=m.family, config=m.config, n_params=m.n_params)
        if d is not None and d.fingerprint not in dataset_ids:
            dataset_ids[d.fingerprint] = queries.upsert_dataset(s, name=d.name, fingerprint=d.fingerprint,
                                                                source=d.source, n_tokens=d.n_tokens, split=d.split)
        out.append(UnitSpec(model_id=model_ids[m.fingerprint],
                            dataset_id=None if d is None else dataset_ids[d.fingerprint], **u.unit))
    return out


class Store:
    """The store at ``url`` (default: ``$CTXSPARSE_DB_URL``, else the SQLite file under ``$CTXSPARSE_HOME``);
    ``read_only``: every write raises ``db.engine.ReadOnlyDatabaseError``. Nothing connects before the first
    operation."""

    def __init__(self, url: str | None = None, *, read_only: bool = False):
        self.given_url = url if url is not None else default_url()
        self.engine = get_engine(self.given_url, read_only=read_only)

    @property
    def url(self) -> str:
        """The engine's URL in full (password included): what another process opens the same store with."""
        return self.engine.url.render_as_string(hide_password=False)

    def _session(self):
        return session_scope(self.engine)

    # ---------------------------------------------------------------- the store itself

    def migrate(self) -> None:
        """Migrate the schema to the newest revision (a new SQLite file is created)."""
        upgrade(self.engine)

    def connect(self) -> None:
        """Connect once (the server answers, the credentials hold), without migrating."""
        with self.engine.connect():
            pass

    def close(self) -> None:
        self.engine.dispose()

    def state(self) -> StoreState:
        """Whether the store can be shown (its tables there and readable) and whether it is empty, or why not."""
        u = make_url(self.given_url)
        if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
            if not Path(u.database).expanduser().exists():
                return StoreState(False, True, f"no database file at {u.database}: run a sweep first (`ctxsparse` / "
                                               "`python -m orchestrator.driver`) or set CTXSPARSE_DB_URL")
        try:
            with self.engine.connect() as conn:
                tables = set(inspect(conn).get_table_names())
            if not {"models", "sweeps", "work_units"} <= tables:
                return StoreState(False, True, "the database has no ctxsparse tables yet: run `python -m db upgrade`")
            with self._session() as s:
                empty = not queries.list_models(s) and not queries.list_sweeps(s)
        except OperationalError as e:
            return StoreState(False, True, f"cannot read the database: {e.orig if e.orig is not None else e}")
        return StoreState(True, empty)

    # ---------------------------------------------------------------- sweeps

    def record_sweep(self, *, name: str, spec_hash: str, spec: Mapping[str, Any], units: Sequence[NewUnit],
                     submission_id: str | None = None, status: str | None = None) -> tuple[int, bool]:
        """``(sweep id, created)``: the sweep of ``spec_hash`` (found, or made), its units registered under it with
        their models and data (known units stay as they are), and its status set to ``status`` when given."""
        with self._session() as s:
            sweep_id, created = queries.get_or_create_sweep(s, name=name, spec_hash=spec_hash, spec=spec,
                                                            submission_id=submission_id)
            queries.register_units(s, sweep_id, _unit_specs(s, units))
            if status is not None:
                queries.set_sweep_status(s, sweep_id, status)
        return sweep_id, created

    def add_units(self, sweep_id: int, units: Sequence[NewUnit]) -> dict[str, str]:
        """Register more units under a sweep (with their models and data); ``{unit id: status}`` of them."""
        with self._session() as s:
            queries.register_units(s, sweep_id, _unit_specs(s, units))
            return queries.unit_statuses(s, [u.unit["id"] for u in units])

    def finish_sweep(self, sweep_id: int, status: str) -> queries.SweepProgress:
        """Set the sweep's final status (``done`` / ``failed`` stamp its end; ``running``: resumable); its progress."""
        with self._session() as s:
            queries.set_sweep_status(s, sweep_id, status)
            return queries.sweep_progress(s, sweep_id)

    def sweeps(self) -> list[SweepInfo]:
        """Every sweep, newest first."""
        with self._session() as s:
            return queries.list_sweeps(s)

    def sweep_statuses(self, sweeps: Sequence[SweepInfo] | None = None) -> list[SweepStatus]:
        """The progress and the failed units of ``sweeps`` (default: every sweep, newest first), in one read."""
        with self._session() as s:
            out = []
            for sw in queries.list_sweeps(s) if sweeps is None else sweeps:
                failed = [u for u in queries.pending_units(s, sw.id, include_failed=True) if u.status == "failed"]
                out.append(SweepStatus(sw, queries.sweep_progress(s, sw.id), failed))
            return out

    def sweeps_for_unit(self, unit_id: str) -> list[SweepInfo]:
        """The sweeps a unit belongs to, newest first."""
        with self._session() as s:
            return queries.sweeps_for_unit(s, unit_id)

    # ---------------------------------------------------------------- units

    def unit_statuses(self, unit_ids: Sequence[str]) -> dict[str, str]:
        """``{unit id: status}`` of the known ones among ``unit_ids``."""
        with self._session() as s:
            return queries.unit_statuses(s, unit_ids)

    def start_unit(self, unit_id: str, worker: str, *, git_rev: str | None = None,
                   package_versions: Mapping[str, str] | None = None) -> bool:
        """Mark a unit running on ``worker`` (over a dead worker's attempt too); False when it is done already."""
        with self._session() as s:
            return queries.mark_running(s, unit_id, worker, git_rev=git_rev, package_versions=package_versions)

    def finish_unit(self, unit_id: str, accuracy_rows: Iterable[AccuracyRow] = (),
                    latency_rows: Iterable[LatencyRow] = (), layer_rows: Iterable[LayerRow] = (),
                    artifacts: Iterable[ArtifactRow] = (), duration_s: float | None = None,
                    request_scores: Iterable[RequestScoreRow] = ()) -> bool:
        """Write a unit's rows and mark it done, all or nothing; False (nothing written) when it was done."""
        with self._session() as s:
            return queries.finish_unit(s, unit_id, accuracy_rows, latency_rows, layer_rows, artifacts,
                                       duration_s=duration_s, request_scores=request_scores)

    def claim_and_finish_unit(self, unit_id: str, worker: str, *,
                              latency_rows: Iterable[LatencyRow | Mapping[str, Any]] = ()) -> bool:
        """Take a pending (or failed) unit for ``worker`` and write its rows (computed elsewhere), in one
        transaction; False, nothing written or validated, when it is running or done."""
        with self._session() as s:
            if not queries.claim_unit(s, unit_id, worker):
                return False
            return queries.finish_unit(s, unit_id, latency_rows=latency_rows)

    def fail_unit(self, unit_id: str, error: str) -> bool:
        """Record a failed attempt with its error; False (no change) when the unit is done."""
        with self._session() as s:
            return queries.fail_unit(s, unit_id, error)

    def shard_scores(self, shards: Sequence[str]) -> tuple[list[str], dict[str, queries.ShardScores]]:
        """``(the shards not done, {})`` while any is not, else ``([], {shard: its scored requests})`` (a shard
        that scored nothing is absent), read in one transaction."""
        with self._session() as s:
            status = queries.unit_statuses(s, shards)
            waiting = [k for k in shards if status.get(k) != "done"]
            if waiting:
                return waiting, {}
            return [], queries.request_scores(s, shards)

    def unit(self, unit_id: str) -> UnitInfo | None:
        with self._session() as s:
            return queries.get_unit(s, unit_id)

    def unit_ids_with_prefix(self, prefix: str, limit: int = 10) -> list[str]:
        """Unit ids starting with ``prefix`` (hex only), at most ``limit``."""
        with self._session() as s:
            return queries.unit_ids_with_prefix(s, prefix, limit)

    # ---------------------------------------------------------------- rows

    def models(self) -> list[ModelInfo]:
        """Every model, by name."""
        with self._session() as s:
            return queries.list_models(s)

    def accuracy_rows(self, model_id: int) -> list[AccuracyRecord]:
        """A model's accuracy rows with their unit's coordinates."""
        with self._session() as s:
            return queries.accuracy_table(s, model_id=model_id)

    def layer_metrics(self, unit_id: str) -> list[LayerRecord]:
        with self._session() as s:
            return queries.layer_metrics_for(s, unit_id)

    def artifacts(self, unit_id: str, kind: str | None = None) -> list[ArtifactRecord]:
        with self._session() as s:
            return queries.artifacts_for(s, unit_id, kind)

    def load_result_set(self, path: str | Path) -> dict[str, int]:
        """Insert what the store lacks of a result-set file (``db.resultset``); ``{table: rows added}``."""
        with self._session() as s:
            return load_records(s, read_jsonl(path), str(path))

    # ---------------------------------------------------------------- settings and their front (db.front)

    def settings(self, model_id: int, eval_units: set[str] | None = None) -> list[Setting]:
        """Every fitted setting of a model with its rows, dense first (``db.front.settings.settings_for_model``)."""
        with self._session() as s:
            return settings_for_model(s, model_id, eval_units)

    def front(self, model: str, metric: str | None = None, device_type: str = "cpu", batch: int = 1,
              threads: int | None = None, isa=DEFAULT_ISA) -> tuple[list[Setting], Front]:
        """The settings of ``model`` (name or fingerprint prefix) and their front (``db.front.pareto.front_for``);
        ``ParetoError`` for an unknown model or metric."""
        with self._session() as s:
            return front_for(s, model, metric, device_type, batch, threads, isa)

    def front_pick(self, model_fingerprint: str, fit_units: list[str], eval_units: set[str],
                   metric: str | None = None) -> FrontPick:
        """The front before latency of those settings, on those units' rows (``db.front.pareto.front_pick``)."""
        with self._session() as s:
            return front_pick_in_store(s, model_fingerprint, fit_units, eval_units, metric)

    def measurement(self, fit_unit: str, device_type: str = "cpu", threads: int | None = None) -> dict | None:
        """Where the sweep timed the fit unit's setting on ``device_type`` (``db.front.pareto.measurement``: the
        front's point, at ``threads`` if given); None for an unknown unit or one without a latency row there."""
        with self._session() as s:
            unit = queries.get_unit(s, fit_unit)
            if unit is None:
                return None
            return measurement(settings_for_model(s, unit.model_id), fit_unit, device_type, threads=threads)
