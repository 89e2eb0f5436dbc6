"""The typed unit configs (``db.units``): one canonical form per config, the one that makes the unit's id.

Every unit of every published result set (``benchmarks/results/*.jsonl``) read back through the models gives the
config the store kept, to the byte, and so its id; fields added later stay out at their defaults; keys the models do
not know are kept; a config of the wrong kind or lacking a field is refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from db.units import (CollectConfig, DataConfig, FitConfig, GridSetting, LatencyConfig, PerplexityEvalConfig,
                      TaskEvalConfig, unit_config, unit_id)
from tests.unit_configs import eval_config, fit_config, latency_config

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _published_units() -> list[dict]:
    out = []
    for path in sorted(RESULTS.glob("*.jsonl")):
        with path.open() as f:
            out += [rec["row"] for rec in map(json.loads, f) if rec.get("table") == "work_units"]
    return out


def test_every_published_unit_id_is_recomputed_from_its_typed_config():
    units = _published_units()
    assert len(units) >= 4000 and {u["kind"] for u in units} == {"collect", "fit", "eval", "latency"}
    for u in units:
        cfg = unit_config(u["kind"], u["config"])
        assert cfg.canonical() == u["config"], u["id"]
        assert not cfg.model_extra, (u["id"], cfg.model_extra)        # every published key is a typed field
        assert cfg.unit_id(u["code_version"]) == u["id"]
        assert json.dumps(cfg.canonical(), sort_keys=True) == json.dumps(u["config"], sort_keys=True)


def test_fields_added_later_are_left_out_at_their_defaults():
    plain = TaskEvalConfig.model_validate(eval_config("f1", "piqa"))
    assert not {"matmul", "fused", "batch_size", "batch_tokens", "generation", "shard", "capture"} & set(
        plain.canonical())
    assert {"limit", "exec_mode", "threads", "calib_fp", "data"} <= set(plain.canonical())   # always written
    tf32 = plain.model_copy(update={"matmul": "tf32", "shard": (0, 2)})
    assert tf32.canonical()["matmul"] == "tf32" and tf32.canonical()["shard"] == [0, 2]
    assert tf32.whole.canonical() == {**plain.canonical(), "matmul": "tf32"}
    assert len({plain.unit_id("v"), tf32.unit_id("v"), tf32.whole.unit_id("v")}) == 3
    lat = LatencyConfig.model_validate(latency_config("f1"))
    assert "weights" not in lat.canonical() and "setting" not in lat.canonical() and lat.canonical()["paired"] is False
    shaped = lat.model_copy(update={"weights": "gguf", "setting": GridSetting(method="dense", sparsity=0.0)})
    assert shaped.canonical()["setting"] == {"method": "dense", "sparsity": 0.0, "rank": None, "attn_sparsity": None,
                                             "allocation": "uniform", "options": {}}
    fit = FitConfig(model="shape:x", model_fp="fp", method="dense", sparsity=0.0, threads=1)  # no calibration data
    assert set(fit.canonical()) == {"model", "model_fp", "method", "sparsity", "rank", "attn_sparsity", "allocation",
                                    "options", "seed", "threads"}
    assert fit.setting == GridSetting(method="dense", sparsity=0.0)


def test_the_id_hashes_kind_canonical_config_and_code_version():
    cfg = FitConfig.model_validate(fit_config("oracle", 0.5))
    assert cfg.unit_id("v1") == unit_id("fit", cfg.canonical(), "v1") != cfg.unit_id("v2")
    assert unit_id("eval", cfg.canonical(), "v1") != cfg.unit_id("v1")
    again = unit_config("fit", json.loads(json.dumps(cfg.canonical())))
    assert again == cfg and again.unit_id("v1") == cfg.unit_id("v1")


def test_unknown_keys_are_kept_and_hashed():
    stored = {**latency_config("f1"), "from_a_newer_planner": 3}
    cfg = unit_config("latency", stored)
    assert cfg.model_extra == {"from_a_newer_planner": 3} and cfg.canonical() == stored
    assert cfg.unit_id("v") != unit_config("latency", latency_config("f1")).unit_id("v")


def test_kinds_and_missing_fields_are_refused():
    assert isinstance(unit_config("eval", eval_config("f1")), PerplexityEvalConfig)
    assert isinstance(unit_config("eval", eval_config("f1", "copa")), TaskEvalConfig)
    data = DataConfig(source="lambada", calib_tokens=256, metric_tokens=256, seq_len=256)
    typed = unit_config("collect", {"model": "m", "model_fp": "fp", "calib_fp": "c", "data": data.canonical()})
    assert isinstance(typed, CollectConfig) and typed.data == data and unit_config("collect", typed) is typed
    with pytest.raises(ValueError, match="a collect config given for a fit unit"):
        unit_config("fit", typed)
    with pytest.raises(ValueError, match="unknown unit kind 'kernel'"):
        unit_config("kernel", {})
    with pytest.raises(ValidationError, match="calib_fp"):
        unit_config("collect", {"model": "m", "model_fp": "fp", "data": data.canonical()})
    with pytest.raises(ValidationError, match="fit_unit"):
        unit_config("latency", {k: v for k, v in latency_config("f1").items() if k != "fit_unit"})
    with pytest.raises(ValidationError, match="matmul"):
        unit_config("eval", {**eval_config("f1", "copa"), "matmul": "fp16"})
    with pytest.raises(ValidationError, match="frozen"):
        typed.model = "other"
