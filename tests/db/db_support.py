"""Shared builders for the tests/db suite (also imported by spawned worker processes)."""

from __future__ import annotations

import hashlib

from sqlalchemy import Engine

from db import queries as q
from db.engine import get_engine, session_scope
from db.schemas import AccuracyRow, ArtifactRow, LatencyRow, LayerRow, UnitSpec
from tests.unit_configs import eval_config

PROV = {"package_versions": {"sqlalchemy": "2.1.9"}, "git_rev": "0123abcd"}
N_ACC, N_LAT, N_LAYER, N_ART = 3, 2, 4, 1


def uid(i: int) -> str:
    return hashlib.sha256(f"unit-{i}".encode()).hexdigest()[:16]


def unit_spec(i: int, model_id: int, **kw) -> UnitSpec:
    base = dict(id=uid(i), model_id=model_id, kind="eval", method="svdp", sparsity=(i % 10) / 10,
                rank=256, device_type="cpu", config=eval_config("f" * 16, "copa", limit=i + 1), code_version="0.1.0")
    return UnitSpec(**{**base, **kw})


def results(i: int) -> dict:
    """The rows one finished unit writes: N_ACC accuracy, N_LAT latency, N_LAYER layer, N_ART artifact."""
    return dict(
        accuracy_rows=[AccuracyRow(suite="core", task=t, metric="acc", higher_is_better=True, value=0.5 + i / 1000,
                                   stderr=0.01, n=200, **PROV)
                       for t in ("piqa", "arc_easy", "copa")[:N_ACC]],
        latency_rows=[LatencyRow(device_type="cpu", accelerator_name="x86", batch=b, prompt_len=128, gen_len=64,
                                 p50_ms_per_token=10.0, p90_ms_per_token=12.0, tokens_per_s=100.0,
                                 realized_sparsity=0.5, runtime="ours-sparse", **PROV)
                      for b in (1, 4)[:N_LAT]],
        layer_rows=[LayerRow(layer=layer, component="mlp", recall=0.9, precision=0.8, realized_sparsity=0.5,
                             target_sparsity=0.5, auc=0.95) for layer in range(N_LAYER)],
        artifacts=[ArtifactRow(kind="predictor", uri=f"file:///cache/{uid(i)}/predictor.safetensors",
                               sha256="0" * 64, size_bytes=1234)],
    )


def seed(engine: Engine, n_units: int, *, sweep: str = "sweep-a") -> tuple[int, int, list[str]]:
    """A model, a sweep and ``n_units`` registered units: ``(model_id, sweep_id, unit_ids)``."""
    with session_scope(engine) as s:
        model_id = q.upsert_model(s, name="SmolLM2-135M", fingerprint="fp-smollm2", family="llama")
        sweep_id, _ = q.get_or_create_sweep(s, name=sweep, spec_hash=hashlib.sha256(sweep.encode()).hexdigest(),
                                            spec={"name": sweep})
        q.register_units(s, sweep_id, [unit_spec(i, model_id) for i in range(n_units)])
    return model_id, sweep_id, [uid(i) for i in range(n_units)]


def finish_all(engine_or_url: Engine | str, indices: list[int]) -> list[tuple[str, bool]]:
    """Finish units by index, one transaction each (thread worker: shared engine; process: a URL)."""
    own = isinstance(engine_or_url, str)
    engine = get_engine(engine_or_url) if own else engine_or_url
    out = []
    try:
        for i in indices:
            with session_scope(engine) as s:
                q.mark_running(s, uid(i), worker=f"w{i}")
            # read, then write, in one transaction: the pattern that makes a deferred SQLite
            # transaction fail with "database is locked" when another writer commits in between
            with session_scope(engine) as s:
                q.get_unit(s, uid(i))
                q.list_sweeps(s)
                out.append((uid(i), q.finish_unit(s, uid(i), **results(i), duration_s=1.0)))
    finally:
        if own:
            engine.dispose()
    return out
