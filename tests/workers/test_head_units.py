"""A predicted head through the sweep's units on SmolLM2 (workers.units.Units, no Ray): the fit unit captures the
final states and fits the screen, the perplexity unit's rows carry the head's own measurements, and the CPU
latency unit decodes with the head beside our dense."""
from __future__ import annotations

import uuid

import pytest
import torch

from db.schemas import LatencyRow
from workers.names import RUNTIME_DENSE_PAIRED, RUNTIME_SPARSE
from workers.sparsity.bundle import load_bundle
from workers.units import Units, bundle_dir

DATA = {"source": "lambada", "calib_tokens": 256, "metric_tokens": 256, "seq_len": 256}
HEAD = {"rank": 32, "candidates": 2048, "screen": "hidden"}


@pytest.fixture
def threads_restored():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_head_alone_is_fitted_scored_and_timed_by_the_units(smollm2, threads_restored):
    units = Units()
    units._lms[smollm2.ref] = smollm2
    base = {"model": smollm2.ref, "model_fp": smollm2.fingerprint, "threads": 1}
    fit_id = uuid.uuid4().hex
    out = units.run("fit", fit_id, {**base, "data": DATA, "calib_fp": "c", "capture": ["final"], "method": "dense",
                                    "sparsity": 0.0, "head": HEAD})
    assert out.summary["head_calib_tokens"] == DATA["calib_tokens"] and out.layers == []
    b = load_bundle(bundle_dir(fit_id))
    assert b.manifest["head"] == HEAD and set(b.tensors) == {"head.p", "head.s"}
    ev = units.run("eval", uuid.uuid4().hex, {**base, "data": DATA, "calib_fp": "c", "capture": ["final"],
                                              "fit_unit": fit_id, "suite": "perplexity", "exec_mode": "masked",
                                              "perplexity": {"tokens": 256, "seq_len": 256}})
    rows = {r["metric"]: r["value"] for r in ev.accuracy}
    assert {"head_argmax_kept", "head_mass", "head_read", "all_weight_skipped"} <= set(rows)
    assert 0.9 < rows["head_argmax_kept"] <= 1 and 0.8 < rows["head_mass"] <= 1
    v, d = 49152, 576
    assert rows["head_read"] == pytest.approx((32 * d + v * 32 + 2048 * d) / (v * d))
    assert rows["weight_skipped"] == 0 and rows["all_weight_skipped"] > 0.15        # the head is 30 % of it
    lat = units.run("latency", uuid.uuid4().hex, {**base, "fit_unit": fit_id, "device_type": "cpu", "batch": 1,
                                                  "prompt_len": 8, "gen_len": 4, "repeats": 1, "runtime": "ctxsparse",
                                                  "paired": True, "weights": "float"})
    sparse, dense = lat.latency
    assert (sparse["runtime"], dense["runtime"]) == (RUNTIME_SPARSE, RUNTIME_DENSE_PAIRED)
    assert sparse["p50_ms_per_token"] > 0 and LatencyRow(**sparse, package_versions={}, git_rev="r").threads == 1
