"""Settings and their Pareto front: what the CLI's ``pareto`` and the dashboard both show.

A *setting* is one fitted configuration of a model (a ``fit`` unit: method, s, r, attention s, allocation,
options; ``dense`` is the baseline). Its accuracy rows come from the ``eval`` units and its latency rows from the
``latency`` units that name it in their config (``fit_unit``). The front, per model and device type, is the set
of settings that no other setting beats on both the accuracy metric and latency (ms per token, batch 1 by
default, the runtime that runs the setting itself, not the Hugging Face baseline).

Pure reads over ``db.queries``; returns plain data (picklable, for ``st.cache_data``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from db import queries
from db.schemas import LatencyRecord

LOWER_IS_BETTER = ("ppl", "nll")
MEAN_TASKS = "mc/mean/acc"
DENSE = "dense"
BASELINE_RUNTIMES = ("hf-generate",)   # timed for reference, never a setting's own latency


def metric_direction(metric: str) -> str:
    """``"lower"`` or ``"higher"`` is better, from the metric's last part (``perplexity/x/ppl``)."""
    return "lower" if metric.rsplit("/", 1)[-1] in LOWER_IS_BETTER else "higher"


def setting_label(method: str, sparsity: float, rank: int | None, attn_sparsity: float | None,
                  allocation: str, options: dict) -> str:
    """``svd s=0.5 r=256 heads=0.3 greedy target=product``; the dense baseline is ``dense``."""
    if method == DENSE:
        return "dense"
    parts = [method, f"s={sparsity:g}"]
    if rank is not None:
        parts.append(f"r={rank}")
    if attn_sparsity is not None:
        parts.append(f"heads={attn_sparsity:g}")
    if allocation != "uniform":
        parts.append(allocation)
    parts += [f"{k}={v}" for k, v in sorted(options.items())]
    return " ".join(parts)


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
    status: str
    accuracy: dict[str, float] = field(default_factory=dict)     # "suite/task/metric" -> value
    latency: list[LatencyRecord] = field(default_factory=list)
    eval_units: list[str] = field(default_factory=list)

    @property
    def is_dense(self) -> bool:
        return self.method == DENSE

    @property
    def label(self) -> str:
        return setting_label(self.method, self.sparsity, self.rank, self.attn_sparsity, self.allocation,
                             self.options)

    @property
    def realized_sparsity(self) -> float | None:
        return next((v for k, v in self.accuracy.items() if k.endswith("/mlp_sparsity")), None)


def settings_for_model(session: Session, model_id: int) -> list[Setting]:
    """Every fitted setting of a model with its accuracy and latency rows."""
    units = queries.units_for_model(session, model_id)
    fits = {u.id: u for u in units if u.kind == "fit"}
    owner = {u.id: u.config.get("fit_unit") for u in units if u.kind in ("eval", "latency")}
    name = next((m.name for m in queries.list_models(session) if m.id == model_id), str(model_id))
    out = {k: Setting(fit_unit=k, model_id=model_id, model_name=name, method=u.method or "?",
                      sparsity=u.sparsity or 0.0, rank=u.rank, attn_sparsity=u.attn_sparsity,
                      allocation=u.config.get("allocation", "uniform"), options=dict(u.config.get("options") or {}),
                      status=u.status)
           for k, u in fits.items()}
    for u in units:
        if u.kind == "eval" and owner.get(u.id) in out:
            out[owner[u.id]].eval_units.append(u.id)
    for r in queries.accuracy_table(session, model_id=model_id):
        s = out.get(owner.get(r.unit_id))
        if s is not None:
            s.accuracy[f"{r.suite}/{r.task}/{r.metric}"] = r.value
    for s in out.values():
        accs = [v for k, v in s.accuracy.items() if k.startswith("mc/") and k.endswith("/acc")]
        if accs:
            s.accuracy[MEAN_TASKS] = sum(accs) / len(accs)
    for r in queries.latency_table(session, model_id=model_id):
        s = out.get(owner.get(r.unit_id))
        if s is not None:
            s.latency.append(r)
    return sorted(out.values(), key=lambda s: (not s.is_dense, s.method, s.sparsity, s.rank or 0,
                                               s.attn_sparsity or 0.0, s.label))


def accuracy_metrics(settings: list[Setting]) -> list[str]:
    """The metrics present on at least one setting, most useful first (perplexity, mean task accuracy)."""
    keys = {k for s in settings for k in s.accuracy if not k.endswith("_sparsity")}
    return sorted(keys, key=lambda k: (not k.endswith("/ppl"), k != MEAN_TASKS, k))


def _nondominated(points: list[tuple[str, float, float]], higher_better: bool) -> set[str]:
    """Keys of the points (key, accuracy, latency) that no other point beats on both (ties kept)."""
    front = set()
    for k, a, t in points:
        dominated = False
        for k2, a2, t2 in points:
            if k2 == k:
                continue
            better_acc = a2 >= a if higher_better else a2 <= a
            strictly = (a2 > a if higher_better else a2 < a) or t2 < t
            if better_acc and t2 <= t and strictly:
                dominated = True
                break
        if not dominated:
            front.add(k)
    return front


@dataclass
class FrontRow:
    setting: Setting
    accuracy: float
    latency_ms: float | None
    accelerator: str | None
    on_front: bool


@dataclass
class Front:
    metric: str
    device_type: str
    direction: str
    rows: list[FrontRow]
    accelerator: str | None = None
    batch: int | None = None
    prompt_len: int | None = None
    message: str | None = None      # why there is no front (no latency rows for this device, no accuracy)

    @property
    def front(self) -> list[FrontRow]:
        return sorted((r for r in self.rows if r.on_front), key=lambda r: r.latency_ms or 0.0)


def pick_latency(s: Setting, device_type: str, accelerator: str | None, batch: int,
                 prompt_len: int | None) -> LatencyRecord | None:
    rows = [r for r in s.latency if r.device_type == device_type and r.batch == batch
            and r.runtime not in BASELINE_RUNTIMES and (accelerator is None or r.accelerator_name == accelerator)
            and (prompt_len is None or r.prompt_len == prompt_len)]
    return min(rows, key=lambda r: (r.prompt_len, r.accelerator_name), default=None)


def pareto(settings: list[Setting], metric: str, device_type: str, *, accelerator: str | None = None,
           batch: int = 1, prompt_len: int | None = None) -> Front:
    """The front of ``settings`` on (``metric``, p50 ms per token on ``device_type``)."""
    direction = metric_direction(metric)
    with_acc = [s for s in settings if metric in s.accuracy]
    lat_rows = [r for s in settings for r in s.latency if r.device_type == device_type and r.batch == batch
                and r.runtime not in BASELINE_RUNTIMES]
    if accelerator is None and lat_rows:
        accelerator = sorted({r.accelerator_name for r in lat_rows})[0]
    if prompt_len is None and lat_rows:
        prompt_len = min(r.prompt_len for r in lat_rows if r.accelerator_name == accelerator)
    front = Front(metric, device_type, direction, [], accelerator, batch, prompt_len)
    if not with_acc:
        front.message = f"no setting has a {metric!r} row yet"
        return front
    if not lat_rows:
        front.message = (f"no latency rows for device type {device_type!r} (batch {batch}) yet: "
                         "accuracy only, no front")
        front.rows = [FrontRow(s, s.accuracy[metric], None, None, False) for s in with_acc]
        return front
    pts = []
    for s in with_acc:
        lr = pick_latency(s, device_type, accelerator, batch, prompt_len)
        front.rows.append(FrontRow(s, s.accuracy[metric], lr.p50_ms_per_token if lr else None,
                                   lr.accelerator_name if lr else None, False))
        if lr is not None:
            pts.append((s.fit_unit, s.accuracy[metric], lr.p50_ms_per_token))
    on = _nondominated(pts, direction == "higher")
    for r in front.rows:
        r.on_front = r.setting.fit_unit in on
    return front
