"""The Pareto front of a model's settings, and the choice of the setting to ship.

    ctxsparse pareto smollm2-135m [--metric perplexity/lambada-heldout/ppl] [--device cpu] [--batch 1]
    ctxsparse bundle export --best smollm2-135m [--by latency|sparsity] [--max-loss 0.05] ...

``pareto`` puts every setting that has a value of the metric on (metric, p50 ms per token on one device type,
batch, accelerator and prompt length), and marks the front: the settings no other setting beats on both axes.
The metric's direction is the one stored with its rows (``higher_is_better``). Rules, fixed by the tests:

* a setting beats another when it is at least as good on both axes and strictly better on one; two settings
  equal on both axes do not beat each other, so both stay on the front;
* latencies within ``LATENCY_TIE`` (2 %) of each other are equal: that is the run-to-run spread of one p50 (dense
  Llama-2-7B on an H200: 4.25–4.33 ms over six runs), so a setting 1 % "faster" than dense with a worse metric
  is beaten by dense, not put on the front, and ``choose`` takes the better metric among the near-fastest;
* a setting with no latency row for the device type (its latency unit failed or has not run) is listed with
  no latency and is never on the front; one with no value of the metric is not listed at all;
* the oracle is a bound, not a product: it is drawn and may be on the front, but it is never chosen, and it
  never keeps a deployable setting from being chosen;
* a sparse setting timed together with dense (a ``ctxsparse-dense-paired`` row: both decoded alternately in one
  process) is placed at dense's own time divided by that paired speedup, so its speedup is the one measured side
  by side, not the ratio of two units timed minutes apart; the lowest and highest per-repeat speedup come with it
  (``speedup_min`` / ``speedup_max`` of its row);
* every point of one front was timed at one thread count (``Front.threads``, said in its header): by default
  the largest count with rows (every core of the node, the sweep's default for CPU latency), so rows of an older
  sweep at another count neither mix in nor hide the new ones;
* likewise every CPU point of one front was timed under one build of the native kernels (``Front.isa``: avx512,
  avx2, neon, scalar, or ``fallback`` where they did not build; said in its header): by default the widest build
  with rows (``ISA_ORDER``: what the machine runs by default), and the builds left out are named
  (``Front.other_isas``); GPU/NPU rows record none (None) and so do CPU rows written before the build was;
* the baselines timed on the dense setting (``llama.cpp`` on the model's GGUF, interleaved with our dense decode
  and placed like a paired setting; Hugging Face ``generate``) are listed under the front (``Front.baselines``),
  never on it and never chosen;
* a setting slower than another of the same method (and rank, options) that skips fewer decoder weights, beyond
  the noise (outside both paired spreads, else by more than ``LATENCY_TIE``), says so (``FrontRow.note``).

Before latency is timed (it runs last), ``front_pick`` draws the front of a metric against the decoder weights
each setting skips instead: the settings an ``only: front`` task runs for (``orchestrator.driver``).

Loss against dense is relative: a lower-is-better metric (ppl) may rise by that fraction of dense's value, a
higher-is-better one (accuracy) may fall by it. ``choose`` and ``choose_sparsest`` are pure functions of a
``Front`` (no store, no Ray): the dashboard imports this module. The functions that read the store take a session
(``front_for``, ``front_pick_in_store``): callers outside ``db`` go through ``db.store.Store``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from db import queries
from db.front.settings import (BASELINE_RUNTIMES, RUNTIME_DENSE_PAIRED, RUNTIME_LLAMA_CPP, Setting,
                               accuracy_metrics, settings_for_model)
from db.schemas import LatencyRecord

NOT_DEPLOYABLE = ("oracle",)   # upper bounds: they read the dense activations they are meant to skip
LOSS_TOLERANCE = 1e-9          # a loss exactly at --max-loss qualifies, whatever the float rounding of a/b - 1
LATENCY_TIE = 0.02             # p50 latencies closer than this (relative) are equal: measurement noise
PAIRED_BASELINES = (RUNTIME_LLAMA_CPP,)   # baselines timed alternately with our dense decode in one process


def _faster(t2: float, t: float) -> bool:
    """``t2`` is faster than ``t`` by more than the noise."""
    return t2 * (1.0 + LATENCY_TIE) < t


def _not_slower(t2: float, t: float) -> bool:
    """``t2`` is faster than ``t`` or equal to it within the noise."""
    return t2 <= t * (1.0 + LATENCY_TIE)


class ParetoError(LookupError):
    pass


# ---------------------------------------------------------------- the front


@dataclass
class FrontRow:
    setting: Setting
    accuracy: float
    latency_ms: float | None
    accelerator: str | None
    on_front: bool
    paired_speedup: float | None = None    # dense / sparse p50 timed side by side in one process
    speedup_min: float | None = None       # the lowest and highest per-repeat paired speedup
    speedup_max: float | None = None
    threads: int | None = None             # of its latency row
    note: str | None = None                # slower than a setting of its method that skips fewer weights
    weights: str | None = None             # what its latency row's decode read ("gguf:Q4_1+Q8_0", "fp32", ...)
    isa: str | None = None                 # the CPU build its latency row was timed under


@dataclass
class Baseline:
    """A reference runtime timed on the dense setting: ``llama.cpp``, ``hf-generate``."""
    runtime: str
    latency_ms: float                      # placed like a paired setting where timed beside our dense
    speedup: float | None                  # our dense / its time (> 1: faster than our dense)
    paired: bool                           # speedup measured side by side in one process
    speedup_min: float | None = None
    speedup_max: float | None = None


@dataclass
class Front:
    metric: str
    device_type: str
    higher_is_better: bool | None      # None: no setting has the metric
    rows: list[FrontRow]
    accelerator: str | None = None
    batch: int | None = None
    prompt_len: int | None = None
    message: str | None = None         # why there is no front (no latency rows for this device, no accuracy)
    threads: int | None = None         # the thread count every point was timed at (None: rows that do not say)
    baselines: list[Baseline] = field(default_factory=list)
    isa: str | None = None             # the CPU build every point was timed under (None: GPU/NPU, not recorded)
    other_isas: list[str | None] = field(default_factory=list)   # builds with rows here that this front leaves out

    @property
    def direction(self) -> str:
        """``"higher"`` or ``"lower"`` (is better), for display."""
        return "unknown" if self.higher_is_better is None else "higher" if self.higher_is_better else "lower"

    @property
    def front(self) -> list[FrontRow]:
        return sorted((r for r in self.rows if r.on_front), key=lambda r: (r.latency_ms or 0.0, r.setting.label))

    @property
    def dense(self) -> FrontRow | None:
        return next((r for r in self.rows if r.setting.is_dense), None)


def metric_direction(settings: list[Setting], metric: str) -> bool | None:
    """The stored direction of ``metric`` (True: higher is better); None when no setting has it.

    Rows of one metric that disagree on its direction are a damaged store: ``ParetoError``."""
    seen = {s.higher_is_better[metric] for s in settings if metric in s.higher_is_better}
    if len(seen) > 1:
        raise ParetoError(f"the store's rows of {metric!r} disagree on whether higher is better")
    return seen.pop() if seen else None


def _nondominated(points: list[tuple[str, float, float]], higher_better: bool) -> set[str]:
    """Keys of the points (key, accuracy, latency) that no other point beats on both (ties kept)."""
    front = set()
    for k, a, t in points:
        dominated = False
        for k2, a2, t2 in points:
            if k2 == k:
                continue
            better_acc = a2 >= a if higher_better else a2 <= a
            strictly = (a2 > a if higher_better else a2 < a) or _faster(t2, t)
            if better_acc and _not_slower(t2, t) and strictly:
                dominated = True
                break
        if not dominated:
            front.add(k)
    return front


def _at(r: LatencyRecord, device_type: str, accelerator: str | None, batch: int, prompt_len: int | None,
        threads: int | None, isa: str | None = None) -> bool:
    return (r.device_type == device_type and r.batch == batch and r.threads == threads and r.isa == isa
            and (accelerator is None or r.accelerator_name == accelerator)
            and (prompt_len is None or r.prompt_len == prompt_len))


def pick_latency(s: Setting, device_type: str, accelerator: str | None, batch: int,
                 prompt_len: int | None, threads: int | None = None, isa: str | None = None) -> LatencyRecord | None:
    """The setting's own latency row on (device type, accelerator, batch, prompt length, thread count, build); the
    shortest prompt when ``prompt_len`` is None; of rows timed at the same point by different units (another
    sweep, or the same setting timed on other weights: ``weights``), the newest. Baseline rows (Hugging Face,
    llama.cpp, a paired dense) never count."""
    rows = [r for r in s.latency if r.runtime not in BASELINE_RUNTIMES
            and _at(r, device_type, accelerator, batch, prompt_len, threads, isa)]
    return min(rows, key=lambda r: (r.prompt_len, r.accelerator_name, -r.created_at.timestamp()), default=None)


def paired_dense(s: Setting, own: LatencyRecord) -> LatencyRecord | None:
    """The dense row timed alongside the setting's own row ``own``: written by the same unit, at the same point."""
    return next((r for r in s.latency if r.runtime == RUNTIME_DENSE_PAIRED and r.p50_ms_per_token > 0
                 and r.unit_id == own.unit_id
                 and _at(r, own.device_type, own.accelerator_name, own.batch, own.prompt_len, own.threads,
                         own.isa)), None)


def default_threads(rows: list[LatencyRecord]) -> int | None:
    """The thread count a front is drawn at when none is asked for: the largest with rows (None if no row says)."""
    return max((r.threads for r in rows if r.threads is not None), default=None)


ISA_ORDER = ("avx512", "avx2", "neon", "scalar", "fallback")   # widest first (kernels.isa.resolved's names)


def isa_rank(isa: str | None) -> tuple[int, str]:
    """Sort key of a build, widest first: ``ISA_ORDER``, then other names, then None (not recorded)."""
    if isa is None:
        return (len(ISA_ORDER) + 1, "")
    return (ISA_ORDER.index(isa), "") if isa in ISA_ORDER else (len(ISA_ORDER), isa)


def default_isa(rows: list[LatencyRecord]) -> str | None:
    """The build a front is drawn at when none is asked for: the widest with rows (None if no row says)."""
    return min((r.isa for r in rows), key=isa_rank, default=None)


@dataclass(frozen=True)
class Point:
    """Where every latency of one front was measured."""
    device_type: str
    accelerator: str | None
    batch: int
    prompt_len: int | None
    threads: int | None
    isa: str | None = None


DEFAULT_ISA = object()      # ``isa=`` of front_point / pareto: the widest build with rows (None is a build: unrecorded)


def front_point(settings: list[Setting], device_type: str, *, accelerator: str | None = None, batch: int = 1,
                prompt_len: int | None = None, threads: int | None = None, isa=DEFAULT_ISA) -> Point:
    """The point of a front: without ``accelerator`` / ``isa`` / ``threads`` / ``prompt_len``, the first
    accelerator name (sorted), its widest build (:func:`default_isa`; at ``threads`` when given), its largest
    thread count there (:func:`default_threads`) and its shortest prompt there. ``isa=None`` asks for the rows
    that record no build (GPU/NPU rows, older CPU rows)."""
    rows = [r for s in settings for r in s.latency if r.device_type == device_type and r.batch == batch
            and r.runtime not in BASELINE_RUNTIMES]
    if accelerator is None and rows:
        accelerator = sorted({r.accelerator_name for r in rows})[0]
    here = [r for r in rows if r.accelerator_name == accelerator]
    if isa is DEFAULT_ISA:
        isa = default_isa([r for r in here if threads is None or r.threads == threads])
    if threads is None:
        threads = default_threads([r for r in here if r.isa == isa])
    if prompt_len is None:
        prompt_len = min((r.prompt_len for r in here if r.threads == threads and r.isa == isa), default=None)
    return Point(device_type, accelerator, batch, prompt_len, threads, isa)


def other_isas(settings: list[Setting], at: Point) -> list[str | None]:
    """The builds other than ``at.isa`` with settings' own rows on ``at``'s device, accelerator and batch (what a
    front drawn at ``at`` leaves out), widest first."""
    have = {r.isa for s in settings for r in s.latency if r.device_type == at.device_type and r.batch == at.batch
            and r.accelerator_name == at.accelerator and r.runtime not in BASELINE_RUNTIMES}
    return sorted(have - {at.isa}, key=isa_rank)


def timing(s: Setting, dense_lr: LatencyRecord | None, at: Point) -> tuple[LatencyRecord | None, FrontRow]:
    """The setting's own row at ``at`` and its timing as a front row (accuracy left 0): ms per token (a paired
    setting at dense's own time ``dense_lr`` over its side-by-side speedup), the paired speedup and its spread."""
    lr = pick_latency(s, at.device_type, at.accelerator, at.batch, at.prompt_len, at.threads, at.isa)
    row = FrontRow(s, 0.0, lr.p50_ms_per_token if lr else None, lr.accelerator_name if lr else None, False,
                   threads=lr.threads if lr else None, weights=lr.weights if lr else None,
                   isa=lr.isa if lr else None)
    pair = lr and not s.is_dense and paired_dense(s, lr)
    if pair and lr.p50_ms_per_token > 0:
        row.paired_speedup = pair.p50_ms_per_token / lr.p50_ms_per_token
        row.speedup_min, row.speedup_max = lr.speedup_min, lr.speedup_max
        if dense_lr is not None:
            row.latency_ms = dense_lr.p50_ms_per_token / row.paired_speedup
    return lr, row


def pareto(settings: list[Setting], metric: str, device_type: str, *, accelerator: str | None = None,
           batch: int = 1, prompt_len: int | None = None, threads: int | None = None, isa=DEFAULT_ISA) -> Front:
    """The front of ``settings`` on (``metric``, p50 ms per token on ``device_type``), at :func:`front_point`:
    every point of one front was timed on the same thing at the same thread count, under the same build."""
    higher = metric_direction(settings, metric)
    with_acc = [s for s in settings if metric in s.accuracy]
    at = front_point(settings, device_type, accelerator=accelerator, batch=batch, prompt_len=prompt_len,
                     threads=threads, isa=isa)
    front = Front(metric, device_type, higher, [], at.accelerator, batch, at.prompt_len, threads=at.threads,
                  isa=at.isa, other_isas=other_isas(settings, at))
    if not with_acc:
        front.message = f"no setting has a {metric!r} row yet"
        return front
    if at.accelerator is None:
        front.message = (f"no latency rows for device type {device_type!r} (batch {batch}) yet: "
                         "accuracy only, no front")
        front.rows = [FrontRow(s, s.accuracy[metric], None, None, False) for s in with_acc]
        return front
    dense = next((s for s in settings if s.is_dense), None)
    dense_lr = dense and pick_latency(dense, device_type, at.accelerator, batch, at.prompt_len, at.threads, at.isa)
    pts = []
    for s in with_acc:
        lr, row = timing(s, dense_lr, at)
        row.accuracy = s.accuracy[metric]
        front.rows.append(row)
        if lr is not None:
            pts.append((s.fit_unit, row.accuracy, row.latency_ms))
    if not pts:
        build = f", {isa_label(at.isa)}" if device_type == "cpu" else ""
        front.message = (f"no setting has a latency row on {at.accelerator} at {threads_label(at.threads)}{build} "
                         f"(batch {batch}, prompt {at.prompt_len})")
    on = _nondominated(pts, bool(higher))
    for r in front.rows:
        r.on_front = r.setting.fit_unit in on
    _note_slower_with_more_skipped(front.rows)
    if dense is not None and dense_lr is not None:
        front.baselines = baselines(dense, dense_lr)
    return front


def measurement(settings: list[Setting], fit_unit: str, device_type: str = "cpu", *, batch: int = 1,
                threads: int | None = None, isa=DEFAULT_ISA) -> dict | None:
    """Where and how fast the setting ``fit_unit`` was timed on the front of ``device_type`` (its default point,
    or at ``threads``): what ``bundle export`` writes into the bundle's manifest (``measured``), so that
    ``ctxsparse generate`` runs at the same thread count (``isa``: the CPU build it was timed under). None when
    the setting has no latency there."""
    at = front_point(settings, device_type, batch=batch, threads=threads, isa=isa)
    s = next((x for x in settings if x.fit_unit == fit_unit), None)
    if s is None or at.accelerator is None:
        return None
    dense = next((x for x in settings if x.is_dense), None)
    dense_lr = dense and pick_latency(dense, device_type, at.accelerator, batch, at.prompt_len, at.threads, at.isa)
    lr, row = timing(s, dense_lr, at)
    if lr is None:
        return None
    speedup = row.paired_speedup or (dense_lr.p50_ms_per_token / row.latency_ms if dense_lr and row.latency_ms
                                     else None)
    return {"device_type": device_type, "accelerator": at.accelerator, "threads": at.threads, "batch": batch,
            "prompt_len": at.prompt_len, "gen_len": lr.gen_len, "p50_ms_per_token": row.latency_ms,
            "speedup_vs_dense": speedup, "speedup_min": row.speedup_min, "speedup_max": row.speedup_max,
            "paired": row.paired_speedup is not None, "weights": row.weights, "isa": at.isa}


def baselines(dense: Setting, dense_lr: LatencyRecord) -> list[Baseline]:
    """The reference runtimes timed on the dense setting at the point of its own row ``dense_lr`` (device,
    accelerator, batch, prompt, threads): one timed beside our dense decode (llama.cpp) is placed at dense's own
    time over that side-by-side speedup, like a paired setting; one timed alone (HF generate) at its own time.
    Fastest first."""
    out = []
    for r in dense.latency:
        if r.runtime not in BASELINE_RUNTIMES or r.runtime == RUNTIME_DENSE_PAIRED or r.p50_ms_per_token <= 0 \
                or not _at(r, dense_lr.device_type, dense_lr.accelerator_name, dense_lr.batch, dense_lr.prompt_len,
                           dense_lr.threads, dense_lr.isa):
            continue
        pair = paired_dense(dense, r) if r.runtime in PAIRED_BASELINES else None
        if pair is not None:
            speedup = pair.p50_ms_per_token / r.p50_ms_per_token
            out.append(Baseline(r.runtime, dense_lr.p50_ms_per_token / speedup, speedup, True,
                                r.speedup_min, r.speedup_max))
        else:
            out.append(Baseline(r.runtime, r.p50_ms_per_token, dense_lr.p50_ms_per_token / r.p50_ms_per_token,
                                False))
    return sorted(out, key=lambda b: (b.latency_ms, b.runtime))


def _family(s: Setting) -> tuple:
    return (s.method, s.rank, s.attn_sparsity, s.allocation, tuple(sorted((k, str(v)) for k, v in s.options.items())))


def _clearly_slower(a: FrontRow, b: FrontRow) -> bool:
    """``a`` is slower than ``b`` beyond the noise: outside both paired spreads where both have one, else by more
    than LATENCY_TIE."""
    if None not in (a.speedup_max, b.speedup_min):
        return a.speedup_max < b.speedup_min
    return _faster(b.latency_ms, a.latency_ms)


def _note_slower_with_more_skipped(rows: list[FrontRow]) -> None:
    """Mark each timed sparse setting that is slower than a setting of its family (method, rank, options) skipping
    fewer decoder weights: more bytes skipped should not cost time, so the table says where it did."""
    timed = [r for r in rows if r.latency_ms is not None and not r.setting.is_dense
             and r.setting.realized_sparsity is not None]
    for a in timed:
        fewer = [b for b in timed if b is not a and _family(b.setting) == _family(a.setting)
                 and b.setting.realized_sparsity < a.setting.realized_sparsity and _clearly_slower(a, b)]
        if fewer:
            b = min(fewer, key=lambda b: b.latency_ms)
            a.note = (f"slower than {b.setting.label}, which skips fewer weights "
                      f"({b.setting.realized_sparsity:.3f} < {a.setting.realized_sparsity:.3f})")


# ---------------------------------------------------------------- the front before latency (``only: front``)


@dataclass
class FrontPick:
    """The settings an ``only: front`` task runs for: dense and the settings on the front of ``metric`` against
    the decoder weights they skip (``axis``), drawn on the rows recorded when the pick is made."""
    metric: str | None                     # None: no setting has a front-defining row
    axis: str                              # "weight_skipped" (realized) or "sparsity" (the grid's nominal value)
    front: list[str]                       # fit units on that front, best metric first
    chosen: list[str]                      # the front and dense (always), fit units
    labels: dict[str, str] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)     # fit unit -> its value of ``metric``
    dense_units: list[str] = field(default_factory=list)      # dense's fit units (in ``chosen`` always)
    higher: bool = False                   # ``metric`` is better higher (an accuracy), else lower (perplexity)

    def within(self, budget: float | None) -> list[str]:
        """``chosen`` without the front's settings that lose more than ``budget`` against dense on ``metric``,
        as a fraction of dense's value: a perplexity at most dense's x (1 + budget), an accuracy at least dense's
        x (1 - budget). Dense stays. All of ``chosen`` where ``budget`` is None or no dense setting has a value."""
        ref = next((self.values[k] for k in self.dense_units if k in self.values), None)
        if budget is None or ref is None:
            return list(self.chosen)
        bound = ref * (1 - budget) if self.higher else ref * (1 + budget)
        ok = {k for k, v in self.values.items() if (v >= bound if self.higher else v <= bound)}
        return [k for k in self.chosen if k in self.dense_units or k in ok]


def front_pick(settings: list[Setting], metric: str | None = None) -> FrontPick:
    """Dense and every setting on the front of ``metric`` (default: the first of ``accuracy_metrics``: perplexity,
    else the mean multiple-choice accuracy, else the first metric by name) against decoder weights skipped: what
    a sweep knows before its latency is timed (latency runs last, alone). A setting is on it when no other setting
    is at least as good on the metric and skips at least as many weights, and strictly better on one of the two.
    The skipped fraction is each setting's realized one (``Setting.realized_sparsity``) where every candidate has
    it (a perplexity row), else the grid's nominal sparsity for all. The oracle (a bound) may be on the front but
    never keeps a deployable setting off it. Dense is chosen whatever the front."""
    dense = [s.fit_unit for s in settings if s.is_dense]
    labels = {s.fit_unit: s.label for s in settings}
    if metric is None:
        metrics = accuracy_metrics(settings)
        metric = metrics[0] if metrics else None
    cands = [s for s in settings if metric is not None and metric in s.accuracy]
    realized = bool(cands) and all(s.realized_sparsity is not None for s in cands)
    axis = "weight_skipped" if realized else "sparsity"
    if not cands:
        return FrontPick(metric, axis, [], dense, labels, dense_units=dense)
    higher = bool(metric_direction(cands, metric))

    def skip(s: Setting) -> float:
        return s.realized_sparsity if realized else s.sparsity

    def beats(q: Setting, p: Setting) -> bool:
        a, b = q.accuracy[metric], p.accuracy[metric]
        at_least = a >= b if higher else a <= b
        better = a > b if higher else a < b
        return at_least and skip(q) >= skip(p) and (better or skip(q) > skip(p))

    on = [p for p in cands if not any(q is not p and beats(q, p) and
                                      (q.method not in NOT_DEPLOYABLE or p.method in NOT_DEPLOYABLE)
                                      for q in cands)]
    on.sort(key=lambda s: (-s.accuracy[metric] if higher else s.accuracy[metric], -skip(s), s.label))
    front = [s.fit_unit for s in on]
    return FrontPick(metric, axis, front, list(dict.fromkeys(dense + front)), labels,
                     {s.fit_unit: s.accuracy[metric] for s in cands}, dense, higher)


def front_pick_in_store(session, model_fingerprint: str, fit_units: list[str], eval_units: set[str],
                        metric: str | None = None) -> FrontPick:
    """:func:`front_pick` over the settings ``fit_units`` of the model with this fingerprint, on the accuracy rows
    of ``eval_units`` only (a sweep's front-defining units: its perplexity and its tasks without ``only``)."""
    model = next((m for m in queries.list_models(session) if m.fingerprint == model_fingerprint), None)
    if model is None:
        raise ParetoError(f"no model with fingerprint {model_fingerprint[:12]} in the store")
    wanted = set(fit_units)
    settings = [s for s in settings_for_model(session, model.id, eval_units=set(eval_units)) if s.fit_unit in wanted]
    return front_pick(settings, metric)


# ---------------------------------------------------------------- from the store


def model_id_for(session, name: str) -> int:
    models = queries.list_models(session)
    hits = [m for m in models if m.name == name or m.fingerprint.startswith(name)]
    if not hits:
        known = ", ".join(sorted({m.name for m in models})) or "none yet"
        raise ParetoError(f"no model {name!r} in the store (known: {known})")
    if len(hits) > 1:
        raise ParetoError(f"{name!r} names {len(hits)} models (fingerprints "
                          f"{', '.join(m.fingerprint[:12] for m in hits)}): give a fingerprint prefix")
    return hits[0].id


def front_for(session, model: str, metric: str | None = None, device_type: str = "cpu",
              batch: int = 1, threads: int | None = None, isa=DEFAULT_ISA) -> tuple[list[Setting], Front]:
    """The model's settings and their front on ``metric`` (default: the first of ``accuracy_metrics``), at
    ``threads`` (default: the largest count with rows) and ``isa`` (default: the widest build with rows)."""
    settings = settings_for_model(session, model_id_for(session, model))
    metrics = accuracy_metrics(settings)
    if metric is None:
        if not metrics:
            raise ParetoError(f"model {model!r} has no accuracy rows yet")
        metric = metrics[0]
    elif metric not in metrics:
        raise ParetoError(f"model {model!r} has no metric {metric!r}; it has: {', '.join(metrics) or 'none'}")
    return settings, pareto(settings, metric, device_type, batch=batch, threads=threads, isa=isa)


# ---------------------------------------------------------------- the choice


def loss_vs_dense(front: Front, row: FrontRow) -> float | None:
    """Relative loss of ``row`` against the dense setting on the front's metric (negative: better than dense);
    None without a dense row or when dense's value is 0."""
    dense = front.dense
    if dense is None or dense.accuracy == 0:
        return None
    if front.higher_is_better:
        return 1.0 - row.accuracy / dense.accuracy
    return row.accuracy / dense.accuracy - 1.0


def _check_max_loss(max_loss: float) -> None:
    if isinstance(max_loss, bool) or not isinstance(max_loss, (int, float)) or not math.isfinite(max_loss) \
            or max_loss < 0:
        raise ValueError(f"max loss must be a finite fraction >= 0 (0.05 = 5%), not {max_loss!r}")


def _candidates(front: Front, max_loss: float) -> list[tuple[FrontRow, float]]:
    """(row, loss) of every deployable, finished setting within ``max_loss`` of dense."""
    _check_max_loss(max_loss)
    if front.dense is None:
        raise ParetoError(f"no dense row of {front.metric!r}: the loss against dense cannot be measured")
    out = []
    for r in front.rows:
        loss = loss_vs_dense(front, r)
        if (r.setting.method not in NOT_DEPLOYABLE and r.setting.status == "done" and loss is not None
                and loss <= max_loss + LOSS_TOLERANCE):
            out.append((r, loss))
    return out


def choose(front: Front, max_loss: float) -> FrontRow | None:
    """The fastest setting within ``max_loss`` of dense (dense itself qualifies); None when none is timed.

    Among deployable (not the oracle), finished settings with a latency row on the front's device: a sparse
    setting competes only where it is faster than dense beyond the noise (``faster_than_dense``), since one
    that only may be faster would be shipped for nothing; of the rest, those within ``LATENCY_TIE`` of the
    lowest p50 ms per token are the fastest; among them the better metric value, then the dense setting
    (nothing to apply), then the label in alphabetical order. No other deployable setting beats the pick on both
    axes; the oracle may, which is why the choice does not read ``on_front``."""
    ok = [(r, loss) for r, loss in _candidates(front, max_loss) if r.latency_ms is not None
          and (r.setting.is_dense or faster_than_dense(front, r))]
    if not ok:
        return None
    fastest = min(r.latency_ms for r, _ in ok)
    near = [(r, loss) for r, loss in ok if _not_slower(r.latency_ms, fastest)]
    return min(near, key=lambda t: (t[1], not t[0].setting.is_dense, t[0].setting.label, t[0].latency_ms))[0]


def faster_than_dense(front: Front, r: FrontRow) -> bool:
    """Whether setting ``r`` decodes faster than dense beyond the noise: every repeat of its side-by-side pair
    faster (the lowest paired speedup above 1) where its row has them, else a p50 more than ``LATENCY_TIE`` below
    dense's (a front without a timed dense: True, nothing to compare)."""
    if r.speedup_min is not None:
        return r.speedup_min > 1.0
    dense = front.dense
    if dense is None or dense.latency_ms is None or r.latency_ms is None:
        return True
    return _faster(r.latency_ms, dense.latency_ms)


def choose_sparsest(front: Front, max_loss: float) -> FrontRow | None:
    """The sparse setting that skips the most decoder weights (``Setting.realized_sparsity``) within ``max_loss``
    of dense (no latency
    needed): where this machine's latency says nothing about the target (a CPU sweep for a GPU deployment),
    sparsity is what the GPU kernels turn into speed. Equal sparsity goes to the smaller loss, then to the
    label in alphabetical order. Never dense, never the oracle."""
    ok = [(r, loss) for r, loss in _candidates(front, max_loss)
          if not r.setting.is_dense and r.setting.realized_sparsity is not None]
    best = min(ok, key=lambda t: (-t[0].setting.realized_sparsity, t[1], t[0].setting.label), default=None)
    return best[0] if best else None


# ---------------------------------------------------------------- printing


def threads_label(threads: int | None) -> str:
    """``2 threads``, ``1 thread``; ``threads not recorded`` for rows that do not say."""
    return "threads not recorded" if threads is None else f"{threads} thread{'' if threads == 1 else 's'}"


def isa_label(isa: str | None) -> str:
    """``avx2 build``; ``torch fallback (no native build)``; ``build not recorded`` for rows that do not say."""
    if isa is None:
        return "build not recorded"
    return "torch fallback (no native build)" if isa == "fallback" else f"{isa} build"


def where_label(device_type: str, threads: int | None, isa: str | None) -> str:
    """How a CPU point was timed, ``2 threads, avx2 build``; '' on a GPU/NPU (host threads and the CPU build are
    not what its times depend on)."""
    return f"{threads_label(threads)}, {isa_label(isa)}" if device_type == "cpu" else ""


def spread_label(lo: float | None, hi: float | None) -> str:
    """``1.09-1.15x``: the lowest and highest per-repeat paired speedup ('' without them)."""
    return "" if lo is None or hi is None else f"{lo:.2f}-{hi:.2f}x"


def format_front(front: Front, model: str) -> str:
    how = where_label(front.device_type, front.threads, front.isa)
    where = (f" [{front.accelerator}, batch {front.batch}, prompt {front.prompt_len}{', ' + how if how else ''}]"
             if front.accelerator else "")
    head = (f"Pareto front: {model}, {front.metric} ({front.direction} is better) vs p50 ms/token on "
            f"{front.device_type}{where}")
    lines = [head]
    if front.message:
        lines.append(f"  note: {front.message}")
    if front.other_isas:
        lines.append(f"  note: also timed under {', '.join(isa_label(i) for i in front.other_isas)}: not drawn "
                     "here (each build is a front of its own)")
    lines.append(f"  {'':2}{'setting':<40} {'accuracy':>10} {'Δ vs dense':>10} {'ms/token':>9} {'speedup':>8} "
                 f"{'spread':>11} {'skipped':>7} {'weights':<15} fit unit")
    dense = front.dense
    rows = sorted(front.rows, key=lambda r: (not r.on_front, r.latency_ms if r.latency_ms is not None else 1e30,
                                             r.setting.label))
    for r in rows:
        change = (r.accuracy / dense.accuracy - 1.0) if dense and dense.accuracy else None
        spd = r.paired_speedup or ((dense.latency_ms / r.latency_ms) if dense and dense.latency_ms and r.latency_ms
                                   else None)
        rs = r.setting.realized_sparsity
        lines.append(f"  {'*' if r.on_front else ' ':1}{'!' if r.note else ' ':1}{r.setting.label:<40} "
                     f"{r.accuracy:>10.4g} {'' if change is None else f'{100 * change:+.1f}%':>10} "
                     f"{'-' if r.latency_ms is None else f'{r.latency_ms:.2f}':>9} "
                     f"{'' if spd is None else f'{spd:.2f}x':>8} {spread_label(r.speedup_min, r.speedup_max):>11} "
                     f"{'' if rs is None else f'{rs:.3f}':>7} {r.weights or '':<15} {r.setting.fit_unit[:12]}")
    if front.baselines:
        lines.append("  baselines timed on the dense setting (never on the front, never chosen):")
    for b in front.baselines:
        lines.append(f"  {'':2}{b.runtime:<40} {'':>10} {'':>10} {b.latency_ms:>9.2f} "
                     f"{'' if b.speedup is None else f'{b.speedup:.2f}x':>8} "
                     f"{spread_label(b.speedup_min, b.speedup_max):>11}")
    for r in rows:
        if r.note:
            lines.append(f"  ! {r.setting.label}: {r.note}")
    lines.append("  (* = on the front; Δ = the metric's relative change; the oracle is a bound, never chosen;")
    lines.append("   speedup: dense / sparse timed side by side in one process where the unit did so, and ms/token")
    lines.append("   is then dense's own time divided by it; spread: the lowest and highest speedup of the repeats;")
    lines.append("   skipped: the fraction of decoder weights a token does not read, realized on the held-out run;")
    lines.append("   llama.cpp: the model's GGUF timed beside our dense decode; hf-generate: timed alone)")
    return "\n".join(lines)

