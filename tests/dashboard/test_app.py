"""AppTest checks of every page against stores filled by real tiny sweeps (see conftest.py): the session's shared
sweep by default; the two-sweep and no-latency stores (``sweep_dbs``, two more sweeps) in the slow tests."""
from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import pytest

from dashboard import data
from db.units import unit_config
from kernels.isa import cpu_info
from tests.sweep_support import FAILING_ERROR
from tests.unit_configs import eval_config, fit_config, latency_config
from workers.decode.llama_cpp import llama_cpp_missing

PAGES = ("views/overview.py", "views/pareto.py", "views/unit.py", "views/bundle.py")


def _page(at, page: str):
    at.run()
    if page != PAGES[0]:
        at.switch_page(page)
        at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _texts(elements) -> str:
    return "\n".join(str(e.value) for e in elements)


def _charts(at) -> list:
    return at.get("vega_lite_chart")


def _all_table(at):
    """The Pareto page's table of every setting (it has the on_front column)."""
    (df,) = [d.value for d in at.dataframe if "on_front" in d.value.columns]
    return df


def _front_table(at):
    (df,) = [d.value for d in at.dataframe if "on_front" not in d.value.columns and "runtime" not in d.value.columns]
    return df


def _baselines_table(at):
    (df,) = [d.value for d in at.dataframe if "runtime" in d.value.columns]
    return df


def _model_id(url: str) -> int:
    (m,) = data.models(url)
    return m.id


def _fit_unit(url: str, method: str) -> str:
    """The fit unit of the (done) setting of ``method``: the stores also hold a failed fit (FAILING_METHOD)."""
    return next(s.fit_unit for s in data.settings(url, _model_id(url)) if s.method == method and s.status == "done")


# ---------------------------------------------------------------- empty and missing stores


@pytest.mark.parametrize("page", PAGES)
def test_empty_store(app, empty_db, page):
    at = _page(app(empty_db), page)
    assert "The store is empty" in _texts(at.info)
    assert not _charts(at)


def test_missing_store(app, tmp_path):
    url = f"sqlite:///{tmp_path / 'nothing-here.db'}"
    at = _page(app(url), PAGES[1])
    assert "no database file" in _texts(at.warning)
    assert not (tmp_path / "nothing-here.db").exists()     # read-only: never created


def test_engine_is_read_only(tiny_sweep):
    from sqlalchemy import text

    from db.engine import ReadOnlyDatabaseError

    with pytest.raises(ReadOnlyDatabaseError):
        with data._store(tiny_sweep.url).engine.begin() as conn:
            conn.execute(text("DELETE FROM models"))


# ---------------------------------------------------------------- overview


def _check_failures(at, failures) -> None:
    """The failed fit with its real error, and the units that depended on it, shown with their errors."""
    assert sorted(f.kind for f in failures) == ["eval", "eval", "fit", "latency"]
    fit = next(f for f in failures if f.kind == "fit")
    assert FAILING_ERROR in fit.error and "svd" in fit.what
    assert all("depends on failed" in f.error for f in failures if f is not fit)
    assert "Failures" in _texts(at.subheader)
    code = _texts(at.code)
    assert all(f.error.strip() in code for f in failures)
    assert any(FAILING_ERROR in e.label for e in at.expander)


def test_overview(app, tiny_sweep):
    url, out = tiny_sweep.url, tiny_sweep.outcome
    at = _page(app(url), PAGES[0])
    models, sweeps = at.dataframe[0].value, at.dataframe[1].value
    assert list(models["model"]) == ["smollm2-135m"]
    assert int(models["settings"][0]) == 3                      # dense, threshold, the failed fit
    assert len(sweeps) == 1 and list(sweeps["name"]) == ["tiny-test"]
    (row,) = data.sweeps(url)
    r = sweeps.iloc[0]
    assert (r["done"], r["failed"], r["total"]) == (row.done, row.failed, row.total) == (out.done, 4, out.total)
    assert r["status"] == row.info.status == "failed"
    assert r["done"] + r["failed"] + len(out.unplaceable) == r["total"]       # cuda units: pending
    _check_failures(at, row.failures)


@pytest.mark.slow
def test_overview_of_two_sweeps(app, sweep_dbs):
    at = _page(app(sweep_dbs.full), PAGES[0])
    models, sweeps = at.dataframe[0].value, at.dataframe[1].value
    assert list(models["model"]) == ["smollm2-135m"]
    assert int(models["settings"][0]) == 4                      # dense, oracle, threshold, the failed fit
    assert len(sweeps) == 2 and set(sweeps["name"]) == {"tiny-test"}
    rows = {s.info.id: s for s in data.sweeps(sweep_dbs.full)}
    for _, r in sweeps.iterrows():
        sw = rows[int(r["id"])]
        assert (r["done"], r["failed"], r["total"]) == (sw.done, sw.failed, sw.total)
        assert r["status"] == sw.info.status
    newest, first = sweeps.iloc[0], sweeps.iloc[1]
    assert first["done"] == first["total"] == 10 and first["failed"] == 0
    assert newest["status"] == "failed" and newest["failed"] == 4 and newest["done"] + 4 == newest["total"]
    _check_failures(at, rows[int(newest["id"])].failures)


@pytest.mark.slow
def test_overview_without_latency(app, sweep_dbs):
    at = _page(app(sweep_dbs.nolat), PAGES[0])
    sweeps = at.dataframe[1].value
    assert len(sweeps) == 1 and sweeps["done"][0] == sweeps["total"][0]
    assert "No failed units." in _texts(at.success)


# ---------------------------------------------------------------- pareto


def test_pareto_cpu(app, tiny_sweep):
    url = tiny_sweep.url
    at = _page(app(url), PAGES[1])
    mid = _model_id(url)
    at.selectbox(key="pareto_model").set_value(mid).run()
    assert at.selectbox(key="pareto_device").value == "cpu"    # the device type with rows comes first
    metric = at.selectbox(key="pareto_metric").value
    assert metric.endswith("/ppl")
    assert not at.exception and not at.warning
    (chart,) = _charts(at)
    spec = chart.proto.spec
    for field in ('"latency_ms"', '"accuracy"', '"realized_sparsity"', '"method"', "datum.dense"):
        assert field in spec
    front = _front_table(at)
    all_rows = _all_table(at)
    assert len(all_rows) == 2 and set(all_rows["method"]) == {"dense", "threshold"}      # failed fit: no rows
    assert 1 <= len(front) <= 2 and set(front["setting"]) <= set(all_rows["setting"])
    assert all_rows["latency_ms"].notna().all()
    expected = data.front(url, mid, metric, "cpu")
    assert set(front["fit_unit"]) == {r.setting.fit_unit for r in expected.front}
    # the thread count every point was timed at (the tiny sweep's torch_threads overrides every core) and the build
    # of the native kernels (this machine's), and the baselines timed on the dense setting: HF generate, and
    # llama.cpp where llama-cpp-python is installed
    isa = cpu_info()["isa"]
    assert f"timed at 1 thread, {isa} build;" in _texts(at.caption) and set(all_rows["threads"]) == {1}
    assert set(all_rows["isa"]) == {isa} and "pareto_isa" not in [sb.key for sb in at.selectbox]
    assert data.thread_counts(url, mid, "cpu") == [1]
    assert "pareto_threads" not in [sb.key for sb in at.selectbox]        # one count: nothing to pick
    sparse = all_rows[all_rows["method"] == "threshold"]
    assert re.fullmatch(r"\d+\.\d\d-\d+\.\d\dx", sparse["spread"].iloc[0])
    base = _baselines_table(at)
    llama = llama_cpp_missing() is None
    assert sorted(base["runtime"]) == sorted(["hf-generate"] + ["llama.cpp"] * llama)
    assert list(base["runtime"]) == [b.runtime for b in expected.baselines]
    if llama:
        row = base[base["runtime"] == "llama.cpp"].iloc[0]
        assert row["timed"] == "beside our dense decode" and re.fullmatch(r"\d+\.\d\d-\d+\.\d\dx", row["spread"])


def test_pareto_other_metric(app, tiny_sweep):
    at = _page(app(tiny_sweep.url), PAGES[1])
    metrics = at.selectbox(key="pareto_metric").options
    task = next(m for m in metrics if m.startswith("mc/") or "copa" in m)
    at.selectbox(key="pareto_metric").set_value(task).run()
    assert not at.exception
    assert len(_charts(at)) == 1 and len(_front_table(at)) >= 1


def test_pareto_device_without_rows(app, tiny_sweep):
    at = _page(app(tiny_sweep.url), PAGES[1])
    assert at.selectbox(key="pareto_device").options[0] == "cpu"
    at.selectbox(key="pareto_device").set_value("npu").run()
    assert not at.exception
    assert "no latency rows for device type 'npu'" in _texts(at.warning)
    assert "No setting is on a front" in _texts(at.info)
    assert len(_charts(at)) == 1                                 # accuracy-only bars
    assert _all_table(at)["latency_ms"].isna().all()


@pytest.mark.slow
def test_pareto_model_without_latency(app, sweep_dbs):
    at = _page(app(sweep_dbs.nolat), PAGES[1])
    assert "no latency rows" in _texts(at.warning)
    assert "No setting is on a front" in _texts(at.info)
    assert len(_all_table(at)) == 3


# ---------------------------------------------------------------- unit


def test_unit_page(app, tiny_sweep):
    url = tiny_sweep.url
    fit = _fit_unit(url, "threshold")
    at = _page(app(url), PAGES[2])
    at.selectbox(key="unit_setting").set_value(fit).run()
    assert not at.exception
    text = _texts(at.markdown) + _texts(at.caption)
    assert fit in text
    # recall, sparsity, threshold (threshold keeps one per layer), latency
    assert len(_charts(at)) == 4
    layer_df = next(d.value for d in at.dataframe if "recall" in d.value.columns)
    assert len(layer_df[layer_df["component"] == "mlp"]) == 30 and layer_df["threshold"].notna().any()
    # accuracy beside dense, each difference marked against the rows' own standard errors
    acc = next(d.value for d in at.dataframe if "beyond_noise" in d.value.columns).set_index("metric")
    assert acc.loc["mc/copa/acc", "beyond_noise"] in ("✱ yes", "no")            # both rows carry a stderr
    assert acc.loc["perplexity/lambada-heldout/ppl", "beyond_noise"] == "?"      # ppl rows carry none
    assert not any(m.endswith("_sparsity") for m in acc.index)
    rows = {r["metric"]: r for r in data.accuracy_vs_dense(url, _model_id(url), fit)}
    copa = rows["mc/copa/acc"]
    assert copa["stderr"] is not None and copa["dense_stderr"] is not None
    assert (acc.loc["mc/copa/acc", "beyond_noise"] == "✱ yes") == data.beyond_noise(
        copa["value"], copa["stderr"], copa["dense"], copa["dense_stderr"])
    lat = next(d.value for d in at.dataframe if "series" in d.value.columns)
    series = set(lat["series"])
    assert "dense · hf-generate" in series                                   # the Hugging Face baseline
    assert any(x.startswith("this setting · ") for x in series)
    assert any(x.startswith("dense · ") and x != "dense · hf-generate" for x in series)
    # one panel per device · accelerator · thread count · build: the tiny sweep's rows all at its torch_threads (1),
    # under this machine's build of the native kernels
    assert set(lat["device"]) == {f"cpu · {a} · 1 thread · {cpu_info()['isa']} build"
                                  for a in lat["device"].str.split(" · ").str[1]}
    assert set(lat["threads"]) == {1}
    paired = lat[lat["runtime"] == "ctxsparse-sparse"]
    assert len(paired) == 1 and re.fullmatch(r"\d+\.\d\d-\d+\.\d\dx", paired["speedup_spread"].iloc[0])
    assert (lat[lat["runtime"] == "hf-generate"]["speedup_spread"] == "").all()
    config = json.loads(at.json[0].value)                     # the unit config that produced the setting
    typed = unit_config("fit", config)
    assert config == data.unit(url, fit).config and typed.method == "threshold" and typed.sparsity == 0.5
    # and the spec of every sweep the setting belongs to
    specs = _sweep_specs(at)
    assert [sp["name"] for sp in specs] == [sw.name for sw in data.sweeps_of(url, fit)] == ["tiny-test"]
    assert {"threshold"} <= {m["name"] for m in specs[0]["methods"]}


def _sweep_specs(at) -> list[dict]:
    return [json.loads(j.value) for j in at.json[1:] if "methods" in json.loads(j.value)]


@pytest.mark.slow
def test_unit_page_lists_every_sweep_of_the_setting(app, sweep_dbs):
    """The full store holds two sweeps sharing the threshold setting: the unit page shows both specs."""
    url = sweep_dbs.full
    fit = _fit_unit(url, "threshold")
    at = _page(app(url), PAGES[2])
    at.selectbox(key="unit_setting").set_value(fit).run()
    assert not at.exception
    specs = _sweep_specs(at)
    assert len(specs) == 2 and all({"threshold"} <= {m["name"] for m in sp["methods"]} for sp in specs)
    assert sorted(sp["name"] for sp in specs) == sorted(sw.name for sw in data.sweeps_of(url, fit))


def test_unit_page_dense(app, tiny_sweep):
    url = tiny_sweep.url
    at = _page(app(url), PAGES[2])
    at.selectbox(key="unit_setting").set_value(_fit_unit(url, "dense")).run()
    assert not at.exception
    assert "the dense setting skips nothing" in _texts(at.info)
    assert "No latency rows" not in _texts(at.info)


@pytest.mark.slow
def test_unit_page_dense_without_latency(app, sweep_dbs):
    url = sweep_dbs.nolat
    at = _page(app(url), PAGES[2])
    at.selectbox(key="unit_setting").set_value(_fit_unit(url, "dense")).run()
    assert not at.exception
    assert "the dense setting skips nothing" in _texts(at.info)
    assert "No latency rows" in _texts(at.info)


def test_selection_follows_pages(app, tiny_sweep):
    url = tiny_sweep.url
    fit = _fit_unit(url, "threshold")
    at = _page(app(url), PAGES[2])
    at.selectbox(key="unit_setting").set_value(fit).run()
    at.switch_page(PAGES[3]).run()
    assert at.selectbox(key="bundle_setting").value == fit


# ---------------------------------------------------------------- bundle


def test_bundle_page(app, tiny_sweep):
    url = tiny_sweep.url
    fit = _fit_unit(url, "threshold")
    at = _page(app(url), PAGES[3])
    at.selectbox(key="bundle_setting").set_value(fit).run()
    assert not at.exception and not at.error
    assert len(at.get("download_button")) == 1
    files = at.dataframe[0].value
    assert sorted(files["file"]) == ["manifest.json", "predictors.safetensors"]
    manifest = json.loads(at.json[0].value)
    assert manifest == data.check_bundle(url, fit).manifest
    assert manifest["format"] == "ctxsparse-bundle" and manifest["method"] == "threshold"


def test_bundle_archive_matches_the_store(tiny_sweep):
    url = tiny_sweep.url
    fit = _fit_unit(url, "threshold")
    blob = data.bundle_archive(url, fit)
    rows = {Path(a.uri).name: a for a in data._bundle_files(url, fit)}
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        members = {Path(m.name).name: tar.extractfile(m).read() for m in tar.getmembers()}
        assert {Path(m.name).parent.name for m in tar.getmembers()} == {fit}
    assert set(members) == set(rows) == {"manifest.json", "predictors.safetensors"}
    for name, content in members.items():
        assert hashlib.sha256(content).hexdigest() == rows[name].sha256


def test_bundle_sha_mismatch(app, tiny_sweep):
    """A bundle file changed on disk after the sweep: an error, and no download."""
    url = tiny_sweep.url
    fit = _fit_unit(url, "threshold")
    target = next(Path(a.uri) for a in data._bundle_files(url, fit) if a.uri.endswith(".safetensors"))
    assert tiny_sweep.home in target.parents                     # the test run's own bundle
    original = target.read_bytes()
    try:
        target.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(data.BundleDownloadError, match="does not match"):
            data.bundle_archive(url, fit)
        at = _page(app(url), PAGES[3])
        at.selectbox(key="bundle_setting").set_value(fit).run()
        assert not at.exception
        assert "does not match" in _texts(at.error)
        assert not at.get("download_button")
    finally:
        target.write_bytes(original)
    assert data.bundle_archive(url, fit)


# ---------------------------------------------------------------- hand-built stores: builds, GPU rows, log axis

PROV = {"package_versions": {"x": "1"}, "git_rev": "r"}
PPL = "perplexity/lambada-heldout/ppl"
NARROW = "perplexity/wikitext/ppl"
CPU = "AMD EPYC 7B13"


def _hand_store(path: Path, settings: dict[str, tuple[float, float, float]], timings: dict[str, list[dict]]) -> str:
    """A SQLite store written through ``db.queries`` as a sweep writes it: per method (sparsity, lambada ppl, wikitext
    ppl) a done fit unit, its perplexity eval unit, and per device type of ``timings[method]`` one done latency unit
    with those rows (``isa``, ``ms``, and ``runtime`` / ``threads`` when not the defaults)."""
    from db import queries as q
    from db.engine import get_engine, session_scope, upgrade

    url = f"sqlite:///{path}"
    engine = get_engine(url)
    upgrade(engine)
    uid = lambda *k: hashlib.sha256("/".join(map(str, k)).encode()).hexdigest()[:16]     # noqa: E731
    with session_scope(engine) as s:
        mid = q.upsert_model(s, name="m", fingerprint="f" * 64, family="llama")
        sid, _ = q.get_or_create_sweep(s, name="hand", spec_hash="a" * 64, spec={"name": "hand"})
        for method, (sp, ppl, narrow) in settings.items():
            fit, ev = uid("fit", method), uid("eval", method)
            common = dict(model_id=mid, method=method, sparsity=sp, code_version="t")
            q.register_units(s, sid, [dict(id=fit, kind="fit", config=fit_config(method, sp), **common),
                                      dict(id=ev, kind="eval", config=eval_config(fit), **common)])
            q.finish_unit(s, fit)
            q.finish_unit(s, ev, accuracy_rows=[
                dict(suite="perplexity", task=task, metric="ppl", higher_is_better=False, value=v, n=100, **PROV)
                for task, v in (("lambada-heldout", ppl), ("wikitext", narrow))])
            by_device: dict[str, list[dict]] = {}
            for t in timings.get(method, []):
                by_device.setdefault(t.get("device", "cpu"), []).append(t)
            for dev, rows in by_device.items():
                lat = uid("lat", method, dev)
                q.register_units(s, sid, [dict(id=lat, kind="latency", device_type=dev,
                                               config=latency_config(fit, dev), **common)])
                q.finish_unit(s, lat, latency_rows=[dict(
                    device_type=dev, accelerator_name=CPU if dev == "cpu" else "NVIDIA H200", batch=1, prompt_len=8,
                    gen_len=4, p50_ms_per_token=t["ms"], p90_ms_per_token=t["ms"], tokens_per_s=1000 / t["ms"],
                    runtime=t.get("runtime", "ctxsparse-dense" if method == "dense" else "ctxsparse-sparse"),
                    threads=t.get("threads", 2), isa=t.get("isa"),
                    cpu_flags="avx2 f16c fma" if t.get("isa") else None, **PROV) for t in rows])
    engine.dispose()
    return url


@pytest.fixture
def hand_store(tmp_path) -> str:
    """dense, svd s=0.5 and a collapsed threshold s=0.9 (lambada ppl 20 / 22 / 260: +1,200 %; wikitext 30 / 31 /
    33), each timed on the CPU under the avx2 and the scalar build of the native kernels (one latency unit each:
    the build is not part of a unit) and on an H200, whose rows record the host's 16 threads as every row does."""
    return _hand_store(tmp_path / "hand.db",
                       {"dense": (0.0, 20.0, 30.0), "svd": (0.5, 22.0, 31.0), "threshold": (0.9, 260.0, 33.0)},
                       {m: [dict(isa="avx2", ms=a), dict(isa="scalar", ms=b), dict(device="cuda", threads=16, ms=g)]
                        for m, a, b, g in (("dense", 10.0, 30.0, 4.3), ("svd", 8.0, 29.0, 3.1),
                                           ("threshold", 6.0, 28.0, 2.9))})


def _y_scale_types(chart) -> set:
    """The scale type of every y encoding in a chart's Vega-Lite spec ("linear": none given)."""
    out = set()

    def walk(node):
        if isinstance(node, dict):
            y = node.get("encoding", {}).get("y")
            if isinstance(y, dict) and y.get("field") == "accuracy":
                out.add(y.get("scale", {}).get("type", "linear"))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(chart.proto.spec))
    return out


def test_pareto_perplexity_axis_goes_logarithmic_beyond_a_tenfold_span(app, hand_store):
    """lambada's 20 .. 260 (13x, the collapsed threshold setting): a log axis; wikitext's 30 .. 33: linear; on the
    accuracy-only bars (a device without rows) the same rule."""
    at = _page(app(hand_store), PAGES[1])
    assert at.selectbox(key="pareto_metric").value == PPL
    (chart,) = _charts(at)
    assert _y_scale_types(chart) == {"log"} and "(log scale)" in chart.proto.spec
    assert sorted(_all_table(at)["accuracy"]) == [20.0, 22.0, 260.0]
    at.selectbox(key="pareto_metric").set_value(NARROW).run()
    (chart,) = _charts(at)
    assert _y_scale_types(chart) == {"linear"} and "(log scale)" not in chart.proto.spec
    at.selectbox(key="pareto_metric").set_value(PPL).run()
    at.selectbox(key="pareto_device").set_value("npu").run()
    (bars,) = _charts(at)
    assert not at.exception and _y_scale_types(bars) == {"log"}
    assert data.log_axis(PPL, [20.0, 200.0]) is False and data.log_axis(PPL, [20.0, 200.1]) is True
    assert data.log_axis("mc/piqa/acc", [0.01, 0.9]) is False and data.log_axis(PPL, [20.0, float("inf")]) is False


def test_pareto_cpu_front_names_its_build_and_never_mixes_two(app, hand_store):
    """The caption says the build every point was timed under (the widest by default), names the one left out, and
    the CPU build picker draws the other's front from its own rows only."""
    at = _page(app(hand_store), PAGES[1])
    assert at.selectbox(key="pareto_device").value == "cuda"            # (the first device type with rows)
    at.selectbox(key="pareto_device").set_value("cpu").run()
    caption = _texts(at.caption)
    assert f"· {CPU} · batch 1 · prompt 8 tokens · timed at 2 threads, avx2 build;" in caption
    assert "Also timed under scalar build: not drawn here" in caption
    assert at.selectbox(key="pareto_isa").options == ["avx2 build", "scalar build"]
    table = _all_table(at).set_index("method")
    assert table["latency_ms"].to_dict() == {"dense": 10.0, "svd": 8.0, "threshold": 6.0}
    assert set(table["isa"]) == {"avx2"}
    at.selectbox(key="pareto_isa").set_value(1).run()
    assert not at.exception and "timed at 2 threads, scalar build;" in _texts(at.caption)
    assert "Also timed under avx2 build" in _texts(at.caption)
    table = _all_table(at).set_index("method")
    assert table["latency_ms"].to_dict() == {"dense": 30.0, "svd": 29.0, "threshold": 28.0}
    assert set(table["isa"]) == {"scalar"}


def test_pareto_gpu_caption_says_nothing_of_threads(app, hand_store):
    """The H200 rows record the host's 16 threads, but threads and CPU builds are CPU notions: the GPU page's
    caption names neither, and offers no build to pick."""
    at = _page(app(hand_store), PAGES[1])
    assert at.selectbox(key="pareto_device").value == "cuda"
    assert not at.exception and not at.warning
    caption = _texts(at.caption)
    assert "p50 ms per token on cuda · NVIDIA H200 · batch 1 · prompt 8 tokens; the front:" in caption
    assert "thread" not in caption and "build" not in caption
    assert "pareto_isa" not in [sb.key for sb in at.selectbox]
    assert _all_table(at).set_index("method")["latency_ms"].to_dict() == {"dense": 4.3, "svd": 3.1, "threshold": 2.9}


def test_unit_page_latency_panels_name_the_cpu_build(app, hand_store):
    """One panel per device · accelerator and, on the CPU, thread count · build; the GPU panel names neither."""
    at = _page(app(hand_store), PAGES[2])
    svd = next(s.fit_unit for s in data.settings(hand_store, _model_id(hand_store)) if s.method == "svd")
    at.selectbox(key="unit_setting").set_value(svd).run()
    assert not at.exception
    lat = next(d.value for d in at.dataframe if "series" in d.value.columns)
    assert set(lat["device"]) == {f"cpu · {CPU} · 2 threads · avx2 build", f"cpu · {CPU} · 2 threads · scalar build",
                                  "cuda · NVIDIA H200"}
    mine = lat[lat["series"] == "this setting · ctxsparse-sparse"].set_index("device")
    assert mine.loc[f"cpu · {CPU} · 2 threads · scalar build", "p50_ms_per_token"] == 29.0
    assert mine.loc[f"cpu · {CPU} · 2 threads · avx2 build", "cpu_flags"] == "avx2 f16c fma"
    assert mine.loc["cuda · NVIDIA H200", ["isa", "cpu_flags"]].isna().all()


def test_pareto_rows_recording_no_build_are_a_front_of_their_own(app, tmp_path):
    """A store upgraded from before the build was recorded, then timed again: its old rows (no build) can be picked
    as their own front, never mixed into the avx2 one."""
    url = _hand_store(tmp_path / "mixed.db", {"dense": (0.0, 20.0, 30.0), "svd": (0.5, 22.0, 31.0)},
                      {"dense": [dict(isa="avx2", ms=10.0), dict(isa=None, ms=12.0)],
                       "svd": [dict(isa="avx2", ms=8.0), dict(isa=None, ms=11.0)]})
    at = _page(app(url), PAGES[1])
    assert at.selectbox(key="pareto_isa").options == ["avx2 build", "build not recorded"]
    assert _all_table(at).set_index("method")["latency_ms"].to_dict() == {"dense": 10.0, "svd": 8.0}
    at.selectbox(key="pareto_isa").set_value(1).run()
    assert not at.exception and "timed at 2 threads, build not recorded;" in _texts(at.caption)
    assert _all_table(at).set_index("method")["latency_ms"].to_dict() == {"dense": 12.0, "svd": 11.0}
