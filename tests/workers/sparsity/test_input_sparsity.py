"""Input sparsity (TEAL, WINA): histogram thresholds, calibration from a capture, the module swap, bundles."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.common import MAX_BATCH
from tests.workers.tiny_model_support import tiny_model
from workers.loading.adapters import adapter_for, linear_weight
from workers.loading.data import TokenSet
from workers.loading.models import LoadedModel, fingerprint
from workers.sparsity import histograms as H
from workers.sparsity.bundle import apply_bundle, load_bundle, save_bundle
from workers.sparsity.capture import capture_activations
from workers.sparsity.input_sparse import (
    InputSparseLinear, InputStats, apply_input_sparsity, projection_modules, projection_paths,
)
from workers.sparsity.predictors import FitContext, SparsityPlan, fit_method
from workers.sparsity.input_thresholds import calib_sparsity, symmetry_gaps, threshold_for
from workers.sparsity.sparse_exec import apply_sparsity


def _rows(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The three stored rows of a projection input's histograms, for a 1-D sample x."""
    a = x.abs()
    return torch.stack([H.histogram(a[x > 0]), H.histogram(a[x <= 0]), H.histogram(a * scale)])


# ---------------------------------------------------------------- thresholds from histograms
def test_abs_quantile_of_uniform_inputs_is_s():
    x = torch.rand(2_000_000, generator=torch.Generator().manual_seed(0)) * 2 - 1    # U[-1, 1]: |x| ~ U[0, 1]
    h = _rows(x)
    for s in (0.1, 0.25, 0.4, 0.5, 0.9):
        assert threshold_for(h, s) == pytest.approx(s, abs=2e-3)
        assert calib_sparsity(h, threshold_for(h, s)) == pytest.approx(s, abs=1e-6)   # cdf inverts quantile
        # symmetric data: TEAL's signed icdf(0.5 + s/2) agrees with the |x| quantile
        assert threshold_for(h, s, symmetric=True) == pytest.approx(s, abs=3e-3)


def test_histogram_quantile_matches_the_exact_quantile_on_heavy_tailed_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(500_000, generator=g).mul(2.5).exp() * torch.randn(500_000, generator=g).sign() * 1e-3
    a = x.abs()
    for s in (0.25, 0.5, 0.75):
        exact = torch.quantile(a[:200_000], s).item()          # torch.quantile caps its input size
        got = H.quantile(H.histogram(a[:200_000]), s)
        assert got == pytest.approx(exact, rel=4e-3)          # within a bin (0.62 %)


def test_symmetric_rule_is_wrong_for_skewed_inputs_with_known_answers():
    # x ~ U[-1, 3]: P(|x| <= t) = t / 2 for t <= 1, so the |x| median is 1; TEAL's rule takes icdf(0.75) = 2,
    # which drops P(|x| <= 2) = 3/4 of the inputs instead of 1/2
    x = torch.rand(2_000_000, generator=torch.Generator().manual_seed(2)) * 4 - 1
    h = _rows(x)
    assert threshold_for(h, 0.5) == pytest.approx(1.0, abs=5e-3)
    t_sym = threshold_for(h, 0.5, symmetric=True)
    assert t_sym == pytest.approx(2.0, abs=1e-2)
    assert calib_sparsity(h, t_sym) == pytest.approx(0.75, abs=3e-3)


def test_wina_threshold_scales_with_a_common_column_norm():
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(3))
    h = _rows(x, scale=3.0)
    for s in (0.25, 0.5):
        assert threshold_for(h, s, "wina") == pytest.approx(3.0 * threshold_for(h, s), rel=5e-3)
    with pytest.raises(ValueError, match="sparsity must be in"):
        threshold_for(h, 1.0)
    with pytest.raises(ValueError, match="TEAL's"):
        threshold_for(h, 0.5, "wina", symmetric=True)


def test_histogram_edges_zero_and_overflow():
    a = torch.tensor([0.0, 0.0, 1e-9, 2e6])
    c = H.histogram(a)
    assert c[0] == 3 and c[-1] == 1 and c.sum() == 4
    assert H.quantile(c, 0.0) == 0.0 and H.quantile(c, 1.0) == 10.0 ** H.HI


# ---------------------------------------------------------------- calibration from a real capture (tiny model)
def _lm(model) -> LoadedModel:
    ad = adapter_for(model)
    return LoadedModel(model, None, "tiny", ad, ad.dims(model.config), fingerprint(model), "random weights")


def _tokens(seed: int, n_windows: int = 8, seq_len: int = 32) -> TokenSet:
    w = torch.randint(0, 128, (n_windows, seq_len), generator=torch.Generator().manual_seed(seed))
    return TokenSet(w, "random", "calib", n_windows * seq_len, 0, f"random-{seed}-{n_windows}-{seq_len}")


def _ctx(lm, tmp_path, tokens=None):
    cache = capture_activations(lm, tokens or _tokens(0), root=tmp_path / "acts", progress=False, dtype="float32")
    return FitContext(lm, cache, list(range(lm.dims.n_layers)))


@pytest.fixture()
def llama(tmp_path):
    model = tiny_model("llama").double()
    return _lm(model), tmp_path


def test_capture_stores_every_projection_input_histogram(llama):
    lm, tmp_path = llama
    ctx = _ctx(lm, tmp_path)
    d, D = lm.dims.d, lm.dims.D
    width = {"q": d, "k": d, "v": d, "o": lm.dims.n_heads * lm.dims.head_dim, "gate": d, "up": d, "down": D}
    for l in ctx.layers:
        for p, w in width.items():
            h = ctx.cache.load_hist(l, p)
            assert h.shape == (3, H.N_COUNTS)
            assert h[0].sum() + h[1].sum() == h[2].sum() == ctx.cache.n_tokens * w
    # layer 0's q/k/v input, recomputed by hand: the signed rows are exact, the WINA row up to rounding at
    # bin edges (log10|x| + log10 n against log10(|x| n))
    seen = []
    attn = lm.model.model.layers[0].self_attn
    hook = attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().float()))
    with torch.no_grad():
        lm.model(input_ids=_tokens(0).windows)
    hook.remove()
    x = seen[0].reshape(-1, d)
    for p in ("q", "k", "v"):
        h = ctx.cache.load_hist(0, p)
        assert torch.equal(h[:2], _rows(x)[:2])
        wina = H.histogram(x.abs() * getattr(attn, f"{p}_proj").weight.float().norm(dim=0))
        assert (h[2] - wina).abs().sum() <= 1e-3 * wina.sum()
    # the down input act(gate)*up, recorded raw as ``inter``: its histogram quantile is the exact quantile
    inter = ctx.cache.load(1, "inter").abs()
    for s in (0.25, 0.5):
        assert threshold_for(ctx.cache.load_hist(1, "down"), s) == pytest.approx(
            torch.quantile(inter.flatten(), s).item(), rel=1e-2)
    with pytest.raises(KeyError, match="load_hist"):
        ctx.cache.load(0, "inhist")


@pytest.mark.parametrize("method", ["teal", "wina"])
def test_realized_input_sparsity_is_s_on_calibration_data(llama, method):
    lm, tmp_path = llama
    toks = _tokens(0)
    ctx = _ctx(lm, tmp_path, toks)
    s = 0.4
    plan = fit_method(method, ctx, s)
    assert set(plan.inputs) == {0, 1} and set(plan.inputs[0]) == {"q", "k", "v", "o", "gate", "up", "down"}
    assert plan.input_score == ("wina" if method == "wina" else "abs")
    with torch.no_grad(), apply_sparsity(lm.model, plan) as applied:
        lm.model(input_ids=toks.windows)
        st = applied.stats.inputs
    # layer 0's attention inputs are exactly the calibration inputs: sparsity s up to the histogram's bin
    for p in ("q", "k", "v"):
        assert st.sparsity(proj=p, layer=0) == pytest.approx(s, abs=5e-3)
    # later inputs see the sparsified model, so only close
    assert applied.stats.input_sparsity() == pytest.approx(s, abs=0.05)
    assert applied.stats.weight_skipped() == pytest.approx(s, abs=0.05)


def test_wina_reduces_to_teal_when_all_column_norms_are_equal(tmp_path):
    model = tiny_model("llama").double()
    ad = adapter_for(model)
    with torch.no_grad():
        for _, layer in ad.iter_layers(model):
            for m in projection_modules(ad, layer).values():
                m.weight.div_(m.weight.norm(dim=0, keepdim=True))      # every column norm 1
    lm = _lm(model)
    ctx = _ctx(lm, tmp_path)
    teal, wina = fit_method("teal", ctx, 0.5), fit_method("wina", ctx, 0.5)
    for l in teal.inputs:
        for p, t in teal.inputs[l].items():
            assert wina.inputs[l][p] == pytest.approx(t, rel=1e-6)
    ids = _tokens(5).windows
    outs = []
    for plan in (teal, wina):
        with torch.no_grad(), apply_sparsity(model, plan) as applied:
            outs.append((model(input_ids=ids).logits, applied.stats.inputs.per_projection()))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-9, atol=1e-9)
    assert outs[0][1] == outs[1][1]


def test_options_are_checked(llama):
    lm, tmp_path = llama
    ctx = _ctx(lm, tmp_path)
    with pytest.raises(ValueError, match="unknown options"):
        fit_method("teal", ctx, 0.5, bogus=1)
    with pytest.raises(ValueError, match="projections must be"):
        fit_method("wina", ctx, 0.5, projections=["q", "qq"])
    with pytest.raises(ValueError, match="leave out"):
        fit_method("teal", ctx, 0.5, projections=["q", "gate"], ffn={"method": "oracle", "sparsity": 0.5})
    no_hist = capture_activations(lm, _tokens(0), components=("ffn_in",), root=tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="no input histograms"):
        fit_method("teal", FitContext(lm, no_hist, [0, 1]), 0.5)


def test_greedy_block_allocation_path_and_plan(llama, monkeypatch):
    import workers.loading.data as data
    from workers.sparsity import input_allocation as mod

    lm, tmp_path = llama
    monkeypatch.setenv("CTXSPARSE_HOME", str(tmp_path / "home"))
    ctx = _ctx(lm, tmp_path)
    monkeypatch.setattr(data, "token_windows", lambda *a, **k: _tokens(3, 4, 32))
    projs = ["q", "k", "v", "o", "gate", "up", "down"]
    monkeypatch.setattr(mod, "BLOCK_STEP", 0.2)
    monkeypatch.setattr(mod, "BLOCK_MAX", 0.4)
    paths = mod.block_greedy_paths(ctx, "abs", projs)
    numel = {p: linear_weight(m).numel() for p, m in projection_modules(lm.adapter, lm.model.model.layers[0]).items()}
    for l, path in paths.items():
        budgets = [b for b, _, _ in path]
        assert budgets[0] == 0.0 and all(b2 > b1 for b1, b2 in zip(budgets, budgets[1:])) and budgets[-1] >= 0.4
        for b, per, _ in path:    # the budget is the weight-weighted mean of the projections' sparsities
            assert b == pytest.approx(sum(per[p] * numel[p] for p in projs) / sum(numel.values()), abs=1e-5)
    assert len(list((tmp_path / "home" / "input_greedy").glob("*.json"))) == 1
    plan = fit_method("teal", ctx, 0.3, greedy=True)        # reads the cached path (same key)
    assert len(list((tmp_path / "home" / "input_greedy").glob("*.json"))) == 1
    for l in (0, 1):
        per = mod.block_sparsities_at(paths[l], 0.3)
        assert set(plan.inputs[l]) == {p for p in projs if per[p] > 0}
        assert plan.info[l]["inputs"]["greedy"] == "block"
    with pytest.raises(ValueError, match="do not combine"):
        fit_method("teal", ctx, 0.3, greedy=True, symmetric=True)
    with pytest.raises(ValueError, match="greedy must be"):
        fit_method("teal", ctx, 0.3, greedy="layers")


def test_greedy_model_allocation_spends_the_budget_where_it_is_free_first(llama, monkeypatch):
    """With W_o zeroed, attention adds nothing to the residual stream: dropping inputs of q, k, v or o costs no
    KL at all, while every FFN step costs some. The model-wide greedy must therefore take every attention kind to
    its cap before it touches gate, up or down; and a plan read between two path points meets its budget."""
    import workers.loading.data as data
    from workers.sparsity import input_allocation as mod

    lm, tmp_path = llama
    monkeypatch.setenv("CTXSPARSE_HOME", str(tmp_path / "home"))
    with torch.no_grad():
        for layer in lm.model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    ctx = _ctx(lm, tmp_path)
    monkeypatch.setattr(data, "token_windows", lambda *a, **k: _tokens(3, 4, 32))
    monkeypatch.setattr(mod, "MODEL_STEP", 0.25)
    monkeypatch.setattr(mod, "MODEL_CAP", 0.75)
    monkeypatch.setattr(mod, "MODEL_MAX_BUDGET", 0.6)
    calls = []
    measure = mod._measure
    monkeypatch.setattr(mod, "_measure", lambda *a: calls.append(a[-2]) or measure(*a))
    attn, ffn = ["q", "k", "v", "o"], ["gate", "up", "down"]
    first = mod.model_greedy_path(ctx, "abs", attn + ffn, until=0.2)   # measured only as far as asked
    assert 0.2 <= first[-1][0] < 0.25
    path = mod.model_greedy_path(ctx, "abs", attn + ffn)              # continues the cached prefix
    assert path[:len(first)] == first
    numel = {p: linear_weight(m).numel() for p, m in projection_modules(lm.adapter, lm.model.model.layers[0]).items()}
    moved = [next(p for p in attn + ffn if b[1][p] != a[1][p]) for a, b in zip(path, path[1:])]
    assert moved[:12] and set(moved[:12]) == set(attn) and all(p in ffn for p in moved[12:])
    assert len(moved) > 12                                      # the attention kinds alone do not reach 0.6
    assert all(kl == 0.0 for _, _, kl in path[:13]) and path[13][2] > 0
    for b, per, _ in path:
        assert b == pytest.approx(sum(per[p] * numel[p] for p in per) / sum(numel.values()), abs=1e-5)
    mid = (path[13][0] + path[14][0]) / 2                     # halfway through the second FFN step
    per = mod.model_sparsities_at(path, mid)
    assert sum(per[p] * numel[p] for p in per) / sum(numel.values()) == pytest.approx(mid, abs=1e-6)
    plan = fit_method("teal", ctx, mid, greedy="model")      # reads the cached path
    assert calls == [0.2, 0.6]                               # two measurements: the prefix, then the rest
    assert len(list((tmp_path / "home" / "input_greedy").glob("model-*.json"))) == 1
    for l in (0, 1):
        assert set(plan.inputs[l]) == {p for p in per if per[p] > 0}
        assert plan.info[l]["inputs"]["greedy"] == "model"
    assert plan.inputs[0]["q"] == threshold_for(ctx.cache.load_hist(0, "q"), 0.75)


def test_attention_input_sparsity_with_a_neuron_predictor_on_the_ffn(llama):
    lm, tmp_path = llama
    ctx = _ctx(lm, tmp_path)
    plan = fit_method("teal", ctx, 0.5, projections=["q", "k", "v", "o"], ffn={"method": "oracle", "sparsity": 0.5})
    assert set(plan.mlp) == {0, 1} and set(plan.inputs[0]) == {"q", "k", "v", "o"}
    with torch.no_grad(), apply_sparsity(lm.model, plan) as applied:
        lm.model(input_ids=_tokens(0).windows)
    st = applied.stats
    assert st.mlp_sparsity() == pytest.approx(0.5, abs=0.02)
    assert set(st.inputs.per_projection()) == {"q", "k", "v", "o"}
    # weights skipped = each input-sparse projection's own realized sparsity times its weights (k and v are half
    # the size of q and o here, so the pooled input sparsity would not do) + each layer's FFN sparsity times its
    # up and down weights (the oracle runs gate dense and stores no weights of its own): an identity
    numel = st.inputs.numel
    assert st.predictor_numel == 0
    attn = sum(st.inputs.sparsity(proj=p, layer=l) * numel[(l, p)] for (l, p) in st.inputs.seen)
    ffn = sum(st.mlp_sparsity(layer=l) * (numel[(l, "up")] + numel[(l, "down")]) for l in st.layers)
    want = (attn + ffn) / sum(numel.values())
    assert st.weight_skipped() == pytest.approx(want, rel=1e-12, abs=0)
    # one projection cannot be input-sparse and predicted at once
    bad = SparsityPlan(mlp=plan.mlp, inputs={0: {"gate": 0.1}})
    with pytest.raises(ValueError, match="same FFN"):
        apply_sparsity(lm.model, bad)


# ---------------------------------------------------------------- the module swap
FAMILIES = ["llama", "gemma3", "opt", "gpt2"]


def _all_thresholds(model, t: float) -> dict:
    ad = adapter_for(model)
    return {l: {p: t for p in projection_paths(ad)} for l, _ in ad.iter_layers(model)}


@pytest.mark.parametrize("family", FAMILIES)
def test_swap_equals_masked_dense_reference_and_reverts_exactly(family):
    model = tiny_model(family).double()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = model(input_ids=ids).logits
    originals = dict(model.named_modules())
    ad = adapter_for(model)
    t = 0.05
    thr = _all_thresholds(model, t)
    for score in ("abs", "wina"):
        # reference: every projection's input masked by hand, through a forward pre-hook on the original module
        hooks = []
        for l, layer in ad.iter_layers(model):
            for p, m in projection_modules(ad, layer).items():
                n = linear_weight(m).detach().norm(dim=0) if score == "wina" else 1.0

                def pre(module, args, n=n):
                    x = args[0]
                    return (x * ((x.abs() * n) > t),)
                hooks.append(m.register_forward_pre_hook(pre))
        with torch.no_grad():
            ref = model(input_ids=ids).logits
        for h in hooks:
            h.remove()
        assert (ref - dense).abs().max() > 1e-3          # the mask does something
        for mode in ("masked", "kernel"):
            applied = apply_input_sparsity(model, thr, score, mode)
            assert sum(isinstance(m, InputSparseLinear) for m in model.modules()) == \
                len(thr) * len(projection_paths(ad))
            with torch.no_grad():
                got = model(input_ids=ids).logits
            torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)
            assert 0.01 < applied.stats.sparsity() < 0.99
            applied.revert()
            assert dict(model.named_modules()).keys() == originals.keys()
            assert all(m is originals[k] for k, m in model.named_modules())
            with torch.no_grad():
                assert torch.equal(model(input_ids=ids).logits, dense)


def test_an_input_exactly_at_the_threshold_is_dropped_and_counted_so():
    """The rule is keep iff score > t (calibration counts score <= t as dropped, ``calib_sparsity``): an entry
    exactly at t is dropped, and at t = 0 so is an exact zero (a ReLU output), in both modes and for WINA's score.
    Known answers by hand; ~10 ms."""
    w = torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 1.0], [0.0, 0.0, 2.0, 0.0]], dtype=torch.float64)
    lin = torch.nn.Linear(4, 3, bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(w)                                   # column norms 2, 2, 2, 1: WINA's score exact
    x = torch.tensor([[0.5, -0.5, 0.25, 1.0], [0.0, 0.0, 2.0, -0.5]], dtype=torch.float64)
    cases = [  # (threshold, WINA column norms or None, the entries kept)
        (0.5, None, [[0, 0, 0, 1], [0, 0, 1, 0]]),          # |x| = 0.5 sits on t: dropped
        (0.0, None, [[1, 1, 1, 1], [0, 0, 1, 1]]),          # exact zeros at t = 0: dropped
        (1.0, w.norm(dim=0), [[0, 0, 0, 0], [0, 0, 1, 0]]),  # WINA: |x|·‖W[:, i]‖ = 1.0 on t for three entries
    ]
    for t, scale, kept in cases:
        keep = torch.tensor(kept, dtype=torch.bool)
        for mode in ("masked", "kernel"):
            st = InputStats({(0, "q"): 12})
            mod = InputSparseLinear(lin, t, scale, mode, 0, "q", st)
            with torch.no_grad():
                torch.testing.assert_close(mod(x), F.linear(x * keep, w), rtol=1e-12, atol=1e-12)
            assert st.seen[(0, "q")] == [8, int(keep.sum())], (t, mode)


def test_kernel_mode_module_matches_the_reference_op_and_counts_what_it_drops():
    lin = torch.nn.Linear(16, 8, bias=True).double()
    x = torch.randn(5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    st = InputStats({(0, "q"): 128})
    mod = InputSparseLinear(lin, 0.5, None, "kernel", 0, "q", st)
    assert mod.w_t.shape == (16, 8) and mod.w_t.is_contiguous()
    with torch.no_grad():
        torch.testing.assert_close(mod(x), F.linear(x * (x.abs() > 0.5), lin.weight, lin.bias))
    assert st.seen[(0, "q")] == [80, int((x.abs() > 0.5).sum())]
    assert st.skipped_numel() == pytest.approx(st.sparsity() * 128)
    # more tokens than a decode kernel takes (an evaluation window): the masked product, same numbers and counts
    kept = st.seen[(0, "q")][1]
    x = torch.randn(MAX_BATCH + 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(mod(x), F.linear(x * (x.abs() > 0.5), lin.weight, lin.bias))
    assert st.seen[(0, "q")] == [80 + x.numel(), kept + int((x.abs() > 0.5).sum())]


def test_everything_skipped_is_all_decoder_weights():
    model = tiny_model("llama").double()
    ids = torch.randint(0, 128, (1, 8))
    plan = SparsityPlan(inputs=_all_thresholds(model, math.inf))
    with torch.no_grad(), apply_sparsity(model, plan) as applied:
        model(input_ids=ids)
    assert applied.stats.weight_skipped() == 1.0
    attn_only = SparsityPlan(inputs={l: {p: math.inf for p in ("q", "k", "v", "o")} for l in (0, 1)})
    with torch.no_grad(), apply_sparsity(model, attn_only) as applied:
        model(input_ids=ids)
    numel = applied.stats.inputs.numel
    want = sum(v for (l, p), v in numel.items() if p in ("q", "k", "v", "o")) / sum(numel.values())
    assert applied.stats.weight_skipped() == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------- bundles, registry, spec
@pytest.mark.parametrize("method", ["teal", "wina"])
def test_bundle_round_trip(llama, method):
    lm, tmp_path = llama
    plan = fit_method(method, _ctx(lm, tmp_path), 0.45)
    path = save_bundle(plan, lm, tmp_path / "bundle", method=method, sparsity=0.45)
    b = load_bundle(path)
    assert b.manifest["plan"]["input_score"] == plan.input_score
    assert b.plan(lm.model).inputs == plan.inputs          # floats survive JSON exactly
    ids = _tokens(9).windows
    with torch.no_grad(), apply_sparsity(lm.model, plan) as applied:
        want = lm.model(input_ids=ids).logits
    with torch.no_grad(), apply_bundle(lm.model, path) as applied2:
        got = lm.model(input_ids=ids).logits
    assert torch.equal(got, want)
    assert applied2.stats.inputs.seen == applied.stats.inputs.seen


def test_registered_and_accepted_by_a_sweep_spec():
    from orchestrator.spec import parse_spec
    from workers.sparsity.predictors import REGISTRY

    assert {"teal", "wina"} <= set(REGISTRY)
    spec = parse_spec({"name": "inputs", "models": ["smollm2-135m"],
                       "methods": [{"name": "teal", "sparsity": [0.25, 0.5]},
                                   {"name": "wina", "sparsity": [0.4], "options": {"projections": ["q", "k"]}}]})
    assert [m.name for m in spec.methods] == ["teal", "wina"]


def test_symmetry_gaps_known_answers(tmp_path):
    """symmetry_gaps reports how far TEAL's signed icdf(0.5 + s/2) rule lands from s. A cache (the on-disk format
    ActivationCache reads) of two layers: q's input U[-1, 1] in layer 0 (symmetric: the rule is exact) and U[-1, 3] in
    layer 1 (the rule's threshold icdf(0.5 + s/2) = 4 (0.5 + s/2) - 1 drops P(|x| <= t) = (t + 1) / 4: 0.75 at
    s = 0.5, 0.625 at s = 0.25; a quarter of the inputs negative); down's input U[-1, 1] in both."""
    from safetensors.torch import save_file

    from workers.sparsity.capture import ActivationCache

    g = torch.Generator().manual_seed(3)
    u = lambda lo, hi: torch.rand(200_000, generator=g) * (hi - lo) + lo     # noqa: E731
    save_file({"0.inhist.q": _rows(u(-1, 1)).int(), "1.inhist.q": _rows(u(-1, 3)).int(),
               "0.inhist.down": _rows(u(-1, 1)).int(), "1.inhist.down": _rows(u(-1, 1)).int()},
              str(tmp_path / "shard-0.safetensors"))
    cache = ActivationCache(tmp_path, {"shards": [{"file": "shard-0.safetensors"}], "components": ["inhist"],
                                       "layers": [0, 1], "n_tokens": 200_000})
    gaps = symmetry_gaps(cache, [0, 1], ["q", "down"], sparsities=(0.25, 0.5))
    q, down = gaps["q"], gaps["down"]
    assert q[0.5]["realized"] == pytest.approx((0.5 + 0.75) / 2, abs=1e-2)
    assert q[0.5]["max_abs_err"] == pytest.approx(0.25, abs=1e-2)
    assert q[0.25]["realized"] == pytest.approx((0.25 + 0.625) / 2, abs=1e-2)
    assert q[0.25]["max_abs_err"] == pytest.approx(0.375, abs=1e-2)
    assert q[0.5]["neg_frac"] == q[0.25]["neg_frac"] == pytest.approx((0.5 + 0.25) / 2, abs=2e-3)
    for s in (0.25, 0.5):
        assert down[s]["realized"] == pytest.approx(s, abs=1e-2) and down[s]["max_abs_err"] < 1e-2
        assert down[s]["neg_frac"] == pytest.approx(0.5, abs=2e-3)
