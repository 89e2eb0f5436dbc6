"""``only: front`` tasks (GSM8K): run for dense and the settings on the front of the sweep's cheaper suites, picked
when those are done. The pick on hand-built settings (``db.front.pareto.front_pick``: known answers, dense
always, the oracle never keeping a deployable setting off, nominal sparsity where a realized one is missing, and
``within``: only the front's settings near dense), the spec's checks, and the driver's hold-and-release of those
units (``orchestrator.driver.FrontWait``) on a real SQLite store with hand-built rows: exactly the expected units
are registered, once, only after every model's front-defining units are done, and a front with no row still runs
dense.
"""
from __future__ import annotations

import copy

import pytest

from db.front.pareto import front_pick
from db.front.settings import Setting
from db.store import Store
from orchestrator.driver import FrontWait, before_front, register
from orchestrator.plan import plan_units
from orchestrator.spec import SpecError, parse_spec

PPL = "perplexity/lambada-heldout/ppl"
SKIPPED = "perplexity/lambada-heldout/weight_skipped"


def _setting(key: str, method: str, s: float, ppl: float | None, skipped: float | None, acc: float | None = None):
    st = Setting(fit_unit=key, model_id=1, model_name="m", method=method, sparsity=s, rank=None, attn_sparsity=None,
                 allocation="uniform", options={}, status="done")
    for metric, value, higher in ((PPL, ppl, False), (SKIPPED, skipped, True), ("mc/copa/acc", acc, True)):
        if value is not None:
            st.accuracy[metric], st.higher_is_better[metric] = value, higher
    return st


def _grid(**drop):
    """dense (ppl 10.0, skips 0), A (10.5, 0.30), B (12.0, 0.50), C (13.0, 0.45: B beats it), D (20.0, 0.70),
    E (11.0, 0.25: A beats it), the oracle O (10.2, 0.50: it beats A and B, but it is a bound)."""
    rows = [("dense", "dense", 0.0, 10.0, 0.0), ("A", "threshold", 0.3, 10.5, 0.30), ("B", "threshold", 0.5, 12.0, 0.50),
            ("C", "teal", 0.5, 13.0, 0.45), ("D", "threshold", 0.7, 20.0, 0.70), ("E", "teal", 0.3, 11.0, 0.25),
            ("O", "oracle", 0.5, 10.2, 0.50)]
    return [_setting(k, m, s, p, None if k in drop else w) for k, m, s, p, w in rows]


def test_front_pick_known_answer():
    pick = front_pick(_grid())
    assert (pick.metric, pick.axis) == (PPL, "weight_skipped")
    assert pick.front == ["dense", "O", "A", "B", "D"]          # best metric first
    assert pick.chosen == ["dense", "O", "A", "B", "D"]
    assert pick.labels["B"] == "threshold s=0.5"


def test_front_pick_on_nominal_sparsity_when_a_realized_one_is_missing():
    """E's grid sparsity 0.3 equals A's there, and A's ppl is better: E stays off; C (0.5) ties B's sparsity
    with a worse ppl: off."""
    pick = front_pick(_grid(D=True))
    assert pick.axis == "sparsity" and pick.front == ["dense", "O", "A", "B", "D"]
    worse = _grid(D=True)
    worse[1].accuracy[PPL] = 11.5                               # A now worse than E on ppl at equal grid sparsity
    assert front_pick(worse).front == ["dense", "O", "E", "B", "D"]


def test_dense_is_always_chosen_and_ties_stay_on_the_front():
    grid = _grid()
    grid[0].accuracy[PPL] = 99.0                                # dense is beaten by A on both axes
    pick = front_pick(grid)
    assert "dense" not in pick.front and pick.chosen[0] == "dense" and set(pick.chosen) == {"dense", *pick.front}
    twin = _setting("B2", "threshold", 0.5, 12.0, 0.50)         # equal to B on both axes: neither beats the other
    assert {"B", "B2"} <= set(front_pick(_grid() + [twin]).front)
    acc_only = [_setting(k, m, s, None, None, a) for k, m, s, a in
                (("dense", "dense", 0.0, 0.7), ("A", "threshold", 0.5, 0.72), ("B", "threshold", 0.7, 0.6))]
    pick = front_pick(acc_only)                                  # higher is better: A beats dense
    assert (pick.metric, pick.axis, pick.front, pick.chosen) == ("mc/copa/acc", "sparsity", ["A", "B"],
                                                                 ["dense", "A", "B"])
    empty = front_pick([_setting("dense", "dense", 0.0, None, None), _setting("A", "threshold", 0.5, None, None)])
    assert (empty.metric, empty.front, empty.chosen) == (None, [], ["dense"])


def test_within_keeps_the_front_settings_a_user_would_deploy():
    """``FrontPick.within``: dense (ppl 10.0) always; the front's settings with ppl at most 10.0 x (1 + budget)."""
    pick = front_pick(_grid())
    assert pick.within(None) == pick.chosen == ["dense", "O", "A", "B", "D"]
    assert pick.within(0.25) == ["dense", "O", "A", "B"]                # D's 20.0 is past 12.5
    assert pick.within(0.04) == ["dense", "O"]                          # A's 10.5 is past 10.4
    acc_only = [_setting(k, m, s, None, None, a) for k, m, s, a in
                (("dense", "dense", 0.0, 0.7), ("A", "threshold", 0.5, 0.72), ("B", "threshold", 0.7, 0.6))]
    assert front_pick(acc_only).within(0.1) == ["dense", "A"]           # higher is better: B's 0.6 is under 0.63
    no_dense_row = _grid()
    del no_dense_row[0].accuracy[PPL]
    pick = front_pick(no_dense_row)
    assert pick.within(0.01) == pick.chosen and "D" in pick.chosen      # nothing to measure the loss against


# ---------------------------------------------------------------------------------------------- the spec
BASE = {"name": "front", "models": ["smollm2-135m"],
        "methods": [{"name": "threshold", "sparsity": [0.3, 0.5, 0.7]}],
        "suites": {"perplexity": {"tokens": 256, "seq_len": 256},
                   "tasks": [{"name": "copa", "limit": 4}, {"name": "gsm8k_cot", "limit": 2, "only": "front"}]},
        "latency": None, "resources": {"torch_threads": 1}}
DESCRIBED = {"smollm2-135m": {"fingerprint": "fp-front", "calib_fp": "c", "heldout_fp": "h", "name": "smollm2-135m",
                              "family": "llama", "dims": {}, "n_params": 1, "calib_n_tokens": 256}}


def _spec(**suites):
    d = copy.deepcopy(BASE)
    d["suites"].update(suites)
    return parse_spec(d)


def test_only_front_is_checked_and_kept_out_of_the_hash_when_absent():
    assert _spec().suites.tasks[1].only == "front"
    assert _spec().canonical()["suites"]["tasks"] == [{"name": "copa", "limit": 4},
                                                      {"name": "gsm8k_cot", "limit": 2, "only": "front"}]
    with pytest.raises(SpecError, match=r"suites.tasks.1.only: Input should be 'front'"):
        _spec(tasks=[{"name": "copa"}, {"name": "gsm8k_cot", "only": "best"}])
    with pytest.raises(SpecError, match=r"tasks \['gsm8k_cot'\] run only on the front .* no suite draws it: give "
                                        "perplexity or a task without 'only'"):
        _spec(perplexity=None, tasks=[{"name": "gsm8k_cot", "only": "front"}])
    assert _spec(perplexity=None).suites.perplexity is None       # copa draws it


def test_within_goes_with_only_front():
    tasks = [{"name": "copa"}, {"name": "gsm8k_cot", "only": "front", "within": 0.25}]
    assert _spec(tasks=tasks).canonical()["suites"]["tasks"][1] == {"name": "gsm8k_cot", "limit": 100,
                                                                    "only": "front", "within": 0.25}
    with pytest.raises(SpecError, match=r"gsm8k_cot: 'within' bounds the front's settings that an 'only: front' "
                                        r"task runs for; give 'only: front' with it"):
        _spec(tasks=[{"name": "copa"}, {"name": "gsm8k_cot", "within": 0.25}])
    with pytest.raises(SpecError, match=r"suites.tasks.1.within: Input should be greater than 0"):
        _spec(tasks=[{"name": "copa"}, {"name": "gsm8k_cot", "only": "front", "within": 0}])


# ---------------------------------------------------------------------------------------------- the driver
def _new_store(tmp_path, name: str = "front") -> Store:
    store = Store(f"sqlite:///{tmp_path / name}.db")
    store.migrate()
    return store


def _store(tmp_path, spec):
    store = _new_store(tmp_path)
    units = plan_units(spec, DESCRIBED)
    sweep_id = register(store, spec, DESCRIBED, units, None)
    return store, units, sweep_id


def _finish(store, u, rows: list[tuple[str, str, str, bool, float]] | None) -> None:
    if rows is None:
        store.fail_unit(u.id, "boom")
        return
    store.finish_unit(u.id, [{"suite": a, "task": b, "metric": c, "higher_is_better": h, "value": v, "n": 4,
                              "package_versions": {"x": "1"}, "git_rev": "r"} for a, b, c, h, v in rows])


# (ppl, weight skipped, copa acc) per setting: threshold s=0.5 beats s=0.3 on both (ppl, skipped); the front of
# ppl (the default metric, before copa's mean accuracy) is dense, s=0.5, s=0.7
ROWS = {("dense", 0.0): (10.0, 0.0, 0.75), ("threshold", 0.3): (11.0, 0.30, 0.75),
        ("threshold", 0.5): (10.8, 0.50, 0.5), ("threshold", 0.7): (30.0, 0.70, 0.25)}


def _rows_of(u) -> list[tuple[str, str, str, bool, float]]:
    """The rows of a front-defining eval unit ``u`` from ``ROWS``: its perplexity unit's, or its copa unit's."""
    ppl, skipped, acc = ROWS[(u.method, u.sparsity)]
    if u.config.suite == "perplexity":
        return [("perplexity", "lambada-heldout", "ppl", False, ppl),
                ("perplexity", "lambada-heldout", "weight_skipped", True, skipped)]
    return [("mc", "copa", "acc", True, acc)]


def test_front_units_are_registered_once_when_the_front_is_drawn(tmp_path):
    spec = _spec()
    store, units, sweep_id = _store(tmp_path, spec)
    held = [u for u in units if u.only]
    assert [u.config.suite for u in held] == ["gsm8k_cot"] * 4
    assert store.unit_statuses([u.id for u in held]) == {}      # held back: not in the store yet
    wait = FrontWait(store, spec, DESCRIBED, sweep_id, units)
    gate = sorted(u.id for u in units if u.kind == "eval" and not u.only)
    assert len(gate) == 8
    assert wait.release(set()) == ([], {})                      # dense's too wait for the scoring to end
    finished = set()
    for u in (u for u in units if u.kind == "eval" and not u.only):
        _finish(store, u, _rows_of(u))
        finished.add(u.id)
        if len(finished) < len(gate):
            assert wait.release(finished) == ([], {})            # the front waits for every front-defining unit
    chosen, statuses = wait.release(finished)
    assert sorted((u.method, u.sparsity) for u in chosen) == [("dense", 0.0), ("threshold", 0.5), ("threshold", 0.7)]
    assert statuses == {u.id: "pending" for u in chosen}
    assert wait.release(finished) == ([], {})                   # once
    assert store.sweep_statuses()[0].progress == (8, 0, 1 + 4 + 8 + 3)   # collect, fits, evals, dense + 2
    again = FrontWait(store, spec, DESCRIBED, sweep_id, units)   # a resumed sweep picks the same units
    assert [u.id for u in again.release(finished)[0]] == [u.id for u in chosen]


def test_within_runs_the_front_units_of_settings_near_dense_only(tmp_path):
    """The same rows with ``within: 0.1``: threshold s=0.7 (ppl 30.0) is on the front but past 11.0; s=0.5 (10.8)
    runs, and so does dense."""
    spec = _spec(tasks=[{"name": "copa", "limit": 4}, {"name": "gsm8k_cot", "limit": 2, "only": "front",
                                                       "within": 0.1}])
    store, units, sweep_id = _store(tmp_path, spec)
    gate = [u for u in units if u.kind == "eval" and not u.only]
    for u in gate:
        _finish(store, u, _rows_of(u))
    chosen, _ = FrontWait(store, spec, DESCRIBED, sweep_id, units).release({u.id for u in gate})
    assert sorted((u.method, u.sparsity) for u in chosen) == [("dense", 0.0), ("threshold", 0.5)]


def test_a_front_without_rows_still_runs_dense(tmp_path):
    """No perplexity, and every copa unit failed: nothing draws a front; GSM8K still runs for dense."""
    spec = _spec(perplexity=None)
    store, units, sweep_id = _store(tmp_path, spec)
    gate = [u for u in units if u.kind == "eval" and not u.only]
    for u in gate:
        _finish(store, u, None)
    chosen, _ = FrontWait(store, spec, DESCRIBED, sweep_id, units).release({u.id for u in gate})
    assert [(u.method, u.config.suite) for u in chosen] == [("dense", "gsm8k_cot")]
    wait = FrontWait(store, spec, DESCRIBED, sweep_id, units)
    assert wait.release(set()) == ([], {})
    assert [u.method for u in wait.release({u.id for u in gate})[0]] == ["dense"]
    assert wait.release({u.id for u in gate}) == ([], {})           # once


def test_the_front_units_wait_for_every_models_scoring(tmp_path):
    """Two models: the first one's front-defining units all done is not enough; its front is released with the
    second's, once that one's are done too."""
    spec = parse_spec({**copy.deepcopy(BASE), "models": ["smollm2-135m", "gemma3-270m"]})
    described = {**DESCRIBED, "gemma3-270m": {**DESCRIBED["smollm2-135m"], "fingerprint": "fp-front-2",
                                              "name": "gemma3-270m", "family": "gemma3"}}
    store = _new_store(tmp_path, "front2")
    units = plan_units(spec, described)
    sweep_id = register(store, spec, described, units, None)
    gates = {m: [u for u in units if u.model == m and u.kind == "eval" and not u.only] for m in spec.models}
    for u in gates["smollm2-135m"]:
        _finish(store, u, None)
    wait = FrontWait(store, spec, described, sweep_id, units)
    first = {u.id for u in gates["smollm2-135m"]}
    assert wait.release(first) == ([], {})
    everything = first | {u.id for u in gates["gemma3-270m"][:-1]}
    assert wait.release(everything) == ([], {})                  # one of the second model's units still runs
    for u in gates["gemma3-270m"]:
        _finish(store, u, None)
    chosen, statuses = wait.release(everything | {gates["gemma3-270m"][-1].id})
    assert sorted((u.model, u.method) for u in chosen) == [("gemma3-270m", "dense"), ("smollm2-135m", "dense")]
    assert set(statuses.values()) == {"pending"}


def test_latency_timed_alone_goes_before_the_front_units(tmp_path):
    """With latency timed alone (``latency.exclusive``, the default), the front's units are released only once the
    latency units have finished too; with latency beside the rest, the fronts alone gate them."""
    spec = parse_spec({**copy.deepcopy(BASE), "latency": {"devices": ["cpu"], "batch": [1], "prompt_len": [8],
                                                          "gen_len": 2, "repeats": 1}})
    store = _new_store(tmp_path, "front-lat")
    units = plan_units(spec, DESCRIBED, cpu_cores=2)
    sweep_id = register(store, spec, DESCRIBED, units, None)
    latency = {u.id for u in units if u.kind == "latency"}
    assert len(latency) == 5 and before_front(spec, units) == latency      # 4 settings, and dense on llama.cpp
    gate = [u for u in units if u.kind == "eval" and not u.only]
    for u in gate:
        _finish(store, u, None)
    finished = {u.id for u in gate}
    wait = FrontWait(store, spec, DESCRIBED, sweep_id, units, after=before_front(spec, units))
    assert wait.release(finished) == ([], {})                    # the fronts are drawn, latency still runs
    assert wait.release(finished | set(sorted(latency)[:4])) == ([], {})
    assert [u.method for u in wait.release(finished | latency)[0]] == ["dense"]
    beside = parse_spec({**copy.deepcopy(BASE), "latency": {**spec.latency.model_dump(), "exclusive": False}})
    assert before_front(beside, plan_units(beside, DESCRIBED, cpu_cores=2)) == set()
    assert before_front(_spec(), plan_units(_spec(), DESCRIBED)) == set()     # no latency
