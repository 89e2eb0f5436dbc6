"""The predicted output head (workers.methods.head): the screens' fit, the candidate choice, the masked form's
distribution and rows, the bundle round trip and the sweep's grid of head settings."""
from __future__ import annotations

import pytest
import torch

from tests.workers.sparsity.test_rsparse import _ctx, _tokens
from tests.workers.tiny_model_support import loaded, tiny_model
from workers.methods.head.fit import fit_head
from workers.methods.head.part import PredictedHead
from workers.methods.head.screen import (candidates, deployed_logits, fit_screen, head_quality, screen_scores)
from workers.sparsity.bundle import apply_bundle, load_bundle, save_bundle
from workers.sparsity.predictors import SparsityPlan, fit_method
from workers.sparsity.sparse_exec import apply_sparsity


def test_candidates_known_answer():
    # P picks the state's first two entries; S scores token v as v·z0 - v·z1 (a line through the vocabulary)
    p = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]])
    s = torch.stack([torch.arange(6.0), -torch.arange(6.0)], 1)
    h = torch.tensor([[2.0, 1.0, 9.0], [0.0, 3.0, -9.0]])        # scores 1·v and -3·v
    est = screen_scores(h, p, s)
    assert torch.equal(est, torch.stack([torch.arange(6.0), -3 * torch.arange(6.0)]))
    idx = candidates(est, 2)
    assert [sorted(r) for r in idx.tolist()] == [[4, 5], [0, 1]]
    exact = torch.tensor([[0.0, 0, 0, 7, 1, 2], [5.0, 4, 0, 0, 0, 0]])
    out = deployed_logits(est, exact.gather(-1, idx), idx)
    # row 0: the estimates 2 and 3 above the best candidate's 2 are kept just below it (its argmax stays a candidate)
    below = torch.nextafter(torch.tensor(2.0), torch.tensor(-1.0)).item()
    assert out.tolist() == [[0, 1, below, below, 1, 2], [5, 4, -6, -9, -12, -15]]
    assert out[0].argmax() == 5
    kept, mass = head_quality(exact, idx)
    assert kept.tolist() == [False, True]                           # row 0's argmax (3) is not a candidate
    sm = torch.softmax(exact.double(), -1)
    assert torch.allclose(mass, torch.stack([sm[0, 4] + sm[0, 5], sm[1, 0] + sm[1, 1]]))


@pytest.mark.parametrize("screen", ["hidden", "logits"])
def test_screen_is_exact_on_states_of_its_rank(screen):
    """States inside an r-dimensional subspace: a rank-r screen of either kind gives the exact logits."""
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(16, 3, generator=g))[0]          # [d, r]
    h = torch.randn(400, 3, generator=g) @ basis.t()
    w = torch.randn(50, 16, generator=g)
    p, s = fit_screen(h, w, 3, screen)
    assert p.shape == (3, 16) and s.shape == (50, 3)
    test = torch.randn(20, 3, generator=g) @ basis.t()
    torch.testing.assert_close(screen_scores(test, p, s), test @ w.t(), rtol=1e-4, atol=1e-4)
    # below the states' rank the screen is not exact
    p2, s2 = fit_screen(h, w, 2, screen)
    assert (screen_scores(test, p2, s2) - test @ w.t()).abs().max() > 1e-2


def test_logits_screen_beats_hidden_on_logit_error():
    """The logits screen minimizes the mean squared logit error over the states it was fitted on."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2000, 24, generator=g) * torch.linspace(3, 0.1, 24)
    w = torch.randn(300, 24, generator=g) * torch.linspace(0.1, 3, 24)     # the head weighs the small directions
    err = {sc: float((screen_scores(h, *fit_screen(h, w, 6, sc)) - h @ w.t()).pow(2).mean())
           for sc in ("hidden", "logits")}
    assert err["logits"] < 0.8 * err["hidden"], err


def test_bad_screens_are_refused():
    h, w = torch.randn(10, 8), torch.randn(20, 8)
    with pytest.raises(ValueError, match="screen must be one of"):
        fit_screen(h, w, 2, "kmeans")
    with pytest.raises(ValueError, match="rank must be in 1..8"):
        fit_screen(h, w, 9)
    p, s = fit_screen(h, w, 2)
    with pytest.raises(ValueError, match="head candidates must be an int in 1..20"):
        PredictedHead(p=p, s=s, candidates=21)
    assert PredictedHead(p=p, s=s, candidates="all").candidates == 20


def _head_ctx(model, tmp_path):
    from workers.sparsity.capture import capture_activations
    from workers.sparsity.predictors import FitContext

    lm = loaded(model, "tiny")
    cache = capture_activations(lm, _tokens(0), components=("final",), root=tmp_path / "acts", progress=False,
                                dtype="float32")
    return FitContext(lm, cache, list(range(lm.dims.n_layers)))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_masked_head_gives_exact_logits_on_the_candidates(family, tmp_path):
    model = tiny_model(family)
    ctx = _head_ctx(model, tmp_path)
    part, facts = fit_head(ctx, rank=4, candidates=16)
    assert facts["head_calib_tokens"] == 256
    ids = _tokens(5, 2, 20).windows
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        with apply_sparsity(model, SparsityPlan(parts=[part])) as applied:
            got = model(input_ids=ids).logits
            head = model.get_output_embeddings()
        h = model.base_model(input_ids=ids).last_hidden_state
    est = screen_scores(h, part.p, part.s)
    cap = getattr(model.config, "final_logit_softcapping", None)
    idx = candidates(est, 16)
    assert torch.equal(got.gather(-1, idx), dense.gather(-1, idx))
    others = torch.ones_like(got, dtype=torch.bool).scatter(-1, idx, False)
    a, b = part.tail
    assert (a, b) != (1.0, 0.0)                               # the tail was fitted
    with torch.no_grad():        # the head module's own logits (before any soft cap): the best candidate's bounds the rest
        best = (h @ model.get_output_embeddings().weight.t()).gather(-1, idx).max(-1, keepdim=True).values
    tail = torch.minimum(est * a + b, torch.nextafter(best, torch.full_like(best, -torch.inf)))
    want_est = tail if cap is None else torch.tanh(tail / cap) * cap
    assert bool((got.argmax(-1, keepdim=True) == idx).any(-1).all())       # the argmax is always a candidate
    torch.testing.assert_close(got[others], want_est[others].to(got.dtype), rtol=1e-5, atol=1e-5)
    rows = {r["metric"]: r["value"] for r in applied.stats.reporters[0]()}
    kept = (idx == dense.argmax(-1, keepdim=True)).any(-1).double().mean()
    assert rows["head_argmax_kept"] == pytest.approx(float(kept))
    assert rows["head_read"] == pytest.approx((part.p.numel() + part.s.numel() + 16 * 48) / (128 * 48))
    assert model.get_output_embeddings() is not head          # reverted
    with torch.no_grad(), apply_sparsity(model, SparsityPlan(parts=[part])) as quiet:   # a task's forwards: no counts
        quiet.stats.counting = False
        assert torch.equal(model(input_ids=ids).logits, got)
        assert model.get_output_embeddings().positions == 0
    # K = all is the dense head
    with torch.no_grad(), apply_sparsity(model, SparsityPlan(parts=[part.with_candidates("all")])):
        assert torch.equal(model(input_ids=ids).logits, dense)


def test_head_beside_a_decoder_part_and_bundle_round_trip(tmp_path):
    model = tiny_model("llama")
    ctx = _ctx(model, tmp_path)
    from workers.sparsity.capture import capture_activations

    ctx.cache = capture_activations(ctx.lm, _tokens(0), root=tmp_path / "acts2", progress=False, dtype="float32")
    plan = fit_method("larosa", ctx, 0.4)                   # a part that runs alone among decoder parts
    part, _ = fit_head(ctx, rank=8, candidates=24, screen="logits")
    plan.parts.append(part)
    path = save_bundle(plan, ctx.lm, tmp_path / "b", method="larosa", sparsity=0.4,
                       head={"rank": 8, "candidates": 24, "screen": "logits"})
    b = load_bundle(path)
    assert b.manifest["head"] == {"rank": 8, "candidates": 24, "screen": "logits"}
    back = b.plan(model).part("head")
    assert torch.equal(back.p, part.p) and torch.equal(back.s, part.s)
    assert (back.candidates, back.screen) == (24, "logits")
    ids = _tokens(9, 2, 20).windows
    with torch.no_grad():
        with apply_sparsity(model, plan):
            want = model(input_ids=ids).logits
        with apply_bundle(model, path):
            got = model(input_ids=ids).logits
    assert torch.equal(got, want)


def test_sweep_grid_crosses_head_settings():
    from orchestrator.plan import settings
    from orchestrator.spec import SpecError, parse_spec

    spec = parse_spec({"name": "h", "models": ["smollm2-135m"],
                       "methods": [{"name": "teal", "sparsity": [0.3, 0.4]}, {"name": "threshold", "sparsity": [0.3]}],
                       "head": {"rank": [64], "candidates": [1024, 2048], "combine": ["teal"]}})
    labels = [(st.method, st.sparsity, None if st.head is None else st.head.candidates) for st in settings(spec)]
    assert labels == [("dense", 0.0, None), ("teal", 0.3, None), ("teal", 0.4, None), ("threshold", 0.3, None),
                      ("dense", 0.0, 1024), ("teal", 0.3, 1024), ("teal", 0.4, 1024),
                      ("dense", 0.0, 2048), ("teal", 0.3, 2048), ("teal", 0.4, 2048)]
    assert [st.baseline for st in settings(spec)][:5] == [True, False, False, False, False]
    # a spec without a head keeps its hash form (the key is left out at its default)
    plain = parse_spec({"name": "h", "models": ["smollm2-135m"], "methods": [{"name": "teal", "sparsity": [0.3]}]})
    assert "head" not in plain.canonical()
    with pytest.raises(SpecError, match="head.combine"):
        parse_spec({"name": "h", "models": ["smollm2-135m"], "methods": [{"name": "teal", "sparsity": [0.3]}],
                    "head": {"rank": [64], "candidates": [1024], "combine": ["svd"]}})
    with pytest.raises(SpecError, match="unknown head screen"):
        parse_spec({"name": "h", "models": ["smollm2-135m"], "methods": [{"name": "teal", "sparsity": [0.3]}],
                    "head": {"rank": [64], "candidates": [1024], "screen": ["clusters"]}})


def test_tail_fit_recovers_a_known_affine_map():
    """Screen estimates that are an affine map of the exact logits: the fitted tail inverts it (KL 0)."""
    from workers.methods.head.screen import fit_tail

    g = torch.Generator().manual_seed(3)
    exact = torch.randn(64, 200, generator=g) * 2
    est = (exact - 3.0) / 2.0
    idx = candidates(est, 10)
    a, b = fit_tail(exact, est, idx, iters=50)
    assert a == pytest.approx(2.0, abs=1e-3) and b == pytest.approx(3.0, abs=1e-3)
