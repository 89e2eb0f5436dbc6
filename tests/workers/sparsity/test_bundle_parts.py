"""Bundles with rotations (LaRoSA) and low-rank factors (R-Sparse): tensors in the safetensors file, the rest in
the manifest; ``apply_bundle`` on a fresh model gives the sweep's numbers."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.workers.sparsity.test_rsparse import _ctx, _tokens
from tests.workers.tiny_model_support import loaded, tiny_model
from workers.paths import sha256_file
from workers.sparsity import bundle as B
from workers.sparsity.bundle import BundleError, apply_bundle, load_bundle, save_bundle
from workers.sparsity.predictors import FitContext, SparsityPlan, fit_method
from workers.sparsity.sparse_exec import apply_sparsity


def _same_sparse_model(model, plan, path):
    """The bundle on ``model`` computes what the fitted plan does, and charges the same bytes."""
    ids = _tokens(9, 2, 20).windows
    with torch.no_grad():
        with apply_sparsity(model, plan) as want_applied:
            want = model(input_ids=ids).logits
        with apply_bundle(model, path, mode="kernel") as applied:      # these parts run masked whatever the mode
            got = model(input_ids=ids).logits
    assert torch.equal(got, want)
    assert applied.stats.extra_numel == want_applied.stats.extra_numel
    assert applied.stats.weight_skipped() == want_applied.stats.weight_skipped()
    return applied


@pytest.mark.parametrize("rotation,n_tensors,extra", [
    ("layer", 4, 1),   # per layer one basis for both block inputs (stored once) and o's; one adapter between layers
    ("model", 3, 0),   # one basis for every layer, stored once, and o's per layer; no adapter
])
def test_rotated_bundle_round_trips_with_shared_rotations_kept_shared(tmp_path, rotation, n_tensors, extra):
    model = tiny_model("llama")
    plan = fit_method("larosa", _ctx(model, tmp_path), 0.4, rotation=rotation)
    path = save_bundle(plan, loaded(model, "tiny"), tmp_path / "b", method="larosa", sparsity=0.4,
                       options={"rotation": rotation})
    b = load_bundle(path)
    assert b.manifest["format_version"] == B.FORMAT_VERSION_PARTS
    assert len(b.tensors) == n_tensors and all(k.startswith("larosa.") for k in b.tensors)
    back = b.plan(model).part("larosa")
    assert back.rotations[0]["attn_in"] is back.rotations[0]["ffn_in"]
    assert back.sparsity == plan.part("larosa").sparsity and back.score == plan.part("larosa").score
    applied = _same_sparse_model(model, plan, path)
    assert applied.stats.extra_numel == extra * 48 * 48


def test_rank_sparse_bundle_round_trips(tmp_path):
    model = tiny_model("llama")
    plan = fit_method("rsparse", _ctx(model, tmp_path), 0.5, rho=0.8)
    path = save_bundle(plan, loaded(model, "tiny"), tmp_path / "b", method="rsparse", sparsity=0.5,
                       options={"rho": 0.8})
    b = load_bundle(path)
    assert b.manifest["format_version"] == B.FORMAT_VERSION_PARTS
    assert set(b.manifest["plan"]["parts"]["rsparse"]["1"]) == {"q", "k", "v", "o", "gate", "up", "down"}
    assert b.tensors["rsparse.1.down.a"].shape == (3, 80) and b.tensors["rsparse.1.down.b"].shape == (48, 3)
    back = b.plan(model).part("rsparse")
    assert back.parts[0]["q"].threshold == plan.part("rsparse").parts[0]["q"].threshold
    applied = _same_sparse_model(model, plan, path)
    assert applied.stats.extra_numel > 0
    plain = save_bundle(SparsityPlan(inputs={0: {"q": 0.1}}), loaded(model, "tiny"), tmp_path / "p", method="teal",
                        sparsity=0.1)
    assert load_bundle(plain).manifest["format_version"] == B.FORMAT_VERSION      # other bundles: as before


def _rewrite(path, edit_manifest=None, edit_tensors=None):
    """Edit a bundle the way a bug or a hand could, keeping every digest consistent (so the parts' own checks
    are what refuses it)."""
    m = json.loads((path / B.MANIFEST).read_text())
    t = load_file(str(path / B.TENSORS))
    if edit_tensors:
        edit_tensors(t)
        save_file(t, str(path / B.TENSORS))
    if edit_manifest:
        edit_manifest(m)
    m["files"] = {B.TENSORS: {"sha256": sha256_file(path / B.TENSORS), "size": (path / B.TENSORS).stat().st_size}}
    m["manifest_sha256"] = B._manifest_digest(m)
    (path / B.MANIFEST).write_text(json.dumps(m))


def test_inconsistent_parts_are_refused(tmp_path):
    model = tiny_model("llama")
    ctx = _ctx(model, tmp_path)
    lm = loaded(model, "tiny")
    rs = fit_method("rsparse", ctx, 0.5, rho=0.8)
    la = fit_method("larosa", ctx, 0.4)
    cases = [
        ("rsparse", rs, lambda m: m["plan"]["parts"]["rsparse"]["0"]["q"].__setitem__("rank", 5), None,
         "bad rank-sparse plan.*rank 2, manifest says 5"),
        ("rsparse", rs, lambda m: m["plan"]["parts"]["rsparse"]["0"]["q"].__setitem__("score", "norm"), None,
         "bad rank-sparse plan"),
        ("rsparse", rs, None, lambda t: t.__setitem__("rsparse.0.zz.a", torch.zeros(1, 48)), "unexpected tensor"),
        ("rsparse", rs, lambda m: m["plan"]["parts"]["rsparse"].__setitem__("7", m["plan"]["parts"]["rsparse"]["0"]),
         lambda t: t.update({k.replace(".0.", ".7."): v.clone() for k, v in list(t.items())
                             if k.startswith("rsparse.0.")}),
         "rank-sparse part for layer 7, model has 2"),
        ("larosa", la, None, lambda t: t.__setitem__("larosa.5.o", torch.zeros(1)), "unexpected tensor"),
        ("larosa", la, None, lambda t: t.pop("larosa.1.o"), "no tensor 'larosa.1.o'"),
    ]
    for i, (method, plan, edit_m, edit_t, match) in enumerate(cases):
        path = save_bundle(plan, lm, tmp_path / f"b{i}", method=method, sparsity=0.5)
        _rewrite(path, edit_m, edit_t)
        with pytest.raises(BundleError, match=match):
            load_bundle(path).plan(model)


# ---------------------------------------------------------------- a real model, a fresh copy of it
@pytest.fixture(scope="module")
def fresh_smollm2():
    """A second SmolLM2, loaded apart from the session's: it never saw a fit."""
    from workers.loading.models import load_model

    return load_model("smollm2-135m")


# R-Sparse's bundles are also decoded by the default suite (tests/workers/decode/test_generate.py, test_qwen2_gguf.py)
@pytest.mark.parametrize("method,options", [pytest.param("rsparse", {}, marks=pytest.mark.slow),
                                            ("larosa", {"rotation": "layer"})])
def test_bundle_reproduces_the_sweeps_perplexity_on_a_fresh_model(smollm2, smollm2_calib_cache, fresh_smollm2,
                                                                     tmp_path, method, options):
    """A fit (three layers of SmolLM2 from 2,048 calibration tokens; R-Sparse's recipe from 512 more), its
    perplexity on 255 held-out tokens as a sweep's evaluation measures it, then the saved bundle on a fresh model:
    the same perplexity and the same bytes."""
    from workers.evals.perplexity import perplexity
    from workers.loading.data import token_windows
    from workers.sparsity.fit import fit_setting

    ctx = FitContext(smollm2, smollm2_calib_cache, list(smollm2_calib_cache.layers))
    s = 0.4
    fitted = fit_setting(ctx, method, s, options=options)
    held = token_windows(smollm2.tokenizer, "lambada", "heldout", 256, 256)
    dense = perplexity(smollm2.model, held).ppl
    with apply_sparsity(smollm2.model, fitted.plan) as applied:
        sweep = perplexity(smollm2.model, held)
    path = save_bundle(fitted.plan, smollm2, tmp_path / method, method=method, sparsity=s, options=options,
                       per_layer_sparsity=fitted.per_layer)
    assert fresh_smollm2.model is not smollm2.model
    with apply_bundle(fresh_smollm2.model, path) as again:
        got = perplexity(fresh_smollm2.model, held)
    assert got.ppl == pytest.approx(sweep.ppl, rel=1e-6) and got.n_tokens == sweep.n_tokens == 255
    assert again.stats.weight_skipped() == pytest.approx(applied.stats.weight_skipped(), rel=1e-9)
    assert sweep.ppl != dense and abs(sweep.ppl / dense - 1) < 0.1    # three of 30 layers at 40 %: a small change
    assert applied.stats.input_sparsity() == pytest.approx(s, abs=0.08)
    assert 0.02 < applied.stats.weight_skipped() < 0.045      # ~0.4 of 3/30 of the decoder, less what is charged
