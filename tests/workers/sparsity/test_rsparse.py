"""R-Sparse (rank-aware input sparsity): the layer is exact at full rank and at s = 0, the bytes charged for the
low-rank factors, the recipe search and the bytes-budget allocation."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.workers.tiny_model_support import loaded, tiny_model
from workers.loading import data
from workers.loading.adapters import adapter_for, linear_weight
from workers.loading.data import TokenSet
from workers.sparsity.capture import capture_activations
from workers.sparsity.input_sparse import InputStats, projection_modules
from workers.methods.rsparse import fit as R
from workers.methods.rsparse.masked import RankSparseLinear
from workers.methods.rsparse.part import LowRankPart, RankSparsePlan, lowrank_numel
from workers.sparsity.input_thresholds import Thresholds
from workers.sparsity.predictors import FitContext, SparsityPlan, fit_method
from workers.sparsity.sparse_exec import apply_sparsity

ALL = ("q", "k", "v", "o", "gate", "up", "down")


def _tokens(seed: int, n_windows: int = 8, seq_len: int = 32) -> TokenSet:
    w = torch.randint(0, 128, (n_windows, seq_len), generator=torch.Generator().manual_seed(seed))
    return TokenSet(w, "random", "calib", n_windows * seq_len, 0, f"random-{seed}-{n_windows}-{seq_len}")


def _ctx(model, tmp_path) -> FitContext:
    lm = loaded(model, "tiny")
    cache = capture_activations(lm, _tokens(0), root=tmp_path / "acts", progress=False, dtype="float32")
    return FitContext(lm, cache, list(range(lm.dims.n_layers)))


@pytest.fixture()
def recipe_tokens(monkeypatch):
    """The recipe errors' calibration windows (a tiny model has no tokenizer: random ids stand for text)."""
    toks = _tokens(3, 4, 32)
    monkeypatch.setattr(data, "token_windows", lambda *a, **k: toks)
    return toks


def _svd(w):
    return torch.linalg.svd(w.detach().double(), full_matrices=False)


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("score,quantile", [("abs", 0.0), ("abs", 0.5), ("wina", 0.7), ("abs", 1.0)])
def test_full_rank_equals_dense_at_any_sparsity(score, quantile):
    """r = min(in, out): W on the kept inputs plus B A = W on the others is W x, whatever the threshold drops."""
    g = torch.Generator().manual_seed(0)
    for n_out, n_in in ((24, 48), (48, 80)):
        lin = nn.Linear(n_in, n_out, bias=True)
        x = torch.randn(3, 5, n_in, generator=g)
        s_x = x.abs() * (lin.weight.detach().norm(dim=0) if score == "wina" else 1)
        t = float(s_x.flatten().quantile(quantile)) if quantile < 1 else float("inf")
        part = LowRankPart(t, score, *R.low_rank_factors(_svd(lin.weight), min(n_in, n_out)))
        st = InputStats()
        mod = RankSparseLinear(lin, part, 0, "q", st)
        with torch.no_grad():
            got, want = mod(x), lin(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        dropped = st.sparsity()
        assert dropped == pytest.approx(float((s_x <= t).float().mean()))
        assert (dropped > 0.4) == (quantile >= 0.5)          # it did drop inputs from W's product


def test_full_rank_plan_on_a_model_gives_the_dense_logits():
    model = tiny_model("qwen2")              # with q/k/v biases
    ad = adapter_for(model)
    plan = RankSparsePlan()
    for l, layer in ad.iter_layers(model):
        for p, m in projection_modules(ad, layer).items():
            w = linear_weight(m)
            plan.parts.setdefault(l, {})[p] = LowRankPart(0.05, "abs", *R.low_rank_factors(_svd(w), min(w.shape)))
    ids = _tokens(7, 2, 24).windows
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        with apply_sparsity(model, SparsityPlan(parts=[plan])) as applied:
            got = model(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, dense)          # reverted
    torch.testing.assert_close(got, dense, rtol=1e-4, atol=1e-4)
    assert applied.stats.input_sparsity() > 0.2


def test_zero_sparsity_is_dense(tmp_path):
    """s = 0: the fit plans nothing; and a part that keeps every input (threshold -1) adds an exact zero from its
    low-rank term, whatever its rank."""
    model = tiny_model("llama")
    ctx = _ctx(model, tmp_path)
    plan = fit_method("rsparse", ctx, 0.0, rho=0.8)
    assert plan.part("rsparse").parts == {}
    lin = model.model.layers[0].mlp.down_proj
    mod = RankSparseLinear(lin, LowRankPart(-1.0, "abs", *R.low_rank_factors(_svd(lin.weight), 5)), 0, "down",
                           InputStats())
    x = torch.randn(4, 80, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(mod(x), lin(x))


# ---------------------------------------------------------------- bytes
def test_bytes_charged_known_answer():
    """Tiny Llama (d 48, D 80, 2 KV heads of 12): per layer q 2304, k 1152, v 1152, o 2304, gate/up/down 3840 each
    = 18432 weights, 36864 in both layers. Layer 0's q drops every input (2304 skipped) and reads rank-4 factors
    (4·(48 + 48) = 384); layer 1's down keeps every input and reads rank-3 factors (3·(80 + 48) = 384):
    (2304 - 768) / 36864 = 1/24 of the decoder's weights skipped."""
    model = tiny_model("llama")
    layers = model.model.layers
    q, down = layers[0].self_attn.q_proj, layers[1].mlp.down_proj
    plan = RankSparsePlan({0: {"q": LowRankPart(float("inf"), "abs", *R.low_rank_factors(_svd(q.weight), 4))},
                           1: {"down": LowRankPart(-1.0, "wina", *R.low_rank_factors(_svd(down.weight), 3))}})
    assert lowrank_numel(plan) == 768
    with torch.no_grad(), apply_sparsity(model, SparsityPlan(parts=[plan])) as applied:
        model(input_ids=_tokens(4, 2, 16).windows)
    st = applied.stats
    assert st.extra_numel == 768
    assert st.inputs.total_numel() == 36864
    assert st.inputs.sparsity(proj="q") == 1.0 and st.inputs.sparsity(proj="down") == 0.0
    assert st.weight_skipped() == pytest.approx(1 / 24, abs=1e-12)


def test_fitted_plan_charges_its_factors_within_each_budget(tmp_path):
    """rho 0.8 at s = 0.5: rank = floor(0.1·in·out / (in + out)) per projection (q 2, k 1, o 2, gate/up/down 3); the
    factors are charged, and each projection's calibrated reads (kept columns + factors) stay within (1 - s)."""
    model = tiny_model("llama")
    ctx = _ctx(model, tmp_path)
    plan = fit_method("rsparse", ctx, 0.5, rho=0.8)
    ranks = {p: part.rank for p, part in plan.part("rsparse").parts[1].items()}
    assert ranks == {"q": 2, "k": 1, "v": 1, "o": 2, "gate": 3, "up": 3, "down": 3}
    for l, per in plan.part("rsparse").parts.items():
        for p, part in per.items():
            rec = plan.info[l]["rsparse"]["recipe"][p]
            assert rec["input_sparsity"] == pytest.approx(0.6) and part.score == "wina"
            n_out, n_in = (part.b.shape[0], part.a.shape[1])
            assert (1 - rec["calib_sparsity"]) * n_in * n_out + part.numel() <= 0.5 * n_in * n_out * 1.02
    with torch.no_grad(), apply_sparsity(model, plan) as applied:
        model(input_ids=_tokens(5, 2, 16).windows)
    assert applied.stats.extra_numel == lowrank_numel(plan.part("rsparse")) == 2 * (
        2 * 96 + 1 * 72 * 2 + 2 * 96 + 3 * 128 * 3)
    skipped = applied.stats.inputs.skipped_numel()
    assert applied.stats.weight_skipped() == pytest.approx((skipped - applied.stats.extra_numel) / 36864)


# ---------------------------------------------------------------- recipe search and allocation
def _low_rank_o(model, layer: int = 1, r: int = 2):
    """Layer ``layer``'s o projection made exactly rank ``r``: its low-rank term then costs no error at rank >= r."""
    o = model.model.layers[layer].self_attn.o_proj
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        o.weight.copy_(0.1 * torch.randn(48, r, generator=g) @ torch.randn(r, 48, generator=g))
    return o


def test_recipe_errors_known_answer_and_search(tmp_path, recipe_tokens):
    """The table's err(s, ρ) is Σ ‖W x - R-Sparse(x)‖² over the calibration tokens' inputs (recomputed here with the
    module itself); the search takes the least error, the larger ρ on ties: layer 1's rank-2 o gets ρ = 0.8 (the
    largest ρ with rank >= 2 at s = 0.5: 0.95 -> 0, 0.9 -> 1, 0.8 -> 2)."""
    model = tiny_model("llama")
    o = _low_rank_o(model)
    ctx = _ctx(model, tmp_path)
    plan = fit_method("rsparse", ctx, 0.5)
    assert plan.info[1]["rsparse"]["recipe"]["o"]["rho"] == 0.8 and plan.part("rsparse").parts[1]["o"].rank == 2
    assert plan.info[1]["rsparse"]["recipe"]["o"]["rel_error"] == pytest.approx(0.0, abs=1e-9)
    assert plan.info[1]["rsparse"]["recipe"]["q"]["rho"] == 1.0          # random weights: no low-rank structure

    seen = []
    hook = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        for w in recipe_tokens.windows:
            model(input_ids=w[None])
    hook.remove()
    x = torch.cat(seen).reshape(-1, 80)
    down = model.model.layers[1].mlp.down_proj
    svd = {(1, "down"): _svd(down.weight)}
    table = R.recipe_errors(ctx, svd, {1: [0.5]}, ["down"], R.RHOS, "auto")
    thr = {sc: Thresholds(ctx, sc) for sc in ("abs", "wina")}
    for j, rho in enumerate(R.RHOS):
        r, sc = R.rank_for(rho, 0.5, 80, 48), R.score_for(rho, "auto")
        t = thr[sc](1, "down", R.input_sparsity_for(rho, 0.5))
        part = LowRankPart(t, sc, *R.low_rank_factors(svd[(1, "down")], r))
        with torch.no_grad():
            want = float((RankSparseLinear(down, part, 1, "down", InputStats())(x) - down(x)).double().square().sum())
        assert table[(1, "down")]["err"][0][j] == pytest.approx(want, rel=1e-4)
    with torch.no_grad():
        energy = float(down(x).double().square().sum())
    assert table[(1, "down")]["energy"] == pytest.approx(energy, rel=1e-5)
    calls = []
    hook = model.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    again = R.recipe_errors(ctx, svd, {1: [0.5]}, ["down"], R.RHOS, "auto")        # read back from its cache
    hook.remove()
    assert calls == [] and again == table


def test_greedy_allocation_spends_the_bytes_budget_where_the_error_is_least(tmp_path, recipe_tokens):
    """allocate greedy: one sparsity of GRID per projection; the bytes skipped reach the budget (0.4 of every
    projection's weights) within one step, and layer 1's rank-2 o goes first, as far as its rank-2 term fits."""
    model = tiny_model("llama")
    _low_rank_o(model)
    ctx = _ctx(model, tmp_path)
    plan = fit_method("rsparse", ctx, 0.4, allocate="greedy")
    numel = {"q": 2304, "k": 1152, "v": 1152, "o": 2304, "gate": 3840, "up": 3840, "down": 3840}
    got = sum(plan.info[l]["rsparse"]["recipe"].get(p, {"sparsity": 0.0})["sparsity"] * n
              for l in (0, 1) for p, n in numel.items())
    assert 0.4 * 36864 <= got < 0.4 * 36864 + 0.1 * 3840 + 1e-6
    recipe = plan.info[1]["rsparse"]["recipe"]
    # free up to s = 0.8: there ρ = 0.5 buys rank floor(0.5·0.2·48·48 / 96) = 2; at 0.9 at most rank 1
    assert (recipe["o"]["sparsity"], recipe["o"]["rho"], recipe["o"]["rank"]) == (0.8, 0.5, 2)
    assert all(v["sparsity"] in R.GRID for l in (0, 1) for v in plan.info[l]["rsparse"]["recipe"].values())
    assert len({v["sparsity"] for v in recipe.values()}) > 1            # not uniform


def test_options_and_refusals(tmp_path):
    model = tiny_model("llama")
    ctx = _ctx(model, tmp_path)
    for kw, msg in (({"bogus": 1}, "unknown options"), ({"rho": 0}, "rho must be"), ({"rho": "grid"}, "rho must be"),
                    ({"allocate": "model"}, "allocate must be"), ({"score": "norm"}, "score must be"),
                    ({"projections": ["q", "qkv"]}, "projections must be")):
        with pytest.raises(ValueError, match=msg):
            fit_method("rsparse", ctx, 0.5, **kw)
    with pytest.raises(ValueError, match="leave rank unset"):
        fit_method("rsparse", ctx, 0.5, rank=8)
    plan = fit_method("rsparse", ctx, 0.5, rho=1.0, score="abs", projections=["gate", "up"])
    assert set(plan.part("rsparse").parts[0]) == {"gate", "up"} and lowrank_numel(plan.part("rsparse")) == 0
    no_hist = capture_activations(ctx.lm, _tokens(0), components=("ffn_in",), root=tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="no input histograms"):
        fit_method("rsparse", FitContext(ctx.lm, no_hist, [0, 1]), 0.5, rho=0.9)
    with pytest.raises(ValueError, match="rank-sparse plan carries no other decoder part"):
        apply_sparsity(model, SparsityPlan(parts=[plan.part("rsparse")], inputs={0: {"q": 0.1}}))


def test_registered_and_accepted_by_a_sweep_spec():
    from orchestrator.spec import parse_spec

    spec = parse_spec({"name": "ranked", "models": ["smollm2-135m"],
                       "methods": [{"name": "rsparse", "sparsity": [0.3, 0.4],
                                    "options": {"rho": 0.95, "allocate": "greedy", "score": "wina"}}]})
    assert [m.name for m in spec.methods] == ["rsparse"]
    with pytest.raises(ValueError, match="unknown option"):
        parse_spec({"name": "ranked", "models": ["smollm2-135m"],
                    "methods": [{"name": "rsparse", "sparsity": [0.3], "options": {"rank_share": 0.1}}]})

