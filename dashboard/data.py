"""The dashboard's only door to the store: a read-only store, cached typed reads, bundle archives.

Pages call the functions here and only draw. Every read goes through one ``db.store.Store`` per URL, opened with
``read_only=True`` (settings and their front: ``db.front``, whose pure functions this module applies too); the URL
is ``$CTXSPARSE_DB_URL`` or the default SQLite file (``db.engine.default_url``). Results are plain picklable data,
cached with ``st.cache_data`` for ``TTL_S`` seconds (a running sweep shows up within that), keyed by the URL.

Bundles: a fit unit's ``bundle_file`` artifacts are the bundle's files (``manifest.json``,
``predictors.safetensors``) with their sha256. ``bundle_archive`` reads each file once, checks its sha256
against the artifact row and only then packs the bytes it checked into a ``.tar.gz`` (plain ``tarfile``; no
torch in the dashboard).
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import streamlit as st

from db.engine import default_url, display_url as _display_url
from db.front.pareto import (DEFAULT_ISA, LATENCY_TIE, Front, default_threads, isa_label,  # noqa: F401
                             isa_rank, pareto, spread_label, threads_label, where_label)
# (LATENCY_TIE, isa_label, threads_label, where_label: for the views)
from db.front.settings import BASELINE_RUNTIMES, Setting, accuracy_metrics, is_sparsity_metric
from db.schemas import (AccuracyRecord, ArtifactRecord, DeviceType, LatencyRecord, LayerRecord, ModelInfo, SweepInfo,
                        UnitInfo)
from db.store import Store, StoreState
from db.units import UNIT_KINDS, CollectConfig, EvalConfig, LatencyConfig, unit_config

TTL_S = 15
DEVICE_TYPES: tuple[str, ...] = tuple(get_args(DeviceType))     # cuda, npu, cpu
BUNDLE_KIND = "bundle_file"
MANIFEST = "manifest.json"


def db_url() -> str:
    """``$CTXSPARSE_DB_URL`` or the default SQLite file (read at every call: tests and users may set it)."""
    return default_url()


def display_url(url: str | None = None) -> str:
    """The URL with any password hidden."""
    return _display_url(url or db_url())


@st.cache_resource(show_spinner=False)
def _store(url: str) -> Store:
    return Store(url, read_only=True)


# ---------------------------------------------------------------- store state


@st.cache_data(ttl=TTL_S, show_spinner=False)
def store_state(url: str) -> StoreState:
    """Whether the store can be shown, and whether it is empty, or why not (``Store.state``)."""
    return _store(url).state()


# ---------------------------------------------------------------- overview


@dataclass(frozen=True)
class FailedUnit:
    id: str
    kind: str
    what: str          # method s r / suite / runtime, readable
    attempts: int
    worker: str | None
    error: str


@dataclass(frozen=True)
class SweepRow:
    info: SweepInfo
    done: int
    failed: int
    total: int
    failures: list[FailedUnit] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0


def _describe(u: UnitInfo) -> str:
    c = unit_config(u.kind, u.config) if u.kind in UNIT_KINDS else None     # not an ingested kernel row's
    parts = [u.method or ""]
    if u.sparsity is not None:
        parts.append(f"s={u.sparsity:g}")
    if u.rank is not None:
        parts.append(f"r={u.rank}")
    if isinstance(c, EvalConfig):
        parts.append(c.suite)
    if isinstance(c, LatencyConfig):
        parts += [c.device_type, f"b{c.batch}", f"p{c.prompt_len}", c.runtime]
    if isinstance(c, CollectConfig):
        parts.append(c.model)
    return " ".join(p for p in parts if p)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def models(url: str) -> list[ModelInfo]:
    return _store(url).models()


@st.cache_data(ttl=TTL_S, show_spinner=False)
def sweeps(url: str) -> list[SweepRow]:
    """Sweeps, newest first, with progress counted from their units and their failed units' errors."""
    out = []
    for sw, p, failed in _store(url).sweep_statuses():
        failed = sorted(failed, key=lambda u: ((u.error or "").startswith("not run"), u.kind, u.id))  # causes first
        out.append(SweepRow(sw, p.done, p.failed, p.total,
                            [FailedUnit(u.id, u.kind, _describe(u), u.attempts, u.worker, u.error or "")
                             for u in failed]))
    return out


# ---------------------------------------------------------------- settings and the front


@st.cache_data(ttl=TTL_S, show_spinner=False)
def settings(url: str, model_id: int) -> list[Setting]:
    return _store(url).settings(model_id)


def metrics(url: str, model_id: int) -> list[str]:
    return accuracy_metrics(settings(url, model_id))


def device_types_with_rows(url: str, model_id: int) -> list[str]:
    """Device types that have latency rows of the settings' own runtime (what a front needs)."""
    have = {r.device_type for s in settings(url, model_id) for r in s.latency if r.runtime not in BASELINE_RUNTIMES}
    return [d for d in DEVICE_TYPES if d in have] + sorted(have - set(DEVICE_TYPES))


def thread_counts(url: str, model_id: int, device_type: str) -> list[int]:
    """The thread counts the settings' own latency rows on ``device_type`` were measured at, the front's default
    (the largest) first."""
    have = {r.threads for s in settings(url, model_id) for r in s.latency
            if r.device_type == device_type and r.runtime not in BASELINE_RUNTIMES and r.threads is not None}
    return sorted(have, reverse=True)


def isas(url: str, model_id: int, device_type: str) -> list[str | None]:
    """The CPU builds (``LatencyRecord.isa``; None: not recorded) the settings' own latency rows on
    ``device_type`` were timed under, the front's default (the widest) first."""
    have = {r.isa for s in settings(url, model_id) for r in s.latency
            if r.device_type == device_type and r.runtime not in BASELINE_RUNTIMES}
    return sorted(have, key=isa_rank)


def front(url: str, model_id: int, metric: str, device_type: str, threads: int | None = None,
          isa=DEFAULT_ISA) -> Front:
    """The front on ``device_type`` at ``threads`` (default: the largest count with rows) under the CPU build
    ``isa`` (default: the widest with rows)."""
    return pareto(settings(url, model_id), metric, device_type, threads=threads, isa=isa)


LOG_SPAN = 10.0      # a perplexity axis whose plotted values span more than this factor is drawn logarithmic


def is_perplexity(metric: str) -> bool:
    return metric.endswith("/ppl")


def log_axis(metric: str, values) -> bool:
    """Whether the axis of ``metric`` over the plotted ``values`` is logarithmic: a perplexity whose finite values
    are all positive and span more than ``LOG_SPAN``× (one collapsed setting at +1,200 % would otherwise squash
    every useful point into a line)."""
    if not is_perplexity(metric):
        return False
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    return bool(v) and min(v) > 0 and max(v) / min(v) > LOG_SPAN


def front_records(fr: Front) -> list[dict]:
    """One flat row per setting of ``fr`` (what the chart and the table show); ``spread``: the lowest and highest
    per-repeat paired speedup; ``note``: why a setting is slower than expected (``FrontRow.note``)."""
    dense = next((r for r in fr.rows if r.setting.is_dense), None)
    out = []
    for r in fr.rows:
        s = r.setting
        speedup = r.paired_speedup or (dense.latency_ms / r.latency_ms
                                       if dense is not None and dense.latency_ms and r.latency_ms else None)
        out.append({
            "setting": s.label, "method": s.method, "s": s.sparsity, "r": s.rank,
            "heads": s.attn_sparsity, "accuracy": r.accuracy, "latency_ms": r.latency_ms,
            "speedup": speedup, "spread": spread_label(r.speedup_min, r.speedup_max),
            "realized_sparsity": s.realized_sparsity, "on_front": r.on_front, "dense": s.is_dense,
            "accelerator": r.accelerator, "threads": r.threads, "isa": r.isa, "weights": r.weights or "",
            "note": r.note or "", "fit_unit": s.fit_unit,
        })
    return sorted(out, key=lambda d: (not d["on_front"], d["latency_ms"] if d["latency_ms"] is not None else 1e30,
                                      d["setting"]))


def baseline_records(fr: Front) -> list[dict]:
    """The front's baselines (llama.cpp, hf-generate), one flat row each, fastest first."""
    return [{"runtime": b.runtime, "latency_ms": b.latency_ms, "speedup": b.speedup,
             "spread": spread_label(b.speedup_min, b.speedup_max),
             "timed": "beside our dense decode" if b.paired else "alone", "threads": fr.threads, "isa": fr.isa}
            for b in fr.baselines]


def setting_for(url: str, model_id: int, fit_unit: str) -> Setting | None:
    return next((s for s in settings(url, model_id) if s.fit_unit == fit_unit), None)


# ---------------------------------------------------------------- one setting (its fit unit)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def unit(url: str, unit_id: str) -> UnitInfo | None:
    return _store(url).unit(unit_id)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def sweeps_of(url: str, unit_id: str) -> list[SweepInfo]:
    return _store(url).sweeps_for_unit(unit_id)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def layers(url: str, unit_id: str) -> list[LayerRecord]:
    return _store(url).layer_metrics(unit_id)


NOISE_K = 2.0     # two accuracies differ beyond noise when |a - b| > NOISE_K * sqrt(se_a^2 + se_b^2)


def beyond_noise(a: float, se_a: float | None, b: float, se_b: float | None, k: float = NOISE_K) -> bool | None:
    """Whether two scores differ by more than their noise (about a 95 % two-sided test for independent
    estimates; the same items scored twice are positively correlated, so this errs towards "within noise").
    None when a standard error is missing."""
    if se_a is None or se_b is None:
        return None
    return abs(a - b) > k * math.sqrt(se_a * se_a + se_b * se_b)


def compare_accuracy(rows: list[AccuracyRecord], dense_rows: list[AccuracyRecord]) -> list[dict]:
    """One setting's accuracy rows beside the dense setting's, matched by (suite, task, metric), with the noise
    rule applied (sparsity measurements are left out: nothing to compare there)."""
    dense = {(r.suite, r.task, r.metric): r for r in dense_rows}
    out = []
    for r in sorted(rows, key=lambda r: (r.suite, r.task, r.metric)):
        if is_sparsity_metric(r.metric):
            continue
        d = dense.get((r.suite, r.task, r.metric))
        out.append({
            "metric": f"{r.suite}/{r.task}/{r.metric}", "value": r.value, "stderr": r.stderr, "n": r.n,
            "dense": None if d is None else d.value, "dense_stderr": None if d is None else d.stderr,
            "diff": None if d is None else r.value - d.value,
            "beyond_noise": None if d is None else beyond_noise(r.value, r.stderr, d.value, d.stderr),
        })
    return out


@st.cache_data(ttl=TTL_S, show_spinner=False)
def accuracy_vs_dense(url: str, model_id: int, fit_unit: str) -> list[dict]:
    """``compare_accuracy`` of a setting against the model's dense setting, read from the store (stderr included)."""
    sts = settings(url, model_id)
    mine = next((s for s in sts if s.fit_unit == fit_unit), None)
    if mine is None:
        return []
    dense = next((s for s in sts if s.is_dense and s.fit_unit != fit_unit), None)
    rows = _store(url).accuracy_rows(model_id)
    own = set(mine.eval_units)
    ref = set(dense.eval_units) if dense is not None else set()
    return compare_accuracy([r for r in rows if r.unit_id in own], [r for r in rows if r.unit_id in ref])


def latency_panel(r: LatencyRecord) -> str:
    """The Unit page's panel of a latency row: device type and accelerator, and on the CPU the thread count and
    the build it was timed at (``cpu · AMD EPYC 7B13 · 2 threads · avx2 build``)."""
    parts = [r.device_type, r.accelerator_name]
    if r.device_type == "cpu":
        parts += [threads_label(r.threads), isa_label(r.isa)]
    return " · ".join(parts)


def latency_breakdown(url: str, model_id: int, fit_unit: str) -> list[tuple[str, LatencyRecord]]:
    """``(whose, row)``: the setting's latency rows (``"this setting"``) and, for reference, the dense setting's
    (``"dense"``: our runtime with an empty plan and the ``hf-generate`` baseline)."""
    out: list[tuple[str, LatencyRecord]] = []
    for s in settings(url, model_id):
        if s.fit_unit == fit_unit:
            out += [("this setting", r) for r in s.latency]
        elif s.is_dense:
            out += [("dense", r) for r in s.latency]
    return sorted(out, key=lambda t: (t[1].device_type, t[1].accelerator_name, isa_rank(t[1].isa), t[1].batch,
                                      t[1].prompt_len, t[0] != "this setting", t[1].runtime))


@st.cache_data(ttl=TTL_S, show_spinner=False)
def artifacts(url: str, unit_id: str) -> list[ArtifactRecord]:
    return _store(url).artifacts(unit_id)


# ---------------------------------------------------------------- bundles


class BundleDownloadError(RuntimeError):
    """A bundle file is missing, or its bytes do not match the sha256 the store recorded."""


@dataclass(frozen=True)
class BundleCheck:
    files: list[ArtifactRecord]
    problems: list[str]               # empty: every file present and matching its recorded sha256
    manifest: dict | None

    @property
    def ok(self) -> bool:
        return bool(self.files) and not self.problems

    @property
    def name(self) -> str:
        return Path(self.files[0].uri).parent.name if self.files else "bundle"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_file(a: ArtifactRecord, data: bytes | None = None) -> str | None:
    p = Path(a.uri)
    if data is None and not p.is_file():
        return f"{p.name}: missing ({a.uri})"
    if a.sha256 is None:
        return f"{p.name}: the store has no sha256 for it"
    got = hashlib.sha256(data).hexdigest() if data is not None else _sha256(p)
    if got != a.sha256:
        return f"{p.name}: sha256 {got[:16]}… does not match the store's {a.sha256[:16]}… ({a.uri})"
    return None


def _bundle_files(url: str, fit_unit: str) -> list[ArtifactRecord]:
    return sorted(_store(url).artifacts(fit_unit, kind=BUNDLE_KIND), key=lambda a: Path(a.uri).name)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def check_bundle(url: str, fit_unit: str) -> BundleCheck:
    """The bundle's files, each checked against its recorded sha256, and the manifest (when it checks out)."""
    files = _bundle_files(url, fit_unit)
    problems = [p for p in (_check_file(a) for a in files) if p]
    manifest = None
    m = next((a for a in files if Path(a.uri).name == MANIFEST), None)
    if files and m is None:
        problems.append(f"no {MANIFEST} among the bundle's files")
    if m is not None and not any(p.startswith(MANIFEST) for p in problems):
        try:
            manifest = json.loads(Path(m.uri).read_text())
        except (OSError, ValueError) as e:
            problems.append(f"{MANIFEST}: unreadable ({e})")
    return BundleCheck(files, problems, manifest)


def bundle_archive(url: str, fit_unit: str) -> bytes:
    """A ``.tar.gz`` of the bundle's files under one folder; raises ``BundleDownloadError`` on a missing or
    changed file.

    Each file is read once; the bytes that were checked are the bytes that are packed.
    """
    files = _bundle_files(url, fit_unit)
    if not files:
        raise BundleDownloadError(f"unit {fit_unit} has no {BUNDLE_KIND} artifacts")
    folder = Path(files[0].uri).parent.name
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for a in files:
            p = Path(a.uri)
            try:
                blob = p.read_bytes()
            except OSError as e:
                raise BundleDownloadError(f"{p.name}: cannot read {a.uri} ({e})") from e
            problem = _check_file(a, blob)
            if problem:
                raise BundleDownloadError(problem)
            info = tarfile.TarInfo(f"{folder}/{p.name}")
            info.size = len(blob)
            info.mtime = int(time.time())
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(blob))
    return buf.getvalue()


def archive_name(url: str, model_id: int, fit_unit: str) -> str:
    s = setting_for(url, model_id, fit_unit)
    base = f"{s.model_name}-{s.label}" if s is not None else "bundle"
    safe = "".join(c if c.isalnum() or c in "-._" else "-" for c in base.replace("=", ""))
    return f"{safe}-{fit_unit[:12]}.tar.gz"


def clear_caches() -> None:
    """Drop cached reads (the Refresh button)."""
    st.cache_data.clear()
