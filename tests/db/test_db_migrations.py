"""Alembic: upgrade from empty on both backends, and the migrated schema == db/models.py."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from db.engine import _alembic_config, current_revision, get_engine, head_revision, upgrade
from db.models import Base

TABLES = {"models", "datasets", "sweeps", "work_units", "sweep_units", "artifacts",
          "accuracy_results", "latency_results", "layer_metrics"}


def test_upgrade_head_from_empty(db_url):
    engine = get_engine(db_url)
    try:
        assert current_revision(engine) is None
        assert not set(inspect(engine).get_table_names()) & TABLES
        upgrade(engine)
        assert current_revision(engine) == head_revision() == "0001"
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


def test_naming_convention_names_constraints(engine):
    insp = inspect(engine)
    uniques = {u["name"] for u in insp.get_unique_constraints("latency_results")}
    assert uniques == {"uq_latency_results_unit_id"}
    fks = {fk["name"] for fk in insp.get_foreign_keys("accuracy_results")}
    assert fks == {"fk_accuracy_results_unit_id_work_units"}
