"""Pareto choice from the store: print the front per model and device type, pick the setting to ship.

    ctxsparse pareto smollm2-135m [--metric perplexity/lambada-heldout/ppl] [--device cpu] [--max-loss 0.05]

``choose`` returns the fastest setting on the front whose accuracy loss against dense is within ``max_loss``
(relative: ppl may rise by that fraction, a task accuracy fall by it); without such a setting, none.
``choose_sparsest`` returns the sparsest setting within ``max_loss`` (for a target device with no latency rows).
"""
from __future__ import annotations

from db import queries
from db.engine import session_scope
from db.settings import Front, FrontRow, Setting, accuracy_metrics, pareto, settings_for_model


class ParetoError(LookupError):
    pass


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
              batch: int = 1) -> tuple[list[Setting], Front]:
    settings = settings_for_model(session, model_id_for(session, model))
    metrics = accuracy_metrics(settings)
    if metric is None:
        if not metrics:
            raise ParetoError(f"model {model!r} has no accuracy rows yet")
        metric = metrics[0]
    elif metric not in metrics:
        raise ParetoError(f"model {model!r} has no metric {metric!r}; it has: {', '.join(metrics) or 'none'}")
    return settings, pareto(settings, metric, device_type, batch=batch)


def loss_vs_dense(front: Front, row: FrontRow) -> float | None:
    dense = next((r for r in front.rows if r.setting.is_dense), None)
    if dense is None or dense.accuracy == 0:
        return None
    if front.direction == "lower":
        return row.accuracy / dense.accuracy - 1.0
    return 1.0 - row.accuracy / dense.accuracy


NOT_DEPLOYABLE = ("oracle",)   # upper bounds: they read the dense activations they are meant to skip


def choose(front: Front, max_loss: float) -> FrontRow | None:
    """The fastest front setting within ``max_loss`` of dense (the dense setting itself qualifies)."""
    ok = [r for r in front.front if (loss_vs_dense(front, r) or 0.0) <= max_loss
          and r.setting.method not in NOT_DEPLOYABLE]
    return min(ok, key=lambda r: r.latency_ms, default=None)


def choose_sparsest(front: Front, max_loss: float) -> FrontRow | None:
    """The setting with the highest realized MLP sparsity within ``max_loss`` of dense (no latency needed):
    where this machine's latency says nothing about the target (a CPU sweep for a GPU deployment), sparsity
    is what the GPU kernels turn into speed."""
    losses = {id(r): loss_vs_dense(front, r) for r in front.rows}
    ok = [r for r in front.rows if not r.setting.is_dense and r.setting.realized_sparsity is not None
          and r.setting.method not in NOT_DEPLOYABLE and losses[id(r)] is not None and losses[id(r)] <= max_loss]
    return max(ok, key=lambda r: (r.setting.realized_sparsity, -abs(losses[id(r)])), default=None)


def format_front(front: Front, model: str) -> str:
    head = (f"Pareto front: {model}, {front.metric} ({front.direction} is better) vs p50 ms/token on "
            f"{front.device_type}" + (f" [{front.accelerator}, batch {front.batch}, prompt {front.prompt_len}]"
                                       if front.accelerator else ""))
    lines = [head]
    if front.message:
        lines.append(f"  note: {front.message}")
    lines.append(f"  {'':2}{'setting':<40} {'accuracy':>10} {'Δ vs dense':>10} {'ms/token':>9} {'speedup':>8} "
                 f"{'mlp sp.':>7}  fit unit")
    dense = next((r for r in front.rows if r.setting.is_dense), None)
    rows = sorted(front.rows, key=lambda r: (not r.on_front, r.latency_ms if r.latency_ms is not None else 1e30,
                                             r.setting.label))
    for r in rows:
        change = (r.accuracy / dense.accuracy - 1.0) if dense and dense.accuracy else None
        spd = (dense.latency_ms / r.latency_ms) if dense and dense.latency_ms and r.latency_ms else None
        rs = r.setting.realized_sparsity
        lines.append(f"  {'*' if r.on_front else ' ':2}{r.setting.label:<40} {r.accuracy:>10.4g} "
                     f"{'' if change is None else f'{100 * change:+.1f}%':>10} "
                     f"{'-' if r.latency_ms is None else f'{r.latency_ms:.2f}':>9} "
                     f"{'' if spd is None else f'{spd:.2f}x':>8} {'' if rs is None else f'{rs:.3f}':>7}  "
                     f"{r.setting.fit_unit[:12]}")
    lines.append("  (* = on the front; Δ = the metric's relative change; the oracle is a bound, never chosen)")
    return "\n".join(lines)


def print_fronts(engine, models: list[str], device_types: tuple[str, ...] = ("cpu", "cuda", "npu")) -> None:
    with session_scope(engine) as s:
        for m in models:
            for dev in device_types:
                try:
                    _, front = front_for(s, m, device_type=dev)
                except ParetoError as e:
                    print(f"{m}: {e}")
                    break
                if front.message and dev != "cpu" and all(r.latency_ms is None for r in front.rows):
                    print(f"{m}: no latency rows for {dev} yet")
                    continue
                print(format_front(front, m))
