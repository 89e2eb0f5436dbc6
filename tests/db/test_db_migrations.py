"""Alembic: upgrade from empty on both backends, and the migrated schema == db/models.py."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
import pytest
import sqlalchemy as sa
from sqlalchemy import inspect
from sqlalchemy.exc import IntegrityError

from db.engine import _alembic_config, current_revision, get_engine, head_revision, upgrade
from db.models import Base

TABLES = {"models", "datasets", "sweeps", "work_units", "sweep_units", "artifacts",
          "accuracy_results", "latency_results", "layer_metrics", "request_scores"}


def test_upgrade_head_from_empty(db_url):
    engine = get_engine(db_url)
    try:
        assert current_revision(engine) is None
        assert not set(inspect(engine).get_table_names()) & TABLES
        upgrade(engine)
        assert current_revision(engine) == head_revision() == "0006"
        assert set(inspect(engine).get_table_names()) == TABLES | {"alembic_version"}
        upgrade(db_url)  # again, by URL: a no-op
        assert current_revision(db_url) == head_revision()
    finally:
        engine.dispose()


def test_migrated_schema_matches_models(engine):
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn, opts={"compare_type": True, "render_as_batch": conn.dialect.name == "sqlite"}
        )
        diff = compare_metadata(ctx, Base.metadata)
    assert diff == [], f"db/models.py and the migrations disagree: {diff}"


def test_downgrade_to_base_and_back(engine):
    with engine.connect() as conn:
        command.downgrade(_alembic_config(conn), "base")
        conn.commit()
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    assert current_revision(engine) is None
    upgrade(engine)
    assert set(inspect(engine).get_table_names()) == TABLES | {"alembic_version"}


def _latency_keys(insp) -> dict[str, tuple[list[str], str]]:
    """The unique indexes of latency_results: name -> (columns, the partial index's condition)."""
    out = {}
    for ix in insp.get_indexes("latency_results"):
        if ix["unique"]:
            where = next(iter(ix.get("dialect_options", {}).values()), "")
            out[ix["name"]] = (ix["column_names"], " ".join(str(where).strip("()").split()).lower())
    return out


LATENCY_KEY = ["unit_id", "device_type", "accelerator_name", "batch", "prompt_len", "runtime"]


def test_naming_convention_names_constraints(engine):
    insp = inspect(engine)
    # since 0006 the latency key is two partial unique indexes (the CPU build joins it where a row records one)
    assert insp.get_unique_constraints("latency_results") == []
    assert _latency_keys(insp) == {"uq_latency_results_unit_id": (LATENCY_KEY, "isa is null"),
                                   "uq_latency_results_unit_id_isa": (LATENCY_KEY + ["isa"], "isa is not null")}
    fks = {fk["name"] for fk in insp.get_foreign_keys("accuracy_results")}
    assert fks == {"fk_accuracy_results_unit_id_work_units"}      # also after 0002 rebuilt the table (SQLite)
    assert {u["name"] for u in insp.get_unique_constraints("accuracy_results")} == {"uq_accuracy_results_unit_id"}


def _rows_before_0002(conn) -> None:
    """A model, one unit and its accuracy rows as revision 0001 stored them (no direction column)."""
    now = sa.literal_column("CURRENT_TIMESTAMP")
    models = sa.table("models", sa.column("id"), sa.column("name"), sa.column("fingerprint"),
                      sa.column("config", sa.JSON), sa.column("created_at"))
    units = sa.table("work_units", sa.column("id"), sa.column("model_id"), sa.column("kind"),
                     sa.column("config", sa.JSON), sa.column("status"), sa.column("attempts"),
                     sa.column("code_version"), sa.column("created_at"))
    acc = sa.table("accuracy_results", sa.column("unit_id"), sa.column("suite"), sa.column("task"),
                   sa.column("metric"), sa.column("value"), sa.column("n"),
                   sa.column("package_versions", sa.JSON), sa.column("git_rev"), sa.column("created_at"))
    conn.execute(models.insert().values(id=1, name="m", fingerprint="fp", config={}, created_at=now))
    conn.execute(units.insert().values(id="ab" * 8, model_id=1, kind="eval", config={}, status="done",
                                       attempts=1, code_version="1", created_at=now))
    for suite, task, metric in (("perplexity", "lambada-heldout", "ppl"), ("perplexity", "lambada-heldout", "nll"),
                                ("perplexity", "lambada-heldout", "mlp_sparsity"), ("mc", "piqa", "acc"),
                                ("mc", "piqa", "acc_norm")):
        conn.execute(acc.insert().values(unit_id="ab" * 8, suite=suite, task=task, metric=metric, value=1.5, n=3,
                                         package_versions={}, git_rev="r", created_at=now))


def test_0002_backfills_metric_direction_and_downgrades(db_url):
    engine = get_engine(db_url)
    try:
        upgrade(engine, "0001")
        with engine.begin() as conn:
            _rows_before_0002(conn)
        upgrade(engine, "0002")
        assert current_revision(engine) == "0002"
        with engine.connect() as conn:
            got = dict(conn.execute(sa.text("SELECT metric, higher_is_better FROM accuracy_results")).all())
        assert {k: bool(v) for k, v in got.items()} == {"ppl": False, "nll": False, "mlp_sparsity": True,
                                                        "acc": True, "acc_norm": True}
        col = next(c for c in inspect(engine).get_columns("accuracy_results") if c["name"] == "higher_is_better")
        assert col["nullable"] is False and col["default"] is None    # the back-fill default is gone
        with engine.connect() as conn:
            command.downgrade(_alembic_config(conn), "0001")
            conn.commit()
        assert current_revision(engine) == "0001"
        assert "higher_is_better" not in {c["name"] for c in inspect(engine).get_columns("accuracy_results")}
        with engine.connect() as conn:      # the rows themselves survive the downgrade
            assert conn.execute(sa.text("SELECT count(*) FROM accuracy_results")).scalar() == 5
    finally:
        engine.dispose()


def _latency_rows(conn, rows) -> None:
    """A model and, per (unit id, unit config, device type, runtime), a done latency unit with one row: the columns
    every revision from 0002 on has."""
    now = sa.literal_column("CURRENT_TIMESTAMP")
    conn.execute(sa.table("models", sa.column("id"), sa.column("name"), sa.column("fingerprint"),
                          sa.column("config", sa.JSON), sa.column("created_at")).insert().values(
        id=1, name="m", fingerprint="fp", config={}, created_at=now))
    units = sa.table("work_units", sa.column("id"), sa.column("model_id"), sa.column("kind"),
                     sa.column("config", sa.JSON), sa.column("status"), sa.column("attempts"),
                     sa.column("code_version"), sa.column("created_at"))
    lat = sa.table("latency_results", *(sa.column(c) for c in (
        "unit_id", "device_type", "accelerator_name", "batch", "prompt_len", "gen_len", "p50_ms_per_token",
        "p90_ms_per_token", "tokens_per_s", "runtime", "git_rev", "created_at")),
        sa.column("package_versions", sa.JSON))
    for uid, config, dev, runtime in rows:
        conn.execute(units.insert().values(id=uid, model_id=1, kind="latency", config=config, status="done",
                                           attempts=1, code_version="1", created_at=now))
        conn.execute(lat.insert().values(unit_id=uid, device_type=dev, accelerator_name="x", batch=1, prompt_len=8,
                                         gen_len=4, p50_ms_per_token=2.0, p90_ms_per_token=3.0, tokens_per_s=500.0,
                                         runtime=runtime, git_rev="r", package_versions={}, created_at=now))


def test_0003_backfills_latency_threads_from_the_unit_config(db_url):
    """Rows written before 0003 get the ``threads`` of their unit's config; a unit config without it leaves NULL,
    which latency_table reads through to the config again (still nothing there: None)."""
    from db import queries
    from db.engine import session_scope

    engine = get_engine(db_url)
    try:
        upgrade(engine, "0002")
        with engine.begin() as conn:
            _latency_rows(conn, [("c1" * 8, {"threads": 2, "fit_unit": "x"}, "cpu", "ctxsparse-dense"),
                                 ("c2" * 8, {"fit_unit": "x"}, "cpu", "ctxsparse-dense")])
        upgrade(engine, "0003")
        assert current_revision(engine) == "0003"
        with engine.connect() as conn:
            got = dict(conn.execute(sa.text("SELECT unit_id, threads FROM latency_results")).all())
            spread = conn.execute(sa.text("SELECT speedup_min, speedup_max FROM latency_results")).all()
        assert got == {"c1" * 8: 2, "c2" * 8: None} and set(spread) == {(None, None)}
        upgrade(engine)         # the queries read the head's columns
        with session_scope(engine) as s:
            assert {r.unit_id: r.threads for r in queries.latency_table(s)} == got
        with engine.connect() as conn:
            command.downgrade(_alembic_config(conn), "0002")
            conn.commit()
        assert "threads" not in {c["name"] for c in inspect(engine).get_columns("latency_results")}
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM latency_results")).scalar() == 2
    finally:
        engine.dispose()


def test_0004_adds_request_scores_and_keeps_every_row(db_url):
    """A store at 0003 with rows upgrades to 0004 with the same rows and an empty ``request_scores`` table that
    finish_unit fills; downgrading drops only that table."""
    from db import queries
    from db.engine import session_scope

    engine = get_engine(db_url)
    try:
        upgrade(engine, "0001")
        with engine.begin() as conn:
            _rows_before_0002(conn)
        upgrade(engine, "0003")
        count = "SELECT count(*) FROM accuracy_results"
        with engine.connect() as conn:
            before = conn.execute(sa.text("SELECT unit_id, suite, task, metric, value, n FROM accuracy_results "
                                          "ORDER BY metric")).all()
        upgrade(engine, "0004")
        assert current_revision(engine) == "0004"
        with engine.connect() as conn:
            after = conn.execute(sa.text("SELECT unit_id, suite, task, metric, value, n FROM accuracy_results "
                                         "ORDER BY metric")).all()
            assert conn.execute(sa.text("SELECT count(*) FROM request_scores")).scalar() == 0
        assert after == before and len(after) == 5
        with session_scope(engine) as s:
            s.execute(sa.text("INSERT INTO work_units (id, model_id, kind, config, status, attempts, code_version, "
                              "created_at) VALUES ('cdcdcdcdcdcdcdcdcd', 1, 'eval', '{}', 'pending', 0, '1', "
                              "CURRENT_TIMESTAMP)"))
            assert queries.finish_unit(s, "cd" * 9, request_scores=[
                {"request": 3, "loglikelihood": -1.25, "greedy": True},
                {"request": 0, "loglikelihood": float("-inf"), "greedy": False}])
        with session_scope(engine) as s:
            got = queries.request_scores(s, ["cd" * 9, "ab" * 8])
        assert list(got) == ["cd" * 9]
        assert got["cd" * 9] == queries.ShardScores([0, 3], [float("-inf"), -1.25], [False, True])
        with engine.connect() as conn:
            command.downgrade(_alembic_config(conn), "0003")
            conn.commit()
        assert "request_scores" not in inspect(engine).get_table_names()
        with engine.connect() as conn:
            assert conn.execute(sa.text(count)).scalar() == 5
    finally:
        engine.dispose()


def test_0005_records_latency_weights_and_backfills_the_cpu_runtime_rows(db_url):
    """Rows before 0005: our CPU runtime rows decoded fp32 weights (back-filled "fp32"), llama.cpp rows its GGUF
    ("gguf:llama.cpp"), accelerator rows unknown (NULL); every row kept; downgrading drops only the column."""
    from db import queries
    from db.engine import session_scope

    engine = get_engine(db_url)
    try:
        upgrade(engine, "0004")
        with engine.begin() as conn:
            _latency_rows(conn, [(uid, {"threads": 2}, dev, runtime) for uid, dev, runtime in (
                ("a1" * 8, "cpu", "ctxsparse-sparse"), ("a2" * 8, "cpu", "llama.cpp"),
                ("a3" * 8, "cuda", "ctxsparse-dense"), ("a4" * 8, "cpu", "hf-generate"))])
        upgrade(engine, "0005")
        assert current_revision(engine) == "0005"
        want = {"a1" * 8: "fp32", "a2" * 8: "gguf:llama.cpp", "a3" * 8: None, "a4" * 8: None}
        with engine.connect() as conn:
            assert dict(conn.execute(sa.text("SELECT unit_id, weights FROM latency_results")).all()) == want
        upgrade(engine)         # the queries read the head's columns
        with session_scope(engine) as s:
            assert {r.unit_id: r.weights for r in queries.latency_table(s)} == want
        with engine.connect() as conn:
            command.downgrade(_alembic_config(conn), "0004")
            conn.commit()
        assert "weights" not in {c["name"] for c in inspect(engine).get_columns("latency_results")}
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM latency_results")).scalar() == 4
    finally:
        engine.dispose()


def test_0006_records_the_cpu_build_and_keeps_one_unit_timed_under_two(db_url):
    """Rows before 0006 keep every value with cpu_flags / isa NULL; at 0006 one unit's CPU row of another build
    is stored beside it while the same row again (of a build, or of none) is refused; downgrading refuses while
    two builds share a key, and once they do not drops the columns and restores the old unique constraint."""
    from db.engine import session_scope
    from db.models import LatencyResult

    engine = get_engine(db_url)
    try:
        upgrade(engine, "0005")
        with engine.begin() as conn:
            _latency_rows(conn, [("b1" * 8, {"threads": 2}, "cpu", "ctxsparse-dense"),
                                 ("b2" * 8, {"threads": 2}, "cuda", "ctxsparse-dense")])
        cols = "unit_id, device_type, p50_ms_per_token, threads, weights"
        with engine.connect() as conn:
            before = sorted(conn.execute(sa.text(f"SELECT {cols} FROM latency_results")).all())
        upgrade(engine, "0006")
        assert current_revision(engine) == "0006"
        with engine.connect() as conn:
            assert sorted(conn.execute(sa.text(f"SELECT {cols} FROM latency_results")).all()) == before
            assert set(conn.execute(sa.text("SELECT cpu_flags, isa FROM latency_results")).all()) == {(None, None)}
        new = dict(unit_id="b1" * 8, device_type="cpu", accelerator_name="x", batch=1, prompt_len=8, gen_len=4,
                   p50_ms_per_token=9.0, p90_ms_per_token=9.5, tokens_per_s=111.0, runtime="ctxsparse-dense",
                   git_rev="r", package_versions={}, cpu_flags="avx2 fma", isa="scalar")
        with session_scope(engine) as s:        # the same key, another build: a second row
            s.add(LatencyResult(**new))
        for dup in ({**new, "p50_ms_per_token": 1.0}, {**new, "unit_id": "b2" * 8, "device_type": "cuda",
                                                        "cpu_flags": None, "isa": None}):
            with pytest.raises(IntegrityError):       # the same build again; a row without one again
                with session_scope(engine) as s:
                    s.add(LatencyResult(**dup))
        with engine.connect() as conn:
            got = sorted(conn.execute(sa.text("SELECT unit_id, isa, p50_ms_per_token FROM latency_results")).all(),
                         key=str)
        assert got == sorted([("b1" * 8, None, 2.0), ("b1" * 8, "scalar", 9.0), ("b2" * 8, None, 2.0)], key=str)
        with engine.connect() as conn:
            with pytest.raises(RuntimeError, match="several instruction-set builds"):
                command.downgrade(_alembic_config(conn), "0005")
        assert current_revision(engine) == "0006"
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM latency_results WHERE isa = 'scalar'"))
        with engine.connect() as conn:
            command.downgrade(_alembic_config(conn), "0005")
            conn.commit()
        insp = inspect(engine)
        assert not {"cpu_flags", "isa"} & {c["name"] for c in insp.get_columns("latency_results")}
        assert [(u["name"], u["column_names"]) for u in insp.get_unique_constraints("latency_results")] == [
            ("uq_latency_results_unit_id", LATENCY_KEY)]
        with engine.connect() as conn:
            assert sorted(conn.execute(sa.text(f"SELECT {cols} FROM latency_results")).all()) == before
        upgrade(engine)
        assert set(_latency_keys(inspect(engine))) == {"uq_latency_results_unit_id", "uq_latency_results_unit_id_isa"}
    finally:
        engine.dispose()
