"""The store's operations (``db.store.Store``), known answers on a real store: recording a sweep with its models
and data, the unit lifecycle as the actors and the kernel ingest drive it, the status reads of the CLI and the
dashboard, the front's reads (settings, front, pick, measurement), the dashboard's state check, and
``open_store``'s one-message errors. The lifecycle runs on SQLite and PostgreSQL (``db_url``)."""
from __future__ import annotations

import hashlib

import pytest

from db.__main__ import main as db_main
from db.engine import ReadOnlyDatabaseError
from db.schemas import DatasetSpec, ModelSpec, NewUnit
from db.store import Store, StoreError, StoreState, open_store
from tests.unit_configs import eval_config, fit_config, latency_config

PROV = {"package_versions": {"x": "1"}, "git_rev": "r"}
MODEL = ModelSpec(name="tiny", fingerprint="fp-tiny", family="llama", config={"d": 8}, n_params=100)
OTHER = ModelSpec(name="other", fingerprint="fp-other", family="qwen2")
DATA = DatasetSpec(name="lambada-calib", fingerprint="fp-data", source="lambada", n_tokens=256, split="calib")


def uid(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()[:16]


def new_unit(label: str, model: ModelSpec = MODEL, dataset: DatasetSpec | None = None, **cols) -> NewUnit:
    return NewUnit(model=model, dataset=dataset, unit={"id": uid(label), "kind": "eval", "method": "threshold",
                                                       "sparsity": 0.5, "config": eval_config("f" * 16, "copa"),
                                                       "code_version": "t", **cols})


def acc(metric: str, value: float, higher: bool = False, suite: str = "perplexity", task: str = "lambada") -> dict:
    return dict(suite=suite, task=task, metric=metric, higher_is_better=higher, value=value, n=10, **PROV)


def lat(ms: float, runtime: str = "ctxsparse-sparse", threads: int = 2) -> dict:
    return dict(device_type="cpu", accelerator_name="cpu-a", batch=1, prompt_len=16, gen_len=8,
                p50_ms_per_token=ms, p90_ms_per_token=ms, tokens_per_s=1000 / ms, runtime=runtime, threads=threads,
                **PROV)


@pytest.fixture
def store(db_url):
    st = open_store(db_url)
    yield st
    st.close()


def test_record_sweep_registers_units_with_their_models_and_data(store):
    units = [new_unit("a", dataset=DATA), new_unit("b", dataset=DATA), new_unit("c", OTHER)]
    sid, created = store.record_sweep(name="s", spec_hash="h" * 64, spec={"name": "s"}, units=units, status="running")
    assert created
    assert store.record_sweep(name="s", spec_hash="h" * 64, spec={"name": "s"}, units=units[:1],
                              submission_id="sub-2") == (sid, False)
    [sw] = store.sweeps()
    assert (sw.id, sw.status, sw.submission_id, sw.n_units_total) == (sid, "running", "sub-2", 3)
    models = {m.name: m for m in store.models()}
    assert sorted(models) == ["other", "tiny"] and models["tiny"].config == {"d": 8} and models["tiny"].n_params == 100
    a, c = store.unit(uid("a")), store.unit(uid("c"))
    assert (a.model_id, c.model_id) == (models["tiny"].id, models["other"].id)
    assert a.dataset_id is not None and a.dataset_id == store.unit(uid("b")).dataset_id and c.dataset_id is None
    assert store.unit_statuses([uid("a"), uid("c"), uid("nope")]) == {uid("a"): "pending", uid("c"): "pending"}
    # more units later (the front's): registered once, their statuses back
    assert store.add_units(sid, [new_unit("d"), new_unit("a")]) == {uid("d"): "pending", uid("a"): "pending"}
    assert store.sweeps()[0].n_units_total == 4
    assert store.unit_ids_with_prefix(uid("d")[:6]) == [uid("d")] and store.unit_ids_with_prefix("xyz") == []
    assert [s.id for s in store.sweeps_for_unit(uid("d"))] == [sid]


def test_unit_lifecycle_and_the_sweeps_status(store):
    sid, _ = store.record_sweep(name="s", spec_hash="h" * 64, spec={},
                                units=[new_unit(k) for k in ("ok", "bad", "left", "shard")])
    assert store.start_unit(uid("ok"), "w1", **PROV)
    assert store.finish_unit(uid("ok"), [acc("ppl", 10.0)], [lat(5.0)],
                             [dict(layer=0, component="mlp", realized_sparsity=0.5)],
                             [dict(kind="bundle_file", uri="/b/manifest.json", sha256="0" * 64)], duration_s=1.0)
    assert not store.finish_unit(uid("ok"), [acc("ppl", 99.0)])               # done: nothing written
    assert not store.start_unit(uid("ok"), "w2") and not store.fail_unit(uid("ok"), "late")
    assert store.fail_unit(uid("bad"), "boom")
    assert [r.value for r in store.accuracy_rows(store.unit(uid("ok")).model_id)] == [10.0]
    assert [m.layer for m in store.layer_metrics(uid("ok"))] == [0]
    assert [a.uri for a in store.artifacts(uid("ok"), "bundle_file")] == ["/b/manifest.json"]
    assert store.artifacts(uid("ok"), "other") == []
    [st] = store.sweep_statuses()
    assert (st.sweep.id, tuple(st.progress)) == (sid, (1, 1, 4)) and [u.id for u in st.failures] == [uid("bad")]
    assert store.sweep_statuses([st.sweep])[0].progress == st.progress
    assert tuple(store.finish_sweep(sid, "failed")) == (1, 1, 4)
    [sw] = store.sweeps()
    assert sw.status == "failed" and sw.finished_at is not None and sw.n_units_done == 1


def test_shard_scores_wait_for_every_shard(store):
    store.record_sweep(name="s", spec_hash="h" * 64, spec={}, units=[new_unit("s0"), new_unit("s1")])
    shards = [uid("s0"), uid("s1")]
    store.finish_unit(uid("s0"), request_scores=[dict(request=1, loglikelihood=-0.5, greedy=True),
                                                 dict(request=0, loglikelihood=-1.5, greedy=False)])
    assert store.shard_scores(shards) == ([uid("s1")], {})
    store.finish_unit(uid("s1"))                                             # scored nothing: absent
    waiting, found = store.shard_scores(shards)
    assert waiting == [] and list(found) == [uid("s0")]
    assert tuple(found[uid("s0")]) == ([0, 1], [-1.5, -0.5], [False, True])


def test_claim_and_finish_unit_writes_once(store):
    store.record_sweep(name="k", spec_hash="k" * 64, spec={}, units=[new_unit("k")])
    assert store.claim_and_finish_unit(uid("k"), "ingest", latency_rows=[lat(3.0)])
    u = store.unit(uid("k"))
    assert (u.status, u.worker, u.attempts) == ("done", "ingest", 1)
    # done: skipped, its rows never read (a bad row of a unit loaded before is no error)
    assert not store.claim_and_finish_unit(uid("k"), "ingest", latency_rows=[{**lat(3.0), "p50_ms_per_token": -1}])
    store.record_sweep(name="k", spec_hash="k" * 64, spec={}, units=[new_unit("k2")])
    with pytest.raises(ValueError, match="p50_ms_per_token"):             # a pending unit's bad row: nothing lands
        store.claim_and_finish_unit(uid("k2"), "ingest", latency_rows=[{**lat(3.0), "p50_ms_per_token": -1}])
    assert store.unit(uid("k2")).status == "pending"


def _front_store(tmp_path) -> tuple[Store, dict[str, str]]:
    """One model: dense (ppl 10, 10 ms), threshold s=0.5 (ppl 10.4, 6 ms, skips 0.5), s=0.7 (ppl 20, 5 ms, 0.7)."""
    store = open_store(f"sqlite:///{tmp_path / 'front.db'}")
    rows = {"dense": (0.0, 10.0, 0.0, 10.0), "t5": (0.5, 10.4, 0.5, 6.0), "t7": (0.7, 20.0, 0.7, 5.0)}
    units = []
    for k, (s, *_rest) in rows.items():
        method = "dense" if k == "dense" else "threshold"
        common = {"method": method, "sparsity": s}
        units += [new_unit(f"fit-{k}", kind="fit", **{**common, "config": fit_config(method, s)}),
                  new_unit(f"ev-{k}", **{**common, "config": eval_config(uid(f"fit-{k}"))}),
                  new_unit(f"lat-{k}", kind="latency", device_type="cpu",
                           **{**common, "config": latency_config(uid(f"fit-{k}"))})]
    store.record_sweep(name="f", spec_hash="f" * 64, spec={}, units=units)
    for k, (_, ppl, skipped, ms) in rows.items():
        store.finish_unit(uid(f"fit-{k}"))
        store.finish_unit(uid(f"ev-{k}"), [acc("ppl", ppl), acc("weight_skipped", skipped, higher=True)])
        store.finish_unit(uid(f"lat-{k}"), latency_rows=[lat(ms)])
    return store, {k: uid(f"fit-{k}") for k in rows}


def test_the_front_read_through_the_store(tmp_path):
    store, fits = _front_store(tmp_path)
    settings, front = store.front("tiny")
    assert [s.fit_unit for s in settings] == [fits["dense"], fits["t5"], fits["t7"]]
    assert front.metric == "perplexity/lambada/ppl" and front.threads == 2
    assert {r.setting.fit_unit for r in front.rows if r.on_front} == set(fits.values())
    assert [s.fit_unit for s in store.settings(settings[0].model_id)] == [s.fit_unit for s in settings]
    evals = {uid(f"ev-{k}") for k in fits}
    pick = store.front_pick("fp-tiny", list(fits.values()), evals)
    assert (pick.axis, set(pick.chosen)) == ("weight_skipped", set(fits.values()))
    assert pick.within(0.05) == [fits["dense"], fits["t5"]]
    m = store.measurement(fits["t5"], "cpu")
    assert (m["threads"], m["p50_ms_per_token"], m["speedup_vs_dense"]) == (2, 6.0, pytest.approx(10 / 6))
    assert store.measurement(fits["t5"], "cuda") is None and store.measurement("0" * 16) is None
    from db.front.pareto import ParetoError

    with pytest.raises(ParetoError, match="no model 'nope' in the store"):
        store.front("nope")
    store.close()


def test_the_dashboards_state_check(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    missing = Store(url, read_only=True).state()
    assert not missing.ok and missing.message.startswith(f"no database file at {tmp_path / 'state.db'}")
    assert not (tmp_path / "state.db").exists()
    Store(url).connect()                                                  # an empty file: no tables yet
    assert Store(url, read_only=True).state() == StoreState(
        False, True, "the database has no ctxsparse tables yet: run `python -m db upgrade`")
    rw = open_store(url)
    assert Store(url, read_only=True).state() == StoreState(True, True)
    rw.record_sweep(name="s", spec_hash="h" * 64, spec={}, units=[new_unit("a")])
    ro = Store(url, read_only=True)
    assert ro.state() == StoreState(True, False)
    with pytest.raises(ReadOnlyDatabaseError):
        ro.fail_unit(uid("a"), "boom")


def test_a_result_set_loads_into_a_new_store(tmp_path):
    src = open_store(f"sqlite:///{tmp_path / 'src.db'}")
    src.record_sweep(name="s", spec_hash="h" * 64, spec={}, units=[new_unit("a")])
    src.finish_unit(uid("a"), [acc("ppl", 10.0)])
    assert db_main(["export", "s", str(tmp_path / "s.jsonl"), "--db", src.url]) == 0
    dst = Store(f"sqlite:///{tmp_path / 'dst.db'}")
    dst.migrate()
    added = dst.load_result_set(tmp_path / "s.jsonl")
    assert (added["work_units"], added["accuracy_results"]) == (1, 1)
    assert dst.load_result_set(tmp_path / "s.jsonl")["work_units"] == 0
    assert [m.name for m in dst.models()] == ["tiny"]


def test_open_store_errors_are_one_message():
    with pytest.raises(StoreError, match=r"^cannot open the store: bad database URL \(Could not parse"):
        open_store("not a url")
    with pytest.raises(StoreError, match=r"^cannot open the store at postgresql\+psycopg://u:\*\*\*@127\.0\.0\.1:1/x: "):
        open_store("postgresql://u:secret@127.0.0.1:1/x", migrate=False)
