"""Bundles: round trip onto a model, and every way a bundle can be wrong is refused with a clear error."""
from __future__ import annotations

import io
import json
import tarfile
from types import SimpleNamespace

import pytest
import torch

from tests.workers.tiny_model_support import tiny_model
from workers.loading.adapters import adapter_for
from workers.sparsity.bundle import (BundleError, apply_bundle, extract_bundle, load_bundle, pack_bundle, save_bundle)
from workers.loading.models import fingerprint
from workers.sparsity.predictors.base import SparsityPlan
from workers.methods.dejavu.predictor import DejaVuHeadPredictor, DejaVuMLPPredictor
from workers.methods.oracle.predictor import OracleMLP
from workers.methods.static.predictor import StaticMLP
from workers.methods.svd.predictor import SVDPredictor
from workers.sparsity.sparse_exec import apply_sparsity


def _lm(model):
    ad = adapter_for(model)
    return SimpleNamespace(ref="tiny-llama", fingerprint=fingerprint(model), family=ad.family,
                           dims=ad.dims(model.config))


def _plan(model):
    """One predictor of each stored kind (tensors, weights-only, low-rank with heads)."""
    ad = adapter_for(model)
    dims = ad.dims(model.config)
    g = torch.Generator().manual_seed(0)
    w0 = {k: v.float() for k, v in ad.ffn_weights(ad.decoder_layers(model)[0]).items()}
    r = 8
    svd = SVDPredictor(torch.randn(r, dims.d, generator=g), torch.randn(dims.D, r, generator=g),
                       torch.randn(dims.D, generator=g))
    dv = DejaVuMLPPredictor(dims.d, 8, dims.D, k=dims.D // 2)
    dv.reset_random(g)
    heads = DejaVuHeadPredictor(dims.d, 8, dims.n_heads, k=2, input_kind="residual")
    heads.reset_random(g)
    plan = SparsityPlan(mlp={0: OracleMLP(w0, ad.act_name(model.config), dims.D // 2), 1: svd},
                        attn={1: heads}, info={0: {"target_sparsity": 0.5}, 1: {"target_sparsity": 0.4}})
    return plan, {"static": StaticMLP(torch.rand(dims.D, generator=g), dims.D // 3), "dejavu": dv}


@pytest.fixture()
def bundle(tmp_path):
    model = tiny_model("llama")
    plan, _ = _plan(model)
    path = save_bundle(plan, _lm(model), tmp_path / "b", method="mixed", sparsity=0.5, rank=8,
                       per_layer_sparsity={0: 0.5, 1: 0.4}, unit_id="ab" * 20, versions={"torch": torch.__version__})
    return model, plan, path


def test_bundle_round_trip_gives_the_same_sparse_model(bundle):
    model, plan, path = bundle
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), apply_sparsity(model, plan):
        want = model(ids).logits
    with torch.no_grad():
        dense = model(ids).logits
        with apply_bundle(model, path) as applied:
            got = model(ids).logits
            assert applied.stats.mlp_sparsity() > 0.2
        again = model(ids).logits
    assert torch.equal(got, want) and not torch.allclose(got, dense)
    assert torch.equal(again, dense)                       # revert restores the dense model
    m = load_bundle(path).manifest
    assert m["per_layer_sparsity"] == {"0": 0.5, "1": 0.4} and m["unit_id"] == "ab" * 20
    assert set(m["plan"]["mlp"]) == {"0", "1"} and set(m["plan"]["attn"]) == {"1"}


def test_every_stored_predictor_kind_round_trips(tmp_path):
    model = tiny_model("llama")
    _, extra = _plan(model)
    for name, pred in extra.items():
        plan = SparsityPlan(mlp={0: pred})
        path = save_bundle(plan, _lm(model), tmp_path / name, method=name, sparsity=0.5)
        back = load_bundle(path).plan(model)
        x = torch.randn(5, model.config.hidden_size)
        assert torch.equal(back.mlp[0].mask(x), pred.mask(x))


def test_sequential_damage_filter_round_trips(tmp_path):
    """The sequential pipeline's filter (threshold and what it reads) travels in the manifest: the bundle's sparse
    model is the fitted one, and differs from the same predictors without the filter."""
    model = tiny_model("llama")
    plan, _ = _plan(model)
    plan.attn.clear()
    plan.mlp_mode, plan.seq_filter_on, plan.seq_filter = "sequential", "damage", {0: 0.002, 1: 0.002}
    path = save_bundle(plan, _lm(model), tmp_path / "seq", method="svd", sparsity=0.5)
    back = load_bundle(path).plan(model)
    assert (back.mlp_mode, back.seq_filter_on, back.seq_filter) == ("sequential", "damage", {0: 0.002, 1: 0.002})
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with apply_sparsity(model, plan):
            want = model(ids).logits
        with apply_bundle(model, path):
            got = model(ids).logits
        plan.mlp_mode = "parallel"
        with apply_sparsity(model, plan):
            unfiltered = model(ids).logits
    assert torch.equal(got, want) and not torch.allclose(got, unfiltered)


def _tensors_of(pred) -> list[torch.Tensor]:
    """Every tensor a predictor computes with: parameters, buffers and plain tensor attributes (the oracle's
    references to the layer's weights)."""
    return [*pred.parameters(), *pred.buffers(), *(v for v in vars(pred).values() if isinstance(v, torch.Tensor))]


def test_the_plan_lands_on_the_asked_device_for_every_predictor_kind(bundle, tmp_path):
    """A GPU actor rebuilds bundles for its model's device, and the fit's quality pass for the CPU: every tensor of
    every predictor must be where it was asked (``meta`` stands in for another device here)."""
    model, _, path = bundle
    _, extra = _plan(model)
    paths = [path] + [save_bundle(SparsityPlan(mlp={0: p}), _lm(model), tmp_path / n, method=n, sparsity=0.5)
                      for n, p in extra.items()]
    kinds = set()
    for p in paths:
        plan = load_bundle(p).plan(model, device="meta")
        for pred in [*plan.mlp.values(), *plan.attn.values()]:
            kinds.add(type(pred).__name__)
            ts = _tensors_of(pred)
            assert ts and all(t.device.type == "meta" for t in ts), type(pred).__name__
        for pred in load_bundle(p).plan(model).mlp.values():       # default: the model's device
            assert all(t.device.type == "cpu" for t in _tensors_of(pred))
    assert kinds == {"OracleMLP", "SVDPredictor", "DejaVuHeadPredictor", "StaticMLP", "DejaVuMLPPredictor"}


def test_bundle_for_another_model_is_refused(bundle):
    _, _, path = bundle
    other = tiny_model("llama", seed=1)
    with pytest.raises(BundleError, match="fitted on model tiny-llama"):
        apply_bundle(other, path)


def test_tampered_manifest_is_refused(bundle):
    _, _, path = bundle
    m = json.loads((path / "manifest.json").read_text())
    m["sparsity"] = 0.1
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="manifest_sha256 does not match"):
        load_bundle(path)


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing"])
def test_damaged_tensor_file_is_refused(bundle, damage):
    _, _, path = bundle
    f = path / "predictors.safetensors"
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
        match = "truncated or replaced"
    elif damage == "flip":
        f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        match = "sha256 mismatch"
    else:
        f.unlink()
        match = "missing predictors.safetensors"
    with pytest.raises(BundleError, match=match):
        load_bundle(path)


def test_pack_and_extract_round_trip(bundle, tmp_path):
    _, _, path = bundle
    arc = pack_bundle(path, tmp_path / "b.tar.gz")
    b = extract_bundle(arc, tmp_path / "out")
    assert b.manifest == load_bundle(path).manifest
    with pytest.raises(BundleError, match="already exists"):
        extract_bundle(arc, tmp_path / "out")


def _tar(tmp_path, members):
    arc = tmp_path / "evil.tar.gz"
    with tarfile.open(arc, "w:gz") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return arc


@pytest.mark.parametrize("members, match", [
    ([("../manifest.json", b"{}", "file")], "unexpected member"),
    ([("/tmp/manifest.json", b"{}", "file")], "unexpected member"),
    ([("b/predictors.safetensors", b"", "link")], "unexpected member"),
    ([("b/evil.py", b"import os", "file")], "unexpected member"),
    ([("a/b/manifest.json", b"{}", "file")], "unexpected member"),
    ([("b/manifest.json", b"{}", "file")], "missing"),
])
def test_archives_cannot_escape_or_smuggle(tmp_path, members, match):
    arc = _tar(tmp_path, members)
    with pytest.raises(BundleError, match=match):
        extract_bundle(arc, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path.parent / "manifest.json").exists()


def test_not_an_archive_is_a_clear_error(tmp_path):
    f = tmp_path / "x.tar.gz"
    f.write_bytes(b"not a tar")
    with pytest.raises(BundleError, match="not a readable bundle archive"):
        extract_bundle(f, tmp_path / "out")
