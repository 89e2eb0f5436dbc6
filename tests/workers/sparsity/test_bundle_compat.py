"""Bundles written before plan parts were registered whole (format 2, tests/data/bundles/README.md) load through
the old key layout and reproduce what the code that wrote them computed: the masked model's logits, the bytes
charged, the decode runtime's logits, greedy tokens and realized sparsity; saved again (format 3) they give the same
numbers. On the machine that wrote them the logits are equal bit for bit; a tolerance of a float32 rounding or two
leaves room for another CPU's kernels."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.workers.tiny_model_support import loaded, tiny_model
from workers.decode.runtime import DecodeRuntime
from workers.sparsity import bundle as B
from workers.sparsity.bundle import apply_bundle, load_bundle, save_bundle

DATA = Path(__file__).resolve().parents[2] / "data" / "bundles"
CASES = ("larosa-llama", "larosa-qwen2-scaled", "rsparse-llama")


def _expected(name: str) -> tuple[dict, dict]:
    path = DATA / f"{name}.expected.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return load_file(str(path)), meta


def _runtime(model, bundle, ids):
    """The decode runtime with the bundle's plan: logits of a 6-token prefill and 5 steps, its realized sparsity,
    and a fresh runtime's 6 greedy tokens."""
    rt = DecodeRuntime.from_hf(model).set_plan(bundle.plan(model))
    rt.setup(2, 24)
    with torch.no_grad():
        logits = torch.stack([rt.prefill(ids[:, :6])] + [rt.step(keep_logits=True) for _ in range(5)])
    tokens = DecodeRuntime.from_hf(model).set_plan(bundle.plan(model)).generate(ids[:, :6], 6)
    return logits, rt.realized_sparsity(), tokens


@pytest.mark.parametrize("name", CASES)
def test_a_bundle_written_before_parts_reproduces_its_numbers(name, tmp_path):
    want, meta = _expected(name)
    model = tiny_model(meta["family"])
    old = load_bundle(DATA / name)
    assert old.manifest["format_version"] == B.FORMAT_VERSION_LEGACY
    ids = want["ids"]
    with torch.no_grad(), apply_bundle(model, old) as applied:
        hf = model(input_ids=ids).logits
    torch.testing.assert_close(hf, want["hf_logits"], rtol=1e-5, atol=1e-6)
    assert applied.stats.extra_numel == int(meta["extra_numel"])
    assert applied.stats.weight_skipped() == pytest.approx(float(meta["weight_skipped"]), rel=1e-9)
    logits, realized, tokens = _runtime(model, old, ids)
    torch.testing.assert_close(logits, want["runtime_logits"], rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, want["tokens"])
    assert realized == pytest.approx(json.loads(meta["realized"]), rel=1e-9)

    m = old.manifest
    again = load_bundle(save_bundle(old.plan(model), loaded(model, "tiny"), tmp_path / name, method=m["method"],
                                    sparsity=m["sparsity"], options=m["options"]))
    assert again.manifest["format_version"] == B.FORMAT_VERSION_PARTS
    assert set(again.manifest["plan"]["parts"]) == {m["method"]} and "rotated" not in again.manifest["plan"]
    assert {k.split(".")[0] for k in again.tensors} == {m["method"]}
    with torch.no_grad(), apply_bundle(model, again) as applied_again:
        assert torch.equal(model(input_ids=ids).logits, hf)
    assert applied_again.stats.extra_numel == applied.stats.extra_numel
    again_logits, again_realized, again_tokens = _runtime(model, again, ids)
    assert torch.equal(again_logits, logits) and torch.equal(again_tokens, tokens) and again_realized == realized


def test_a_legacy_rotation_shared_by_both_block_inputs_stays_one_tensor():
    """Format 2 named one stored rotation for both block inputs of a layer: read back, they are one object (the
    adapters charged depend on it)."""
    model = tiny_model("llama")
    part = load_bundle(DATA / "larosa-llama").plan(model).part("larosa")
    assert all(per["attn_in"] is per["ffn_in"] for per in part.rotations.values())


def test_a_part_this_code_does_not_know_is_refused(tmp_path):
    """A format-3 bundle naming a part kind no method here registers fails to load (older code would not run it
    silently either: it reads formats 1 and 2 only)."""
    from tests.workers.sparsity.test_bundle_parts import _rewrite

    model = tiny_model("llama")
    path = save_bundle(load_bundle(DATA / "rsparse-llama").plan(model), loaded(model, "tiny"), tmp_path / "b",
                       method="rsparse", sparsity=0.5)
    _rewrite(path, lambda m: m["plan"]["parts"].__setitem__("nope", {}))
    with pytest.raises(B.BundleError, match="plan part 'nope' is not known here"):
        load_bundle(path)
