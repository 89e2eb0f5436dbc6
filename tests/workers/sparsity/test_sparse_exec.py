import pytest
import torch

from kernels.common import apply_act
from tests.workers.tiny_model_support import tiny_model
from workers.loading.adapters import adapter_for
from workers.sparsity.predictors.base import HeadPredictor, MLPPredictor, SparsityPlan
from workers.methods.oracle.predictor import OracleHeads, OracleMLP
from workers.sparsity.sparse_exec import apply_sparsity

FAMILIES = ["llama", "mistral", "qwen2", "gemma3", "opt", "gpt2"]


class RandomMLP(MLPPredictor):
    """Deterministic pseudo-random set per token (a function of x), recorded for checking."""
    method = "test"

    def __init__(self, D, input_kind="ffn_in", density=0.4):
        super().__init__(input_kind, "positive", None, D)
        self.proj = torch.randn(48, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        self.density = density
        self.seen = []

    def scores(self, x):
        s = torch.sigmoid(x.double() @ self.proj) - (1 - self.density)
        self.seen.append((x.detach().clone(), s > 0))
        return s


def _plan(model, make):
    ad = adapter_for(model)
    dims = ad.dims(model.config)
    return SparsityPlan(mlp={l: make(ad, dims, l) for l in range(dims.n_layers)})


@pytest.mark.parametrize("family", FAMILIES)
def test_sparsity_zero_equals_dense_and_revert_restores(family):
    model = tiny_model(family).double()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        dense = model(input_ids=ids).logits
    ad = adapter_for(model)
    plan = _plan(model, lambda ad, dims, l: OracleMLP(
        {k: v for k, v in ad.ffn_weights(ad.decoder_layers(model)[l]).items()}, ad.act_name(model.config), dims.D))
    applied = apply_sparsity(model, plan)
    with torch.no_grad():
        sparse = model(input_ids=ids).logits
    assert applied.stats.mlp_sparsity() == 0.0
    torch.testing.assert_close(sparse, dense, rtol=1e-9, atol=1e-9)
    applied.revert()
    assert all("Sparse" not in type(m).__name__ for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, dense, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "opt", "gemma3"])
def test_uses_exactly_the_predicted_set(family):
    """Each layer's output equals the FFN with exactly the predictor's set kept (computed densely, masked)."""
    model = tiny_model(family).double()
    ad = adapter_for(model)
    act = ad.act_name(model.config)
    dims = ad.dims(model.config)
    preds = {}
    plan = _plan(model, lambda ad, dims, l: preds.setdefault(l, RandomMLP(dims.D)))
    layer1 = ad.decoder_layers(model)[1]
    w = ad.ffn_weights(layer1)
    outs = {}
    with apply_sparsity(model, plan) as applied:
        target = layer1 if not ad.ffn.module else ad.ffn_module(layer1)
        name = ad.ffn.down if not ad.ffn.module else None
        mod = getattr(target, name) if name else target
        h = mod.register_forward_hook(lambda m, a, o: outs.update(x=a[0].detach().clone(), y=o.detach().clone()))
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (2, 9)))
        h.remove()
    x, mask = preds[1].seen[-1]
    x2 = outs["x"].reshape(-1, dims.d)
    assert torch.equal(x, x2)                            # the predictor saw the FFN input
    first = w.get("gate", w["up"])
    a = apply_act(x2 @ first.t() + (w["b_up"] if "b_up" in w and "gate" not in w else 0), act)
    hid = a * (x2 @ w["up"].t()) if "gate" in w else a
    ref = (hid * mask) @ w["down"].t() + (w["b_down"] if "b_down" in w else 0)
    torch.testing.assert_close(outs["y"].reshape(-1, dims.d), ref, rtol=1e-9, atol=1e-9)
    kept = int(mask.sum())
    assert applied.stats.layers[1].kept_pairs == kept and 0 < kept < mask.numel()


def test_lookahead_and_residual_inputs_come_from_the_right_layer():
    model = tiny_model("llama").double()
    ad = adapter_for(model)
    layers = ad.decoder_layers(model)
    seen_in = {}
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(
            lambda m, a, k, i=i: seen_in.__setitem__(i, (a[0] if a else k["hidden_states"]).detach().clone()),
            with_kwargs=True)
    p_res, p_look = RandomMLP(80, "residual"), RandomMLP(80, "lookahead")
    plan = SparsityPlan(mlp={0: RandomMLP(80), 1: p_look})
    plan.mlp[0] = p_res
    with apply_sparsity(model, plan), torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 7)))
    assert torch.equal(p_res.seen[-1][0], seen_in[0].reshape(-1, 48))
    assert torch.equal(p_look.seen[-1][0], seen_in[0].reshape(-1, 48))   # layer 1 looks ahead from layer 0


def test_head_sparsity_projects_only_active_heads():
    model = tiny_model("llama").double()
    ad = adapter_for(model)
    dims = ad.dims(model.config)
    ids = torch.randint(0, 128, (1, 10))
    plan_all = SparsityPlan(attn={l: OracleHeads(dims.n_heads, dims.n_heads, dims.head_dim) for l in range(2)})
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        with apply_sparsity(model, plan_all):
            torch.testing.assert_close(model(input_ids=ids).logits, dense, rtol=1e-9, atol=1e-9)
        plan = SparsityPlan(attn={l: OracleHeads(2, dims.n_heads, dims.head_dim) for l in range(2)})
        with apply_sparsity(model, plan) as applied:
            sparse = model(input_ids=ids).logits
        assert applied.stats.head_sparsity() == pytest.approx(0.5)
        assert not torch.allclose(sparse, dense)


def test_a_failing_apply_leaves_the_model_untouched():
    model = tiny_model("llama")
    before = [type(m).__name__ for m in model.modules()]

    class Bad(HeadPredictor):
        def __init__(self):
            super().__init__("residual", 1, 4)

    plan = SparsityPlan(mlp={0: RandomMLP(80)}, attn={5: Bad()})     # layer 5 does not exist
    with pytest.raises(IndexError):
        apply_sparsity(model, plan)
    assert [type(m).__name__ for m in model.modules()] == before
