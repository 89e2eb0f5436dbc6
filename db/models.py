"""SQLAlchemy 2 typed models of the ctxsparse store.

One row per thing, metric names are column *values* (never packed strings), every
result row keys on the work unit that produced it (``work_units.id`` = the hash of the
unit's canonical config), and every natural key is a UNIQUE constraint so that writers
can rely on ``INSERT ... ON CONFLICT DO NOTHING`` for idempotence.

Changing anything here needs a new Alembic revision in ``db/migrations/versions``;
``tests/db/test_db_migrations.py`` fails while the two disagree.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint names, so Alembic can find (and drop/alter) them later.
# Each table has at most one UNIQUE constraint beyond its primary key, so naming it
# after the first column is unique and stays under PostgreSQL's 63-character limit.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

UNIT_STATUSES = ("pending", "running", "done", "failed")
SWEEP_STATUSES = ("pending", "running", "done", "failed", "cancelled")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _created_at() -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), default=utcnow)


def _unit_fk() -> Mapped[str]:
    return mapped_column(String(64), ForeignKey("work_units.id", ondelete="CASCADE"))


class Model(Base):
    """A model, identified by the fingerprint of its weights + config."""

    __tablename__ = "models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255))  # model ref (smollm2-135m, HF id, path) or shape name
    family: Mapped[str | None] = mapped_column(String(64))  # llama, gemma3, qwen2, opt, shape, ...
    fingerprint: Mapped[str] = mapped_column(String(128), unique=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    n_params: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = _created_at()


class Dataset(Base):
    """Calibration or evaluation data, identified by the fingerprint of its content."""

    __tablename__ = "datasets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    source: Mapped[str | None] = mapped_column(String(1024))  # path / package / HF id
    fingerprint: Mapped[str] = mapped_column(String(128), unique=True)
    n_tokens: Mapped[int | None] = mapped_column(BigInteger)
    split: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = _created_at()


class Sweep(Base):
    """A submitted sweep; re-submitting the same validated spec finds the same row."""

    __tablename__ = "sweeps"
    __table_args__ = (CheckConstraint(_in("status", SWEEP_STATUSES), name="status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    spec_hash: Mapped[str] = mapped_column(String(64), unique=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    submission_id: Mapped[str | None] = mapped_column(String(255))  # Ray job submission id
    created_at: Mapped[datetime] = _created_at()
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Cached counters (kept up to date by queries.register_units / queries.finish_unit); the
    # authoritative numbers are computed by queries.sweep_progress.
    n_units_total: Mapped[int] = mapped_column(Integer, default=0)
    n_units_done: Mapped[int] = mapped_column(Integer, default=0)


class SweepUnit(Base):
    """Membership: a unit can belong to several sweeps (resubmitted/overlapping)."""

    __tablename__ = "sweep_units"

    sweep_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True
    )
    unit_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("work_units.id", ondelete="CASCADE"), primary_key=True, index=True
    )


class WorkUnit(Base):
    """One unit of work; ``id`` is the hash of its canonical config."""

    __tablename__ = "work_units"
    __table_args__ = (
        CheckConstraint(_in("status", UNIT_STATUSES), name="status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model_id: Mapped[int] = mapped_column(Integer, ForeignKey("models.id"), index=True)
    dataset_id: Mapped[int | None] = mapped_column(Integer, ForeignKey("datasets.id"))
    kind: Mapped[str] = mapped_column(String(32))  # collect / fit / eval / latency / kernel
    # fit: dense / dejavu / svd / threshold / teal / wina / oracle / static; kernel: the benchmarked variant
    method: Mapped[str | None] = mapped_column(String(64))
    sparsity: Mapped[float | None] = mapped_column(Double)
    rank: Mapped[int | None] = mapped_column(Integer)
    attn_sparsity: Mapped[float | None] = mapped_column(Double)
    device_type: Mapped[str | None] = mapped_column(String(16))  # cuda / npu / cpu
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    status: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(255))  # role@host:pid of the actor that ran it
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    duration_s: Mapped[float | None] = mapped_column(Double)
    error: Mapped[str | None] = mapped_column(Text)
    code_version: Mapped[str] = mapped_column(String(64))
    git_rev: Mapped[str | None] = mapped_column(String(64))
    package_versions: Mapped[dict[str, str] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = _created_at()


class Artifact(Base):
    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("unit_id", "kind", "uri"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    unit_id: Mapped[str] = _unit_fk()
    kind: Mapped[str] = mapped_column(String(32))  # activations_calib / activations_heldout / bundle_file
    uri: Mapped[str] = mapped_column(String(2048))
    sha256: Mapped[str | None] = mapped_column(String(64))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = _created_at()


class AccuracyResult(Base):
    """One metric of one task of one suite for one unit (one row per metric), with its direction."""

    __tablename__ = "accuracy_results"
    __table_args__ = (UniqueConstraint("unit_id", "suite", "task", "metric"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    unit_id: Mapped[str] = _unit_fk()
    suite: Mapped[str] = mapped_column(String(128))
    task: Mapped[str] = mapped_column(String(128))
    metric: Mapped[str] = mapped_column(String(64))  # acc / acc_norm / ppl / nll / mlp_sparsity / head_sparsity
    # which way the metric improves, as the evaluator reports it (lm-eval's ``higher_is_better``)
    higher_is_better: Mapped[bool] = mapped_column(Boolean)
    value: Mapped[float] = mapped_column(Double)
    stderr: Mapped[float | None] = mapped_column(Double)
    n: Mapped[int] = mapped_column(Integer)
    package_versions: Mapped[dict[str, str]] = mapped_column(JSON)
    git_rev: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = _created_at()


LATENCY_KEY = ("unit_id", "device_type", "accelerator_name", "batch", "prompt_len", "runtime")


class LatencyResult(Base):
    """One decode (or kernel) timing of one unit. Its natural key is ``LATENCY_KEY`` and the instruction set the
    native CPU code was built for (``isa``): one unit timed under two builds (a result set of another build
    loaded beside this store's) keeps both rows. ``isa`` is NULL on GPU/NPU rows and on CPU rows written before
    it was recorded, and SQL never finds two NULLs equal: two partial unique indexes, one over ``LATENCY_KEY``
    where ``isa`` is NULL and one over ``LATENCY_KEY`` + ``isa`` where it is not, so that recording the same
    row again is refused (``ON CONFLICT DO NOTHING`` keeps the first) whether or not it names an ``isa``."""

    __tablename__ = "latency_results"
    __table_args__ = (
        Index("uq_latency_results_unit_id", *LATENCY_KEY, unique=True,
              sqlite_where=text("isa IS NULL"), postgresql_where=text("isa IS NULL")),
        Index("uq_latency_results_unit_id_isa", *LATENCY_KEY, "isa", unique=True,
              sqlite_where=text("isa IS NOT NULL"), postgresql_where=text("isa IS NOT NULL")),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    unit_id: Mapped[str] = _unit_fk()
    device_type: Mapped[str] = mapped_column(String(16))  # cuda / npu / cpu
    accelerator_name: Mapped[str] = mapped_column(String(128))  # device name: "NVIDIA H200", CPU model name
    batch: Mapped[int] = mapped_column(Integer)
    prompt_len: Mapped[int] = mapped_column(Integer)
    gen_len: Mapped[int] = mapped_column(Integer)
    p50_ms_per_token: Mapped[float] = mapped_column(Double)
    p90_ms_per_token: Mapped[float] = mapped_column(Double)
    tokens_per_s: Mapped[float] = mapped_column(Double)
    realized_sparsity: Mapped[float | None] = mapped_column(Double)
    # ctxsparse-dense / ctxsparse-sparse (our decode runtime), hf-generate and llama.cpp (the baselines),
    # kernel:<variant>
    runtime: Mapped[str] = mapped_column(String(64))
    threads: Mapped[int | None] = mapped_column(Integer)       # the host thread count it was measured at
    # a row timed alternately with our dense decode in one process (a paired sparse row, the llama.cpp row): the
    # lowest and highest per-repeat speedup over that dense (dense time / this row's), the spread of the ratio
    speedup_min: Mapped[float | None] = mapped_column(Double)
    speedup_max: Mapped[float | None] = mapped_column(Double)
    # what the decode read: "gguf:Q4_1+Q8_0" (the GGUF's blocks), "gguf:llama.cpp", "fp32" / "fp16" / "bf16"
    weights: Mapped[str | None] = mapped_column(String(64))
    # CPU rows (``kernels.isa.cpu_info``): the CPU's feature flags of interest (space-separated) and what the
    # native kernels were built for: avx512 / avx2 / neon / scalar, or "fallback" (they did not build: torch
    # primitives ran). NULL on GPU/NPU rows and on rows written before they were recorded.
    cpu_flags: Mapped[str | None] = mapped_column(String(255))
    isa: Mapped[str | None] = mapped_column(String(16))
    package_versions: Mapped[dict[str, str]] = mapped_column(JSON)
    git_rev: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = _created_at()


class RequestScore(Base):
    """One scored request of a shard of a task (an ``eval`` unit whose config has ``shard``): the summed
    log-likelihood of its continuation and whether greedy decoding gives it, as the unsharded unit would compute
    it. ``request`` indexes the task's request set (``workers.evals.request_cache``). The task's accuracy rows are
    assembled from every shard's scores; these rows are the inputs, not results to plot."""

    __tablename__ = "request_scores"
    __table_args__ = (UniqueConstraint("unit_id", "request"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    unit_id: Mapped[str] = _unit_fk()
    request: Mapped[int] = mapped_column(Integer)
    loglikelihood: Mapped[float] = mapped_column(Double)
    greedy: Mapped[bool] = mapped_column(Boolean)


class LayerMetric(Base):
    """Per-layer predictor quality of one unit (the dashboard's per-layer charts)."""

    __tablename__ = "layer_metrics"
    __table_args__ = (
        UniqueConstraint("unit_id", "layer", "component"),
        CheckConstraint(_in("component", ("mlp", "attn")), name="component"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    unit_id: Mapped[str] = _unit_fk()
    layer: Mapped[int] = mapped_column(Integer)
    component: Mapped[str] = mapped_column(String(8))
    recall: Mapped[float | None] = mapped_column(Double)
    precision: Mapped[float | None] = mapped_column(Double)
    realized_sparsity: Mapped[float] = mapped_column(Double)
    target_sparsity: Mapped[float | None] = mapped_column(Double)
    auc: Mapped[float | None] = mapped_column(Double)
    threshold: Mapped[float | None] = mapped_column(Double)
