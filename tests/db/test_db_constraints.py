"""Unique keys, foreign keys and checks are enforced by the database itself (both backends),
and the pydantic boundary rows reject what the database could not store."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from db import queries as q
from db.engine import session_scope
from db.models import (
    AccuracyResult,
    Artifact,
    Dataset,
    LatencyResult,
    LayerMetric,
    Model,
    Sweep,
    SweepUnit,
    WorkUnit,
)
from db.schemas import AccuracyRow, ArtifactRow, LatencyRow, LayerRow, UnitSpec
from tests.db.db_support import PROV, results, seed, uid

PV = PROV["package_versions"]
ROWS = {
    "models": lambda ctx: Model(name="m2", fingerprint="fp-smollm2"),
    "datasets": lambda ctx: Dataset(name="d", fingerprint="fp-data"),
    "sweeps": lambda ctx: Sweep(name="x", spec_hash=ctx["spec_hash"], spec={}),
    "work_units": lambda ctx: WorkUnit(id=uid(0), model_id=ctx["model_id"], kind="eval", code_version="1"),
    "sweep_units": lambda ctx: SweepUnit(sweep_id=ctx["sweep_id"], unit_id=uid(0)),
    "artifacts": lambda ctx: Artifact(unit_id=uid(0), kind="predictor", uri="file:///p"),
    "accuracy_results": lambda ctx: AccuracyResult(unit_id=uid(0), suite="core", task="piqa", metric="acc",
                                                   higher_is_better=True, value=0.6, n=10,
                                                   package_versions=PV, git_rev="r"),
    "latency_results": lambda ctx: LatencyResult(unit_id=uid(0), device_type="cuda", accelerator_name="H200",
                                                 batch=1, prompt_len=128, gen_len=64 + ctx["n"],
                                                 p50_ms_per_token=1.0, p90_ms_per_token=1.2, tokens_per_s=900.0,
                                                 runtime="ours-sparse", package_versions=PV, git_rev="r"),
    "layer_metrics": lambda ctx: LayerMetric(unit_id=uid(0), layer=3, component="mlp", realized_sparsity=0.5),
}


@pytest.mark.parametrize("table", list(ROWS))
def test_unique_key_rejects_duplicate(engine, table):
    model_id, sweep_id, _ = seed(engine, 1)
    with session_scope(engine) as s:
        ctx = {"model_id": model_id, "sweep_id": sweep_id, "n": 0,
               "spec_hash": s.scalar(select(Sweep.spec_hash))}
        if table not in ("models", "sweeps", "work_units", "sweep_units"):
            s.add(ROWS[table](ctx))  # the first one is fine (seed made models/sweeps/units/links)
    with pytest.raises(IntegrityError):
        with session_scope(engine) as s:
            s.add(ROWS[table]({**ctx, "n": 1}))  # same key; other columns may differ


def test_foreign_keys_enforced(engine):
    with pytest.raises(IntegrityError):
        with session_scope(engine) as s:
            s.add(AccuracyResult(unit_id="f" * 16, suite="core", task="piqa", metric="acc", higher_is_better=True,
                                 value=0.6, n=10, package_versions=PV, git_rev="r"))


def test_metric_direction_is_required_by_the_store(engine):
    """No server default is left after the migration's back-fill: a row without a direction is refused."""
    seed(engine, 1)
    with pytest.raises(IntegrityError):
        with session_scope(engine) as s:
            s.add(AccuracyResult(unit_id=uid(0), suite="core", task="piqa", metric="acc", value=0.6, n=10,
                                 package_versions=PV, git_rev="r"))


def test_status_check_constraint(engine):
    model_id, _, _ = seed(engine, 0)
    with pytest.raises(IntegrityError):
        with session_scope(engine) as s:
            s.add(WorkUnit(id=uid(99), model_id=model_id, kind="eval", code_version="1", status="finished"))


def test_deleting_a_unit_cascades_to_its_results(engine):
    _, sweep_id, ids = seed(engine, 1)
    with session_scope(engine) as s:
        q.finish_unit(s, ids[0], **results(0))
    with session_scope(engine) as s:
        s.delete(s.get(WorkUnit, ids[0]))
    with session_scope(engine) as s:
        for table in (AccuracyResult, LatencyResult, LayerMetric, Artifact, SweepUnit):
            assert s.scalars(select(table)).all() == []


def test_boundary_rows_forbid_extra_fields_and_nan():
    with pytest.raises(ValidationError, match="extra"):
        AccuracyRow(suite="s", task="t", metric="acc", higher_is_better=True, value=1.0, n=1, accuracy=1.0, **PROV)
    with pytest.raises(ValidationError, match="NaN"):
        AccuracyRow(suite="s", task="t", metric="acc", higher_is_better=True, value=math.nan, n=1, **PROV)
    with pytest.raises(ValidationError):  # provenance is required on result rows
        AccuracyRow(suite="s", task="t", metric="acc", higher_is_better=True, value=1.0, n=1)
    with pytest.raises(ValidationError, match="higher_is_better"):   # a metric's direction is never guessed
        AccuracyRow(suite="s", task="t", metric="ppl", value=1.0, n=1, **PROV)
    with pytest.raises(ValidationError, match="higher_is_better"):   # a bool, not something that casts to one
        AccuracyRow(suite="s", task="t", metric="ppl", higher_is_better="no", value=1.0, n=1, **PROV)
    AccuracyRow(suite="s", task="t", metric="ppl", higher_is_better=False, value=math.inf, n=1,
                **PROV)  # diverged ppl is storable
    with pytest.raises(ValidationError):
        LatencyRow(device_type="gpu", accelerator_name="H200", batch=1, prompt_len=1, gen_len=1,
                   p50_ms_per_token=1, p90_ms_per_token=1, tokens_per_s=1, runtime="r", **PROV)
    with pytest.raises(ValidationError):
        LayerRow(layer=0, component="ffn", realized_sparsity=0.5)
    with pytest.raises(ValidationError):
        LayerRow(layer=0, component="mlp", realized_sparsity=1.5)
    with pytest.raises(ValidationError):
        ArtifactRow(kind="predictor", uri="x", sha256="not-a-sha")
    with pytest.raises(ValidationError):
        UnitSpec(id="NOT-HEX", model_id=1, kind="eval", code_version="1")


def _lat_row(isa: str | None, device: str = "cpu", ms: float = 1.0) -> LatencyRow:
    return LatencyRow(device_type=device, accelerator_name="AMD EPYC 7B13", batch=1, prompt_len=8, gen_len=4,
                      p50_ms_per_token=ms, p90_ms_per_token=ms, tokens_per_s=1000 / ms, runtime="ctxsparse-dense",
                      threads=2, cpu_flags=None if isa is None else "avx2 fma", isa=isa, **PROV)


def test_latency_key_holds_one_row_per_cpu_build(engine):
    """The CPU build is part of a latency row's key: one unit's rows at one point under avx2 and scalar are both
    kept; the same build again is refused by the store, and so is a row that records no build (NULL: GPU/NPU rows)
    again, which a unique constraint over the nullable column would let through (SQL never finds two NULLs
    equal); ``ON CONFLICT DO NOTHING`` writers (a result-set load) add nothing; finish_unit refuses one build twice."""
    seed(engine, 3)
    with session_scope(engine) as s:
        assert q.finish_unit(s, uid(0), latency_rows=[_lat_row("avx2", ms=4.0), _lat_row("scalar", ms=9.0)])
        assert q.finish_unit(s, uid(1), latency_rows=[_lat_row(None, "cuda", ms=0.5)])
    for unit, row in ((uid(0), _lat_row("avx2", ms=5.0)), (uid(1), _lat_row(None, "cuda", ms=0.6))):
        with pytest.raises(IntegrityError):
            with session_scope(engine) as s:
                s.add(LatencyResult(unit_id=unit, **row.model_dump()))
        with session_scope(engine) as s:
            s.execute(q._insert(s, q._table(LatencyResult)).values(unit_id=unit, **row.model_dump())
                      .on_conflict_do_nothing())
    with session_scope(engine) as s:
        got = sorted((r.unit_id, r.isa or "", r.p50_ms_per_token) for r in q.latency_table(s))
    assert got == sorted([(uid(0), "avx2", 4.0), (uid(0), "scalar", 9.0), (uid(1), "", 0.5)])
    with pytest.raises(ValueError, match="duplicate latency rows"):
        with session_scope(engine) as s:
            q.finish_unit(s, uid(2), latency_rows=[_lat_row("avx2"), _lat_row("avx2", ms=2.0)])
    with session_scope(engine) as s:        # two builds in one call: fine
        assert q.finish_unit(s, uid(2), latency_rows=[_lat_row("avx2"), _lat_row("neon", ms=2.0)])
