"""Unit configs for tests that write units into a store by hand: the stored form (``canonical``) of the typed
configs of ``db.units``, with the fields a test does not care about filled in."""
from __future__ import annotations

from db.units import DataConfig, FitConfig, LatencyConfig, PerplexityConfig, PerplexityEvalConfig, TaskEvalConfig

MODEL = {"model": "tiny", "model_fp": "f" * 64}
DATA = DataConfig(source="lambada", calib_tokens=256, metric_tokens=256, seq_len=256)


def fit_config(method: str = "dense", sparsity: float = 0.0, **kw) -> dict:
    return FitConfig(**{**MODEL, "data": DATA, "calib_fp": "c" * 64, "method": method, "sparsity": sparsity,
                        "threads": 1, **kw}).canonical()


def eval_config(fit_unit: str, suite: str = "perplexity", **kw) -> dict:
    common = {**MODEL, "data": DATA, "calib_fp": "c" * 64, "fit_unit": fit_unit, "threads": 1,
              "exec_mode": "masked"}
    if suite == "perplexity":
        return PerplexityEvalConfig(**{**common, "perplexity": PerplexityConfig(tokens=256, seq_len=256),
                                       "heldout_fp": "h" * 64, **kw}).canonical()
    return TaskEvalConfig(**{**common, "suite": suite, "limit": 4, **kw}).canonical()


def latency_config(fit_unit: str, device_type: str = "cpu", **kw) -> dict:
    return LatencyConfig(**{**MODEL, "fit_unit": fit_unit, "device_type": device_type, "batch": 1, "prompt_len": 16,
                            "gen_len": 8, "repeats": 1, "runtime": "ctxsparse", "threads": 2, **kw}).canonical()
