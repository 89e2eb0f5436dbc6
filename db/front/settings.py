"""Settings of a model, read from the store: what the Pareto front (``db.front.pareto``) is made of.

A *setting* is one fitted configuration of a model (a ``fit`` unit: method, s, r, attention s, allocation,
options; ``dense`` is the baseline). Its accuracy rows come from the ``eval`` units and its latency rows from the
``latency`` units that name it in their config (``fit_unit``). Each accuracy row carries its metric's direction
(``higher_is_better``, as the evaluator reported it); nothing here guesses it from the metric's name.

Reads over ``db.queries`` returning plain picklable data (the dashboard caches it with ``st.cache_data``), and
pure functions of it; no Ray, no torch. The reads take a session: callers outside ``db`` go through
``db.store.Store.settings``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from db import queries
from db.schemas import LatencyRecord
from db.units import DENSE, FitConfig, TaskEvalConfig, unit_config

# the names the workers write into these rows (workers.names; db/ imports no workers: tests/workers/test_names.py
# checks that these copies are the same)
SUITE_MC = "mc"                                   # the suite of one multiple-choice task's rows
RUNTIME_DENSE_PAIRED, RUNTIME_HF, RUNTIME_LLAMA_CPP = "ctxsparse-dense-paired", "hf-generate", "llama.cpp"
MEAN_TASKS = f"{SUITE_MC}/mean/acc"               # mean accuracy over the multiple-choice tasks
# measured with each eval, not accuracy metrics
SPARSITY_METRICS = ("mlp_sparsity", "head_sparsity", "input_sparsity", "weight_skipped",
                    # a predicted output head's: candidates holding the dense argmax, the dense mass on them, the
                    # head's weights read, and the skipped share of every weight a token reads (head included)
                    "head_argmax_kept", "head_mass", "head_read", "all_weight_skipped")
# timed for reference, never a setting's own latency: HF generate, llama.cpp, and the dense half of a paired timing
BASELINE_RUNTIMES = (RUNTIME_HF, RUNTIME_LLAMA_CPP, RUNTIME_DENSE_PAIRED)


def setting_label(method: str, sparsity: float, rank: int | None, attn_sparsity: float | None,
                  allocation: str, options: dict, head: dict | None = None) -> str:
    """``svd s=0.5 r=256 heads=0.3 greedy target=product``; the dense baseline is ``dense``; a predicted head adds
    ``+ head r=64 K=2048`` (``+ head r=64 K=2048 logits`` for the logits screen), alone ``dense + head ...``."""
    tail = "" if head is None else (f" + head r={head['rank']} K={head['candidates']}"
                                    + ("" if head.get("screen", "hidden") == "hidden" else f" {head['screen']}"))
    if method == DENSE:
        return DENSE + tail
    parts = [method, f"s={sparsity:g}"]
    if rank is not None:
        parts.append(f"r={rank}")
    if attn_sparsity is not None:
        parts.append(f"heads={attn_sparsity:g}")
    if allocation != "uniform":
        parts.append(allocation)
    parts += [f"{k}={v}" for k, v in sorted(options.items())]
    return " ".join(parts) + tail


def is_sparsity_metric(key: str) -> bool:
    """``perplexity/x/mlp_sparsity``: a measurement of the setting, not something to trade latency against."""
    return key.rsplit("/", 1)[-1] in SPARSITY_METRICS


@dataclass
class Setting:
    fit_unit: str
    model_id: int
    model_name: str
    method: str
    sparsity: float
    rank: int | None
    attn_sparsity: float | None
    allocation: str
    options: dict
    status: str                                                     # of the fit unit
    head: dict | None = None                                        # a predicted head (rank, candidates, screen)
    accuracy: dict[str, float] = field(default_factory=dict)        # "suite/task/metric" -> value
    higher_is_better: dict[str, bool] = field(default_factory=dict)  # "suite/task/metric" -> direction
    latency: list[LatencyRecord] = field(default_factory=list)
    eval_units: list[str] = field(default_factory=list)

    @property
    def is_dense(self) -> bool:
        """The dense baseline (a predicted head alone is not: its decoder is dense, its head is not)."""
        return self.method == DENSE and self.head is None

    @property
    def label(self) -> str:
        return setting_label(self.method, self.sparsity, self.rank, self.attn_sparsity, self.allocation,
                             self.options, self.head)

    @property
    def realized_sparsity(self) -> float | None:
        """The fraction of the decoder's projection weights a token does not read, realized on the held-out run:
        one axis for every method (neuron predictors skip FFN rows, input sparsity the rows of every projection).
        Stores written before that row existed have the MLP sparsity only: it is used then."""
        for metric in ("weight_skipped", "mlp_sparsity"):
            v = next((v for k, v in self.accuracy.items() if k.endswith("/" + metric)), None)
            if v is not None:
                return v
        return None


def add_mean_task_accuracy(s: Setting) -> None:
    """``mc/mean/acc``: the mean of the setting's ``mc/<task>/acc`` rows (all higher-is-better): single
    multiple-choice tasks only (rows of MMLU, LAMBADA, generation tasks carry another ``suite``)."""
    accs = [v for k, v in s.accuracy.items() if k.startswith(f"{SUITE_MC}/") and k.endswith("/acc")
            and k != MEAN_TASKS and s.higher_is_better.get(k)]
    if accs:
        s.accuracy[MEAN_TASKS] = sum(accs) / len(accs)
        s.higher_is_better[MEAN_TASKS] = True


def settings_for_model(session: Session, model_id: int, eval_units: set[str] | None = None) -> list[Setting]:
    """Every fitted setting of a model with its accuracy and latency rows, dense first. ``eval_units``: only the
    accuracy rows of these units (the front a sweep decides on: ``db.front.pareto.front_pick_in_store``)."""
    units = queries.units_for_model(session, model_id)
    configs = {u.id: unit_config(u.kind, u.config) for u in units if u.kind in ("fit", "eval", "latency")}
    owner = {k: c.fit_unit for k, c in configs.items() if not isinstance(c, FitConfig)}
    name = next((m.name for m in queries.list_models(session) if m.id == model_id), str(model_id))
    out = {}
    for u in units:
        c = configs.get(u.id)
        if isinstance(c, FitConfig):
            out[u.id] = Setting(fit_unit=u.id, model_id=model_id, model_name=name, method=u.method or "?",
                                sparsity=u.sparsity or 0.0, rank=u.rank, attn_sparsity=u.attn_sparsity,
                                allocation=c.allocation, options=dict(c.options), status=u.status,
                                head=None if c.head is None else c.head.model_dump())
    for u in units:       # a task's shards are not evaluations of their own: their task's unit has the rows
        c = configs.get(u.id)
        shard = isinstance(c, TaskEvalConfig) and c.shard is not None
        if u.kind == "eval" and owner.get(u.id) in out and not shard:
            out[owner[u.id]].eval_units.append(u.id)
    for r in queries.accuracy_table(session, model_id=model_id):
        if eval_units is not None and r.unit_id not in eval_units:
            continue
        s = out.get(owner.get(r.unit_id))
        if s is not None:
            key = f"{r.suite}/{r.task}/{r.metric}"
            s.accuracy[key] = r.value
            s.higher_is_better[key] = r.higher_is_better
    for s in out.values():
        add_mean_task_accuracy(s)
    for r in queries.latency_table(session, model_id=model_id):
        s = out.get(owner.get(r.unit_id))
        if s is not None:
            s.latency.append(r)
    return sorted(out.values(), key=lambda s: (not s.is_dense, s.method, s.sparsity, s.rank or 0,
                                               s.attn_sparsity or 0.0, s.label))


def accuracy_metrics(settings: list[Setting]) -> list[str]:
    """The accuracy metrics present on at least one setting (never the sparsity measurements), most useful
    first: perplexity, then the mean task accuracy, then the rest by name."""
    keys = {k for s in settings for k in s.accuracy if not is_sparsity_metric(k)}
    return sorted(keys, key=lambda k: (not k.endswith("/ppl"), k != MEAN_TASKS, k))
