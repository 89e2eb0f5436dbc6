"""sparse_exec's two execution modes: "masked" (dense products, unselected entries zeroed; the CPU evaluation
path) and "kernel" (token-sparse kernels) make the same selection and give the same perplexity."""
import pytest
import torch

from tests.workers.tiny_model_support import tiny_model
from workers.decode.latency import random_plan
from workers.evals.perplexity import perplexity
from workers.loading.data import TokenSet
from workers.sparsity.sparse_exec import apply_sparsity


def _tokens(n_windows=3, seq_len=20, seed=0):
    ids = torch.randint(0, 128, (n_windows, seq_len), generator=torch.Generator().manual_seed(seed))
    return TokenSet(windows=ids, source="random", split="heldout", n_tokens=ids.numel(), prefix_len=0,
                    fingerprint="test")


def _run(model, plan, mode, toks):
    with torch.no_grad(), apply_sparsity(model, plan, mode=mode) as applied:
        logits = model(input_ids=toks.windows).logits
        ppl = perplexity(model, toks)
        st = applied.stats
        counts = {l: (v.tokens, v.first_pairs, v.kept_pairs, v.heads_kept) for l, v in st.layers.items()}
        return applied.mode, logits, ppl, counts, (st.mlp_sparsity(), st.head_sparsity())


@pytest.mark.parametrize("family, sequential", [(f, s) for f in ("llama", "qwen2", "gemma3", "opt")
                                                for s in (None, "gate", "damage") if not (f == "opt" and s == "damage")])
def test_masked_equals_kernel(family, sequential):
    model = tiny_model(family)
    plan = random_plan(model, 0.5, 0.5, rank=8, input_kind="residual", seed=1)
    if sequential:             # the sequential pipeline: a filter after the predictor's set
        plan.mlp_mode, plan.seq_filter_on = "sequential", sequential
        plan.seq_filter = {l: 0.05 if sequential == "gate" else 0.002 for l in plan.mlp}
    toks = _tokens()
    mk, lk, pk, ck, sk = _run(model, plan, "kernel", toks)
    mm, lm, pm, cm, sm = _run(model, plan, "masked", toks)
    assert (mk, mm) == ("kernel", "masked")
    assert ck == cm and sk == sm                       # same selection, pair for pair
    assert sk[1] == 0.5 and (0.5 < sk[0] < 1 if sequential else sk[0] == 0.5)   # top-k: half; a filter drops more
    if sequential:                                     # the filter dropped pairs of the predicted set
        assert all(0 < kept < first for _, first, kept, _ in ck.values())
    torch.testing.assert_close(lm, lk, atol=1e-5, rtol=1e-4)
    assert pm.ppl == pytest.approx(pk.ppl, rel=1e-5) and pm.n_tokens == pk.n_tokens
    with torch.no_grad():                              # and the sparse model is not the dense one
        dense = model(input_ids=toks.windows).logits
    assert (dense - lm).abs().max() > 1e-3


def test_auto_mode_is_masked_and_bad_mode_refused():
    model = tiny_model("llama")
    plan = random_plan(model, 0.5, None, rank=8, seed=2)
    with apply_sparsity(model, plan) as applied:
        assert applied.mode == "masked"
    with pytest.raises(ValueError):
        apply_sparsity(model, plan, mode="fast")
    assert all("Sparse" not in type(m).__name__ for m in model.modules())


def test_masked_counts_stay_on_the_device_until_read():
    """The masked path adds each forward's pair counts as tensors (no host sync per layer); the first read turns
    them into the same integers the kernel path counts."""
    model = tiny_model("llama")
    plan = random_plan(model, 0.5, 0.5, rank=8, input_kind="residual", seed=3)
    toks = _tokens(n_windows=2, seq_len=16)
    with torch.no_grad(), apply_sparsity(model, plan, mode="masked") as applied:
        model(input_ids=toks.windows)
        model(input_ids=toks.windows)
        ls = next(iter(applied.stats.layers.values()))
        assert isinstance(ls._kept, torch.Tensor) and isinstance(ls._heads, torch.Tensor)
        masked = (ls.tokens, ls.first_pairs, ls.kept_pairs, ls.head_tokens, ls.heads_kept)
        assert all(type(v) is int for v in masked) and ls.tokens == 2 * toks.n_tokens
    with torch.no_grad(), apply_sparsity(model, plan, mode="kernel") as applied:
        model(input_ids=toks.windows)
        model(input_ids=toks.windows)
        ls = next(iter(applied.stats.layers.values()))
        assert (ls.tokens, ls.first_pairs, ls.kept_pairs, ls.head_tokens, ls.heads_kept) == masked


def test_damage_filter_refused_on_a_non_gated_ffn():
    model = tiny_model("opt")
    plan = random_plan(model, 0.5, None, rank=8, seed=1)
    plan.mlp_mode, plan.seq_filter_on, plan.seq_filter = "sequential", "damage", {l: 0.01 for l in plan.mlp}
    with pytest.raises(ValueError, match="gated"):
        apply_sparsity(model, plan)
    assert all("Sparse" not in type(m).__name__ for m in model.modules())


def test_weights_skipped_counts_up_on_the_superset_with_the_damage_filter():
    """Hand-built counts: 70 % of the pairs computed in gate (and, with the damage filter, in up), 50 % in down,
    on layer 0 of two; the fraction of decoder weights skipped follows from the projections' sizes."""
    from workers.sparsity.input_sparse import InputStats
    from workers.sparsity.sparse_exec import LayerStats, SparseStats

    D, d = 10, 4
    numel = {(l, p): n for l in (0, 1) for p, n in (("q", d * d), ("k", d * d), ("v", d * d), ("o", d * d),
                                                    ("gate", D * d), ("up", D * d), ("down", D * d))}
    total = sum(numel.values())
    for up_on_first, want in ((False, 0.3 * D * d + 0.5 * 2 * D * d), (True, 0.3 * 2 * D * d + 0.5 * D * d)):
        st = SparseStats(D, 2, False, inputs=InputStats(numel), up_on_first=up_on_first)
        st.layers[0] = LayerStats()
        st.layers[0].add_ffn(100, 700, 500)
        assert st.weight_skipped() == pytest.approx(want / total, rel=1e-12)


@pytest.mark.parametrize("mode", ["masked", "kernel"])
def test_counting_off_gives_the_same_logits_and_counts_nothing(mode):
    """``stats.counting = False`` (an evaluation's task units): every part (FFN, heads, input-sparse
    projections) computes the same logits as with counting on, and no count is taken; switched back on, the
    counts are the ones a counted forward takes."""
    model = tiny_model("llama")
    plan = random_plan(model, 0.5, 0.5, rank=8, input_kind="residual", seed=4)
    plan.inputs = {l: {"q": 0.3, "k": 0.3, "v": 0.3} for l in plan.mlp}
    toks = _tokens(n_windows=2, seq_len=16)
    with torch.no_grad(), apply_sparsity(model, plan, mode=mode) as applied:
        counted = model(input_ids=toks.windows).logits
        ref = (applied.stats.mlp_sparsity(), applied.stats.head_sparsity(), applied.stats.input_sparsity())
        assert 0 < ref[2] < 1 and ref[0] > 0 and ref[1] > 0
        applied.stats.reset()
        applied.stats.counting = False
        assert applied.stats.inputs.counting is False
        quiet = model(input_ids=toks.windows).logits
        assert applied.stats.layers == {} and applied.stats.inputs.seen == {}
        applied.stats.counting = True
        model(input_ids=toks.windows)
        again = (applied.stats.mlp_sparsity(), applied.stats.head_sparsity(), applied.stats.input_sparsity())
    torch.testing.assert_close(quiet, counted, rtol=0, atol=0)
    assert again == ref


@pytest.mark.parametrize("family", ["llama", "gemma3", "opt"])
def test_oracle_and_threshold_select_from_the_ffns_own_activations(family, monkeypatch):
    """In masked mode the oracle's and the threshold's sets come from the activations the FFN computes anyway
    (``reads_ffn``): the same logits, bit for bit, as when the predictor computes its scores from the FFN input
    again, and the kernel mode's to rounding."""
    from workers.loading.adapters import adapter_for
    from workers.sparsity.predictors.base import MLPPredictor, SparsityPlan, k_for
    from workers.methods.oracle.predictor import OracleMLP
    from workers.methods.threshold.predictor import GateThreshold

    model = tiny_model(family)
    ad = adapter_for(model)
    act = ad.act_name(model.config)
    toks = _tokens()
    for make in ("oracle", "threshold"):
        plan = SparsityPlan()
        for l, layer in enumerate(ad.decoder_layers(model)):
            w = ad.ffn_weights(layer)
            plan.mlp[l] = (OracleMLP(w, act, k_for(0.5, w["up"].shape[0])) if make == "oracle" else
                           GateThreshold(w.get("gate", w["up"]), act, 0.02, None if "gate" in w else w.get("b_up")))
        assert all(p.reads_ffn and p.same_ffn(ad.ffn_weights(layer))
                   for p, layer in zip(plan.mlp.values(), ad.decoder_layers(model)))
        _, fast, _, counts, sp = _run(model, plan, "masked", toks)
        _, kernel, _, _, _ = _run(model, plan, "kernel", toks)
        with monkeypatch.context() as m:
            m.setattr(type(plan.mlp[0]), "reads_ffn", False)      # the scores computed from the FFN input again
            _, again, _, counts_again, _ = _run(model, plan, "masked", toks)
        assert torch.equal(fast, again) and counts == counts_again
        torch.testing.assert_close(fast, kernel, atol=1e-5, rtol=1e-4)
        assert 0.2 < sp[0] < 0.8                                       # a real selection, not all or nothing
    assert MLPPredictor.reads_ffn is False
    w = ad.ffn_weights(ad.decoder_layers(model)[0])
    other = {k: v.clone() for k, v in w.items()}                    # equal values, other memory: not assumed
    assert not OracleMLP(other, act, 4).same_ffn(w) and not GateThreshold(other.get("gate", other["up"]), act,
                                                                           0.02).same_ffn(w)
    if "b_up" in w:      # a threshold without fc1's bias (as fitted) scores something else than the FFN's act
        assert not GateThreshold(w["up"], act, 0.02).same_ffn(w)
