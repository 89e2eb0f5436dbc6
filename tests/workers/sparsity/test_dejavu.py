"""Deja Vu predictors on a small real calibration set (SmolLM2, 2048 LAMBADA tokens, layers 3-4) and a tiny OPT."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from workers.sparsity.capture import capture_activations
from workers.methods.dejavu import fit as dv
from workers.sparsity.predictors.base import FitContext, fit_method, get_method, k_for

LAYERS = [3, 4]
FAST = dict(epochs=4, batch_size=256)   # small set: ~7 steps per epoch
RANK = 64


@pytest.fixture(scope="module")
def ctx(smollm2, smollm2_calib_cache):
    torch.set_num_threads(min(2, torch.get_num_threads()))
    cache = smollm2_calib_cache        # 2048 tokens in windows of 512, every component (conftest.py here)
    assert cache.n_tokens == 2048 and set(LAYERS) <= set(cache.manifest["layers"])
    return FitContext(lm=smollm2, cache=cache, layers=LAYERS, seed=0)


@pytest.fixture(scope="module")
def plan(ctx):
    """MLP predictor for layer 4 at s = 0.5 (residual input, Deja Vu's top-k labels) and a head predictor at
    s_attn = 0.5 (lookahead)."""
    return fit_method("dejavu", ctx, {4: 0.5}, rank=RANK, attn_sparsity={4: 0.5}, label="topk", **FAST)


def _val(ctx, info, layer, component):
    x = ctx.cache.load(layer, component)
    return x[info["n_train"]:]


def test_registered_and_info(plan):
    assert get_method("dejavu") is dv.fit_dejavu
    info = plan.info[4]
    assert isinstance(plan.mlp[4], dv.DejaVuMLPPredictor) and isinstance(plan.attn[4], dv.DejaVuHeadPredictor)
    for key in ("target_sparsity", "k", "rank", "input_kind", "epochs_run", "best_val_recall", "fit_s"):
        assert key in info
    assert info["k"] == k_for(0.5, 1536) == 768 and info["rank"] == RANK and info["input_kind"] == "residual"
    assert info["label"] == "topk"
    assert 0.08 < info["n_val"] / (info["n_val"] + info["n_train"]) < 0.12
    json.dumps(plan.info)                             # the store gets it as JSON


def test_mlp_recall_clearly_above_chance(ctx, plan):
    info, s = plan.info[4], 0.5
    chance = 1 - s
    assert info["best_val_recall"] > chance + 0.08, info["val_recall_history"]
    # the margin is one a predictor without information fails (~200 tokens x 768 labels: its spread is ~0.005)
    x_val = _val(ctx, info, 4, "residual")
    y_val = dv.topk_labels(_val(ctx, info, 4, "inter"), info["k"])
    rand = dv.DejaVuMLPPredictor(576, RANK, 1536, info["k"])    # seeded nn.Linear-style init, no training
    rand.reset_random(torch.Generator().manual_seed(123))
    assert abs(dv.recall(rand, x_val, y_val) - chance) < 0.03


def test_best_checkpoint_is_kept(ctx, plan):
    info = plan.info[4]
    hist = info["val_recall_history"]
    assert len(hist) == info["epochs_run"] + 1 and info["best_val_recall"] == max(hist)
    assert hist[info["best_epoch"]] == max(hist)
    x_val = _val(ctx, info, 4, "residual")
    y_val = dv.topk_labels(_val(ctx, info, 4, "inter"), info["k"])
    assert dv.recall(plan.mlp[4], x_val, y_val) == pytest.approx(info["best_val_recall"], abs=1e-12)


def test_best_checkpoint_kept_when_later_epochs_get_worse(ctx):
    # a learning rate far too high makes epochs after the (svd) start worse: the start must be what comes back
    p = fit_method("dejavu", ctx, {4: 0.5}, rank=16, epochs=2, lr=5.0, patience=2, batch_size=256, label="topk")
    info = p.info[4]
    hist = info["val_recall_history"]
    assert max(hist[1:]) < hist[0] and info["best_epoch"] == 0 and info["best_val_recall"] == hist[0]
    x_val = _val(ctx, info, 4, "residual")
    y_val = dv.topk_labels(_val(ctx, info, 4, "inter"), info["k"])
    assert dv.recall(p.mlp[4], x_val, y_val) == pytest.approx(hist[0], abs=1e-12)


def test_class_weights_follow_their_code():
    y = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])     # positive rate 3/8
    w = dv.class_weights(y, dv.MLP_NEG_OFFSET)
    assert torch.allclose(w[y == 1], torch.ones(3))
    assert torch.allclose(w[y == 0], torch.full((5,), 3 / 8 + 0.005))
    w_heads = dv.class_weights(y, dv.HEAD_NEG_OFFSET)
    assert torch.allclose(w_heads[y == 0], torch.full((5,), 3 / 8))
    assert dv.MLP_NEG_OFFSET == 0.005 and dv.HEAD_NEG_OFFSET == 0.0
    logits = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    ref = F.binary_cross_entropy(logits.sigmoid(), y, weight=w)       # their formulation (probabilities)
    assert dv.dejavu_loss(logits, y, dv.MLP_NEG_OFFSET).item() == pytest.approx(ref.item(), rel=1e-5)


def test_masks_have_exactly_k_per_token(ctx, plan):
    x = ctx.cache.load(4, "residual", max_tokens=300)
    m = plan.mlp[4].mask(x)
    assert m.dtype == torch.bool and m.shape == (300, 1536) and (m.sum(1) == 768).all()
    h = plan.attn[4].mask(ctx.cache.load(3, "residual", max_tokens=300))
    assert h.shape == (300, 9) and (h.sum(1) == k_for(0.5, 9)).all()


def test_lookahead_reads_previous_layers_residual(ctx):
    calls = []

    class Recording:
        layers = ctx.cache.layers

        def load(self, layer, component, **kw):
            calls.append((layer, component))
            return ctx.cache.load(layer, component, **kw)

    rec = FitContext(lm=ctx.lm, cache=Recording(), layers=LAYERS, seed=0)
    p = fit_method("dejavu", rec, {4: 0.5}, rank=16, input_kind="lookahead", epochs=1, label="topk")
    assert (3, "residual") in calls and (4, "residual") not in calls and (4, "inter") in calls
    info = p.info[4]
    assert info["input_kind"] == "lookahead" == p.mlp[4].input_kind and info["input_layer"] == 3
    y_val = dv.topk_labels(_val(ctx, info, 4, "inter"), info["k"])
    assert dv.recall(p.mlp[4], _val(ctx, info, 3, "residual"), y_val) == pytest.approx(info["best_val_recall"])
    # layer 3's lookahead needs layer 2, which this cache does not have
    with pytest.raises(ValueError, match="needs layer 2"):
        fit_method("dejavu", ctx, {3: 0.5}, rank=16, input_kind="lookahead", epochs=1)


def test_head_predictor_beats_chance_on_top30_label(ctx, plan):
    info = plan.info[4]["attn"]
    assert info["label_k"] == 3 and info["k"] == 4 and info["input_kind"] == "lookahead" and info["input_layer"] == 3
    chance = info["k"] / 9                             # a random 4 of 9 heads keeps 4/9 of any label set
    assert info["best_val_recall"] > chance + 0.15, info["val_recall_history"]
    assert info["val_recall_topk"] > chance + 0.1


def test_dense_attention_layers_default(ctx):
    assert dv.default_dense_attn_layers(30) == [0, 1, 2, 3, 4]
    assert dv.default_dense_attn_layers(18) == [0, 1, 2, 3] and dv.default_dense_attn_layers(2) == [0]
    p = fit_method("dejavu", ctx, {}, rank=16, attn_sparsity=0.3, attn_input_kind="residual", epochs=1)
    assert sorted(p.attn) == [] and p.info[3]["attn"] == {"dense": True}   # 3, 4 are both in 0..4
    p = fit_method("dejavu", ctx, {}, rank=16, attn_sparsity=0.3, attn_input_kind="residual", epochs=1,
                   dense_layers_attn=[3])
    assert sorted(p.attn) == [4] and p.attn[4].k == k_for(0.3, 9) == 6


def test_unknown_options_and_bad_values_are_rejected(ctx):
    with pytest.raises(ValueError, match="bogus"):
        fit_method("dejavu", ctx, {4: 0.5}, bogus=1, epochs=1)
    with pytest.raises(ValueError, match="input_kind"):
        fit_method("dejavu", ctx, {4: 0.5}, input_kind="attn_out")
    with pytest.raises(ValueError, match="attn_input_kind"):   # ffn_in comes after the attention it would choose
        fit_method("dejavu", ctx, {}, attn_sparsity=0.5, attn_input_kind="ffn_in")
    with pytest.raises(ValueError, match="rank"):
        fit_method("dejavu", ctx, {4: 0.5}, rank=0)


def test_round_trip_gives_identical_masks(ctx, plan):
    x = ctx.cache.load(4, "residual", max_tokens=256)
    for pred, cls in ((plan.mlp[4], dv.DejaVuMLPPredictor), (plan.attn[4], dv.DejaVuHeadPredictor)):
        cfg = json.loads(json.dumps(pred.config()))
        tensors = {k: v.clone() for k, v in pred.to_tensors().items()}
        assert set(tensors) == {"fc1.weight", "fc2.weight"}
        back = cls.from_parts(cfg, tensors, weights={})
        assert back.config() == pred.config() and cfg["method"] == "dejavu"
        assert torch.equal(back.mask(x), pred.mask(x))


def test_same_seed_same_weights(ctx):
    def fit(seed):
        c = FitContext(lm=ctx.lm, cache=ctx.cache, layers=LAYERS, seed=seed)
        return fit_method("dejavu", c, {4: 0.7}, rank=16, epochs=2, batch_size=256, init="random", label="topk")

    a, b, c = fit(7), fit(7), fit(8)
    for k, v in a.mlp[4].to_tensors().items():
        assert torch.equal(v, b.mlp[4].to_tensors()[k])
    assert a.info[4]["val_recall_history"] == b.info[4]["val_recall_history"]
    assert not torch.equal(a.mlp[4].fc1.weight, c.mlp[4].fc1.weight)


def test_tiny_opt_relu_labels(tmp_path):
    from tests.workers.tiny_model_support import tiny_model
    from workers.loading.adapters import adapter_for
    from workers.loading.data import TokenSet
    from workers.loading.models import LoadedModel, fingerprint

    m = tiny_model("opt")
    ad = adapter_for(m)
    lm = LoadedModel(model=m, tokenizer=None, ref="opt", adapter=ad, dims=ad.dims(m.config),
                     fingerprint=fingerprint(m), source="config")
    ids = torch.randint(0, 128, (16, 64), generator=torch.Generator().manual_seed(0))
    cache = capture_activations(lm, TokenSet(ids, "random", "calib", 1024, 0, "fp-opt"), root=tmp_path,
                                progress=False, dtype="float32")
    ctx = FitContext(lm=lm, cache=cache, layers=[0, 1], seed=0)
    p = fit_method("dejavu", ctx, 0.5, epochs=3, attn_sparsity=0.5)
    info = p.info[1]
    assert info["label"] == "active" and info["rank"] == 48 and p.mlp[1].k == 40
    inter = cache.load(1, "inter")
    assert info["label_rate"] == pytest.approx(float((inter > 0).float().mean()))   # ReLU: act > 0
    assert 0 < info["best_val_recall"] <= 1
    assert sorted(p.attn) == [1] and p.info[0]["attn"] == {"dense": True} and p.info[1]["attn"]["input_layer"] == 0


def test_damage_targets_known_answer():
    dmg = torch.tensor([[1.0, 3.0, 2.0], [4.0, 1.0, 1.0]])
    y, norm = dv.damage_targets(dmg, 2)
    assert y.tolist() == [[False, True, True], [True, True, False]] or y.tolist() == [[False, True, True], [True, False, True]]
    # normalized by the mean damage of each token's label set: (3+2)/2 and (4+1)/2
    torch.testing.assert_close(norm, torch.tensor([[0.4, 1.2, 0.8], [1.6, 0.4, 0.4]]))


def test_the_damage_labels_are_computed_where_the_activations_are():
    """A GPU fitter computes a layer's labels on its GPU while the post-FFN norm's gain comes from the model on the
    CPU: the gain follows the activations (``meta`` stands in for the GPU: mixing it with the CPU raises the same
    error a CUDA device does)."""
    from workers.sparsity.predictors.base import output_damage

    inter, down, gain = torch.randn(5, 8), torch.randn(4, 8), torch.rand(4) + 0.5
    want = output_damage(inter, down, gain)
    got = output_damage(inter.to("meta"), down.to("meta"), gain)
    assert got.device.type == "meta" and got.shape == want.shape
    y, norm = dv.damage_targets(want, 3)
    assert y.sum(1).tolist() == [3] * 5 and dv.topk_labels(want.to("meta"), 3).device.type == "meta"


def test_damage_weighted_loss_and_recall():
    logits = torch.tensor([[5.0, -5.0, 0.0]])
    y = torch.tensor([[True, True, False]])
    dmg = torch.tensor([[0.1, 1.9, 0.2]])
    plain = dv.dejavu_loss(logits, y, 0.0)
    weighted = dv.dejavu_loss(logits, y, 0.0, dmg)
    # the missed positive (logit -5) carries most of the damage: the weighted loss punishes it more
    assert weighted > plain

    class Fixed:
        def mask(self, x):
            return torch.tensor([[True, False, True]])
    # squared damage kept: (0.1² + 0.2²) / (0.1² + 1.9² + 0.2²)
    assert dv.recall(Fixed(), torch.zeros(1, 1), y, dmg) == pytest.approx(0.05 / 3.66)
    assert dv.recall(Fixed(), torch.zeros(1, 1), y) == pytest.approx(0.5)


def test_damage_labels_are_the_default_on_gated_models_and_keep_more_damage(ctx, plan):
    """label="auto" on a SiLU-gated model learns from output damage; its best checkpoint's recall is the share of
    squared (per-token normalized) damage kept on validation tokens, recomputed here, and it keeps more of it than
    the top-k-label fit."""
    from workers.sparsity.predictors.base import output_damage

    dmg_plan = fit_method("dejavu", ctx, {4: 0.5}, rank=RANK, **FAST)
    info = dmg_plan.info[4]
    assert info["label"] == "damage"
    x_val = _val(ctx, info, 4, "residual")
    inter = _val(ctx, info, 4, "inter")
    _, dmg = dv.damage_targets(output_damage(inter, ctx.ffn_weights(4)["down"], ctx.ffn_out_gain(4)), info["k"])
    kept = dv.recall(dmg_plan.mlp[4], x_val, None, dmg)
    assert kept == pytest.approx(info["best_val_recall"], abs=1e-9)
    assert kept > 0.5 + 0.2                              # a random half keeps ~0.5 of the squared damage
    assert kept >= dv.recall(plan.mlp[4], x_val, None, dmg) - 0.01
