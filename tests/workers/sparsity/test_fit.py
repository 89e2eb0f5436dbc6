"""The one fit pipeline (workers.sparsity.fit): allocation budgets, and one error for an unknown allocation through
every door (a sweep's fit unit, the points runner and its CLI, the sweep spec)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from workers.sparsity.fit import ALLOCATIONS, check_allocation, fit_setting, layer_budgets

UNKNOWN = "unknown allocation 'magic'; known: ['uniform', 'greedy', 'exchange']"


def _ctx(n_layers=3):
    return SimpleNamespace(layers=list(range(n_layers)))


def test_known_allocations_and_the_error_naming_them():
    assert ALLOCATIONS == ("uniform", "greedy", "exchange")
    assert check_allocation("greedy") == "greedy"
    with pytest.raises(ValueError) as e:
        check_allocation("magic")
    assert str(e.value) == UNKNOWN


def test_uniform_budget_is_the_same_everywhere_and_measures_nothing():
    def never():
        raise AssertionError("uniform must not measure damage curves")

    assert layer_budgets(_ctx(3), 0.5, "uniform", curves=never) == {0: 0.5, 1: 0.5, 2: 0.5}


def test_greedy_budget_goes_to_the_cheapest_layer_first():
    grid = [round(0.05 * i, 2) for i in range(20)]
    curves = {0: [10 * g for g in grid],           # expensive
              1: [0.1 * g for g in grid],          # cheap
              2: [1.0 * g for g in grid]}          # in between
    # a mean of 0.05 over 3 layers = 3 grid steps, all on the cheapest layer
    assert layer_budgets(_ctx(3), 0.05, "greedy", curves=lambda: curves) == {0: 0.0, 1: 0.15, 2: 0.0}
    # with layer 1's marginal cost rising past layer 2's, the budget spills over
    curves[1] = [0.1 * g if g <= 0.1 else 0.01 + 5 * (g - 0.1) for g in grid]
    assert layer_budgets(_ctx(3), 0.05, "greedy", curves=lambda: curves) == {0: 0.0, 1: 0.1, 2: 0.05}


def test_dense_fits_nothing():
    f = fit_setting(_ctx(2), "dense", 0.0)
    assert not f.plan.mlp and not f.plan.attn and f.per_layer == {}


def test_unknown_allocation_is_one_error_through_the_fit_unit_and_the_points_runner(tmp_path, capsys):
    from benchmarks.quality import main, run_point
    from db.units import FitConfig
    from workers.units import Units

    cfg = FitConfig(model="smollm2-135m", model_fp="x", method="oracle", sparsity=0.5, allocation="magic",
                    data={"source": "lambada", "calib_tokens": 1024, "metric_tokens": 512, "seq_len": 256})
    with pytest.raises(ValueError) as unit_err:
        Units().fit("0" * 40, cfg)                 # raised before any model is loaded
    with pytest.raises(ValueError) as point_err:
        run_point(object(), "oracle", 0.5, allocation="magic")
    assert str(unit_err.value) == str(point_err.value) == UNKNOWN

    points = tmp_path / "points.json"
    points.write_text(json.dumps([{"method": "oracle", "sparsity": 0.5},
                                  {"method": "oracle", "sparsity": 0.5, "allocation": "magic"}]))
    assert main(["--points", str(points)]) == 2    # before the model loads
    assert UNKNOWN in capsys.readouterr().err


def test_the_spec_takes_its_allocations_from_the_pipeline():
    from orchestrator.spec import SpecError, parse_spec

    good = {"name": "ok", "models": ["smollm2-135m"],
            "methods": [{"name": "oracle", "sparsity": [0.5], "allocation": "greedy"}]}
    assert parse_spec(good).methods[0].allocation == "greedy"
    good["methods"][0]["allocation"] = "magic"
    with pytest.raises(SpecError) as e:
        parse_spec(good)
    assert f"methods.0.allocation: Value error, {UNKNOWN}" in str(e.value)


def test_a_methods_fit_cost_is_a_known_rank():
    from workers.sparsity.predictors import FIT_COST, register

    assert FIT_COST["dejavu"] == 2 and FIT_COST["svd"] == 1 and FIT_COST["oracle"] == 0
    with pytest.raises(ValueError, match="fit_cost of 'slow' must be one of"):
        register("slow", fit_cost=3)


def test_the_dense_fit_reads_no_activations_and_waits_for_no_collection(smollm2):
    """Dense has nothing to fit or score: its fit unit saves the dense bundle without the calibration and held-out
    activations (so its evaluations can start while the model's collection still runs), and the plan gives it no
    dependency; every other fit reads them and waits for the collection."""
    from db.units import FitConfig
    from orchestrator.plan import plan_units
    from orchestrator.spec import parse_spec
    from workers.units import Units

    units = Units()
    units._lms["smollm2-135m"] = smollm2

    def no_activations(cfg):
        raise AssertionError(f"{cfg.method}'s fit asked for activations")

    units._caches = no_activations
    cfg = FitConfig(model="smollm2-135m", model_fp=smollm2.fingerprint, method="dense", sparsity=0.0,
                    data={"source": "lambada", "calib_tokens": 1024, "metric_tokens": 512, "seq_len": 256})
    out = units.fit("d" * 40, cfg)
    assert out.summary["fit_s"] == 0.0 and out.layers == [] and out.artifacts
    with pytest.raises(AssertionError, match="oracle's fit asked for activations"):
        units.fit("o" * 40, cfg.model_copy(update={"method": "oracle", "sparsity": 0.5}))

    spec = parse_spec({"name": "t", "models": ["smollm2-135m"], "methods": [{"name": "oracle", "sparsity": [0.5]}],
                       "suites": {"tasks": [{"name": "piqa", "limit": 10}]}, "latency": None})
    plan = plan_units(spec, {"smollm2-135m": {"fingerprint": "fp", "calib_fp": "c", "heldout_fp": "h"}})
    collect = next(u for u in plan if u.kind == "collect")
    fits = {u.method: u for u in plan if u.kind == "fit"}
    assert fits["dense"].deps == () and fits["oracle"].deps == (collect.id,)
