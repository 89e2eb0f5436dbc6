"""Pydantic rows that cross the db/ boundary.

Inputs (``extra="forbid"``): ``UnitSpec`` (register_units), ``NewUnit`` with its
``ModelSpec`` / ``DatasetSpec`` (``Store.record_sweep``), ``AccuracyRow``,
``LatencyRow``, ``LayerRow``, ``ArtifactRow``, ``RequestScoreRow`` (finish_unit).
Outputs (read queries): the ``*Record`` / ``*Info`` classes, plain data that pickles
(the dashboard caches them with ``st.cache_data``) and turns into a DataFrame with
``pd.DataFrame([r.model_dump() for r in rows])``.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool


def _not_nan(x: float) -> float:
    # SQLite stores NaN as NULL (and then violates NOT NULL); inf is allowed (diverged ppl).
    if math.isnan(x):
        raise ValueError("NaN is not a storable value")
    return x


def _as_utc(t: datetime) -> datetime:
    # SQLite hands back naive datetimes; everything we store is UTC.
    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t


Real = Annotated[float, AfterValidator(_not_nan)]
UtcDatetime = Annotated[datetime, AfterValidator(_as_utc)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
Name = Annotated[str, Field(min_length=1, max_length=128)]
GitRev = Annotated[str, Field(min_length=1, max_length=64)]
DeviceType = Literal["cuda", "npu", "cpu"]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True, frozen=True)


class _Provenance(_In):
    package_versions: dict[str, str]
    git_rev: GitRev


# ---------------------------------------------------------------- inputs


class UnitSpec(_In):
    """A unit to register; ``id`` is the hash of its canonical config (computed by the orchestrator)."""

    id: Annotated[str, Field(pattern=r"^[0-9a-f]{8,64}$")]
    model_id: int
    dataset_id: int | None = None
    kind: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")]  # collect / fit / eval / latency
    method: Annotated[str, Field(max_length=64)] | None = None
    sparsity: Fraction | None = None
    rank: Annotated[int, Field(ge=1)] | None = None
    attn_sparsity: Fraction | None = None
    device_type: DeviceType | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    code_version: Annotated[str, Field(min_length=1, max_length=64)]


class ModelSpec(_In):
    """A model to record (``upsert_model``: found by its fingerprint, the first name seen wins)."""

    name: str
    fingerprint: str
    family: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    n_params: int | None = None


class DatasetSpec(_In):
    """Calibration data to record (``upsert_dataset``: found by its fingerprint)."""

    name: str
    fingerprint: str
    source: str | None = None
    n_tokens: int | None = None
    split: str | None = None


class NewUnit(_In):
    """A unit to register with the model (and data) it belongs to, both recorded where new: ``unit`` holds the
    ``UnitSpec`` fields but ``model_id`` / ``dataset_id``, which come from them."""

    model: ModelSpec
    dataset: DatasetSpec | None = None
    unit: dict[str, Any]


class AccuracyRow(_Provenance):
    suite: Name
    task: Name
    metric: Annotated[str, Field(min_length=1, max_length=64)]
    higher_is_better: StrictBool     # the metric's direction, as its evaluator knows it (never guessed)
    value: Real
    stderr: Annotated[Real, Field(ge=0.0)] | None = None
    n: Annotated[int, Field(ge=0)]


class LatencyRow(_Provenance):
    device_type: DeviceType
    accelerator_name: Name
    batch: Annotated[int, Field(ge=1)]
    prompt_len: Annotated[int, Field(ge=0)]
    gen_len: Annotated[int, Field(ge=1)]
    p50_ms_per_token: Annotated[Real, Field(ge=0.0)]
    p90_ms_per_token: Annotated[Real, Field(ge=0.0)]
    tokens_per_s: Annotated[Real, Field(ge=0.0)]
    realized_sparsity: Fraction | None = None
    runtime: Annotated[str, Field(min_length=1, max_length=64)]
    threads: Annotated[int, Field(ge=1)] | None = None
    speedup_min: Annotated[Real, Field(gt=0.0)] | None = None
    speedup_max: Annotated[Real, Field(gt=0.0)] | None = None
    weights: Annotated[str, Field(min_length=1, max_length=64)] | None = None   # what the decode read
    cpu_flags: Annotated[str, Field(max_length=255)] | None = None     # CPU rows: kernels.isa.cpu_info()
    isa: Annotated[str, Field(pattern=r"^[a-z0-9_]{1,16}$")] | None = None  # avx512 / avx2 / neon / scalar / fallback


class LayerRow(_In):
    layer: Annotated[int, Field(ge=0)]
    component: Literal["mlp", "attn"]
    recall: Fraction | None = None
    precision: Fraction | None = None
    realized_sparsity: Fraction
    target_sparsity: Fraction | None = None
    auc: Fraction | None = None
    threshold: Real | None = None


class RequestScoreRow(_In):
    """One scored request of a task's shard (its index in the task's request set)."""

    request: Annotated[int, Field(ge=0)]
    loglikelihood: Real            # -inf allowed (a continuation the model gives no probability)
    greedy: StrictBool


class ArtifactRow(_In):
    kind: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")]  # activations_calib / bundle_file / ...
    uri: Annotated[str, Field(min_length=1, max_length=2048)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    size_bytes: Annotated[int, Field(ge=0)] | None = None


# ---------------------------------------------------------------- outputs


class ModelInfo(_Out):
    id: int
    name: str
    family: str | None
    fingerprint: str
    config: dict[str, Any]
    n_params: int | None
    created_at: UtcDatetime


class SweepInfo(_Out):
    id: int
    name: str
    spec_hash: str
    spec: dict[str, Any]
    status: str
    submission_id: str | None
    created_at: UtcDatetime
    finished_at: UtcDatetime | None
    n_units_total: int
    n_units_done: int


class UnitInfo(_Out):
    id: str
    model_id: int
    dataset_id: int | None
    kind: str
    method: str | None
    sparsity: float | None
    rank: int | None
    attn_sparsity: float | None
    device_type: str | None
    config: dict[str, Any]
    status: str
    attempts: int
    worker: str | None
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None
    duration_s: float | None
    error: str | None
    code_version: str
    git_rev: str | None
    package_versions: dict[str, str] | None


class _UnitColumns(_Out):
    """Unit coordinates joined onto result rows (what the dashboard plots against)."""

    unit_id: str
    model_id: int
    model_name: str
    method: str | None
    sparsity: float | None
    rank: int | None
    attn_sparsity: float | None


class AccuracyRecord(_UnitColumns):
    suite: str
    task: str
    metric: str
    higher_is_better: bool
    value: float
    stderr: float | None
    n: int
    git_rev: str
    package_versions: dict[str, str]
    created_at: UtcDatetime


class LatencyRecord(_UnitColumns):
    device_type: str
    accelerator_name: str
    batch: int
    prompt_len: int
    gen_len: int
    p50_ms_per_token: float
    p90_ms_per_token: float
    tokens_per_s: float
    realized_sparsity: float | None
    runtime: str
    threads: int | None = None          # the row's own, else its unit config's (rows written before the column)
    speedup_min: float | None = None
    speedup_max: float | None = None
    weights: str | None = None          # "gguf:Q4_1+Q8_0", "fp32", ... (None: not recorded)
    cpu_flags: str | None = None        # CPU rows: the flags of interest (None: GPU/NPU, or not recorded)
    isa: str | None = None              # CPU rows: what the native kernels were built for (None: as cpu_flags)
    git_rev: str
    package_versions: dict[str, str]
    created_at: UtcDatetime


class LayerRecord(_Out):
    unit_id: str
    layer: int
    component: str
    recall: float | None
    precision: float | None
    realized_sparsity: float
    target_sparsity: float | None
    auc: float | None
    threshold: float | None


class ArtifactRecord(_Out):
    id: int
    unit_id: str
    kind: str
    uri: str
    sha256: str | None
    size_bytes: int | None
    created_at: UtcDatetime
