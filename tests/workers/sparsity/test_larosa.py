"""LaRoSA (rotated input sparsity): the covariances the capture records, the rotation folded into the weights, the
per-token top-k, and the bytes charged for the rotations."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests.workers.tiny_model_support import loaded, tiny_model
from workers.loading.adapters import adapter_for, linear_weight
from workers.loading.data import TokenSet
from workers.sparsity.capture import capture_activations
from workers.sparsity.input_sparse import projection_modules
from workers.sparsity.predictors import FitContext, fit_method
from workers.methods.larosa.fit import pca_rotation
from workers.methods.larosa.masked import RotatedTopKNorm, TopKInputLinear
from workers.methods.larosa.rotations import keep_count
from workers.sparsity.norms import rms_normalized
from workers.sparsity.sparse_exec import apply_sparsity

ALL = ("q", "k", "v", "o", "gate", "up", "down")


def _tokens(seed: int, n_windows: int = 8, seq_len: int = 32) -> TokenSet:
    w = torch.randint(0, 128, (n_windows, seq_len), generator=torch.Generator().manual_seed(seed))
    return TokenSet(w, "random", "calib", n_windows * seq_len, 0, f"random-{seed}-{n_windows}-{seq_len}")


def _ctx(model, tmp_path, **kw) -> FitContext:
    lm = loaded(model, "tiny")
    cache = capture_activations(lm, _tokens(0), root=tmp_path / "acts", progress=False, dtype="float32", **kw)
    return FitContext(lm, cache, list(range(lm.dims.n_layers)))


def _zero_sparsity(plan):
    for l in plan.part("larosa").sparsity:
        plan.part("larosa").sparsity[l] = {g: 0.0 for g in plan.part("larosa").sparsity[l]}
    return plan


# ---------------------------------------------------------------- capture
def test_capture_records_the_block_input_covariances_once(tmp_path):
    """Σ n nᵀ of the normalized attention input (recomputed from the norm's own input) and Σ a_h a_hᵀ of o's input
    per KV group; with one window per shard (max_buffer_mb=0) only the last shard holds them, summed over all."""
    model = tiny_model("llama").double()
    lm = loaded(model, "tiny")
    toks = _tokens(0, n_windows=3)
    cache = capture_activations(lm, toks, root=tmp_path, progress=False, dtype="float32", max_buffer_mb=0,
                                batch_windows=1)
    assert len(cache.manifest["shards"]) == 3
    holders = []
    for shard in cache.manifest["shards"]:
        with safe_open(cache.path / shard["file"], framework="pt") as f:
            holders.append(any(".cov." in k for k in f.keys()))
    assert holders == [False, False, True]
    layer = model.model.layers[1]
    seen = {}
    hooks = [layer.input_layernorm.register_forward_pre_hook(lambda m, a: seen.setdefault("h", []).append(a[0])),
             layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("a", []).append(a[0]))]
    with torch.no_grad():
        model(input_ids=toks.windows)
    for h in hooks:
        h.remove()
    n = rms_normalized(layer.input_layernorm, seen["h"][0]).reshape(-1, lm.dims.d)
    got, count = cache.load_cov(1, "attn_in")
    assert count == 3 * 32
    torch.testing.assert_close(got, n.t() @ n, rtol=1e-5, atol=1e-5)
    a = seen["a"][0].reshape(-1, 4, 12)             # 4 query heads of 12, 2 KV heads: heads 0,1 -> 0 and 2,3 -> 1
    want = torch.stack([sum(a[:, h].t() @ a[:, h] for h in (0, 1)), sum(a[:, h].t() @ a[:, h] for h in (2, 3))])
    torch.testing.assert_close(cache.load_cov(1, "o")[0], want, rtol=1e-5, atol=1e-5)
    assert cache.load_cov(0, "ffn_in")[0].shape == (48, 48)


def test_pca_rotation_known_answer():
    """cov = U diag(9, 4, 1) Uᵀ: Q's columns are U's in decreasing order of eigenvalue (up to sign), orthogonal,
    and the eigenvalues come back undamped."""
    u, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    ev = torch.tensor([1.0, 9.0, 4.0], dtype=torch.float64)
    q, got = pca_rotation(u @ torch.diag(ev) @ u.T)
    torch.testing.assert_close(got, torch.tensor([9.0, 4.0, 1.0], dtype=torch.float64))
    for j, col in enumerate((1, 2, 0)):
        assert abs(float(q[:, j].double() @ u[:, col])) == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(q.T @ q, torch.eye(3), rtol=0, atol=1e-6)


# ---------------------------------------------------------------- the rotation is exact, the top-k exact
@pytest.mark.parametrize("family,rotation,basis", [
    *[(f, r, "normed") for f in ("llama", "qwen2", "gemma3") for r in ("layer", "block", "model")],
    ("llama", "layer", "scaled"), ("gemma3", "block", "scaled"),
])
def test_rotation_is_exact_at_zero_sparsity(tmp_path, family, rotation, basis):
    """Every rotation folded in (norm gains, q/k/v and gate/up on Qᵀn -- or on Qᵀ(g ⊙ n), basis "scaled" --, v and
    o per KV group, Qwen2's biases, Gemma-3's (1 + w) gains and post-norms), nothing dropped: the logits are the
    dense model's to float32 rounding."""
    model = tiny_model(family)
    ctx = _ctx(model, tmp_path)
    plan = _zero_sparsity(fit_method("larosa", ctx, 0.4, rotation=rotation, basis=basis))
    assert set(plan.part("larosa").rotations[0]) == {"attn_in", "ffn_in", "o"}
    ids = _tokens(7, 2, 24).windows
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        with apply_sparsity(model, plan) as applied:
            assert isinstance(model.model.layers[0].input_layernorm, RotatedTopKNorm)
            got = model(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, dense)          # reverted
    torch.testing.assert_close(got, dense, rtol=1e-4, atol=2e-5)
    assert (got - dense).abs().max() > 0           # it did run through the rotated weights (float32 rounding)
    assert applied.stats.input_sparsity() == 0.0


def test_topk_keeps_exactly_k_entries_per_token(tmp_path):
    model = tiny_model("llama")
    ctx = _ctx(model, tmp_path)
    s = 0.4
    plan = fit_method("larosa", ctx, s)
    d, D, n_o = 48, 80, 48
    counts = {}

    def count(name):
        def hook(m, args, out=None):
            x = out if out is not None else args[0]
            counts.setdefault(name, []).append((x != 0).sum(-1).flatten())
        return hook

    ids = _tokens(3, 4, 32).windows
    with torch.no_grad(), apply_sparsity(model, plan) as applied:
        layer = model.model.layers[1]
        hooks = [layer.input_layernorm.register_forward_hook(count("attn_in")),
                 layer.post_attention_layernorm.register_forward_hook(count("ffn_in")),
                 layer.self_attn.o_proj.lin.register_forward_pre_hook(count("o")),
                 layer.mlp.down_proj.lin.register_forward_pre_hook(count("down"))]
        assert isinstance(layer.mlp.down_proj, TopKInputLinear)
        model(input_ids=ids)
        for h in hooks:
            h.remove()
    for name, n in (("attn_in", d), ("ffn_in", d), ("o", n_o), ("down", D)):
        c = torch.cat(counts[name])
        assert c.numel() == ids.numel()
        assert torch.all(c == keep_count(s, n)), name        # every token: exactly k
    st = applied.stats.inputs
    for p, n in (("q", d), ("k", d), ("v", d), ("o", n_o), ("gate", d), ("up", d), ("down", D)):
        assert st.sparsity(proj=p) == pytest.approx(1 - keep_count(s, n) / n, abs=1e-12)
    assert keep_count(s, d) == 29 and keep_count(s, D) == 48
    with torch.no_grad(), apply_sparsity(model, plan) as applied:     # counting off (a task unit): nothing counted
        applied.stats.counting = False
        model(input_ids=ids)
        assert applied.stats.inputs.seen == {}


# ---------------------------------------------------------------- bytes
@pytest.mark.parametrize("family,rotation,basis,changes", [
    ("llama", "layer", "normed", 1),   # one basis per layer, 2 layers: one adapter (the ends fold into embeddings, head)
    ("llama", "block", "normed", 3),   # a basis per block input: attn0 -> ffn0 -> attn1 -> ffn1
    ("llama", "model", "normed", 0),   # one basis for all: nothing per token
    ("llama", "none", "normed", 0),
    ("llama", "model", "scaled", 4),   # a basis of g ⊙ n is never the residual stream's: d² per rotated input
    ("gemma3", "layer", "normed", 4),  # post-norms: the residual stream cannot carry a basis, each input pays d²
    ("gemma3", "model", "normed", 4),
])
def test_bytes_skipped_charge_the_rotations(tmp_path, family, rotation, basis, changes):
    model = tiny_model(family)
    ctx = _ctx(model, tmp_path)
    s = 0.5
    plan = fit_method("larosa", ctx, s, rotation=rotation, basis=basis)
    ad = adapter_for(model)
    numel = {(l, p): linear_weight(m).numel() for l, layer in ad.iter_layers(model)
             for p, m in projection_modules(ad, layer).items()}
    width = {p: linear_weight(m).shape[1] for p, m in projection_modules(ad, model.model.layers[0]).items()}
    d = width["q"]
    with torch.no_grad(), apply_sparsity(model, plan) as applied:
        model(input_ids=_tokens(4, 2, 16).windows)
    st = applied.stats
    assert st.extra_numel == changes * d * d
    skipped = sum((1 - keep_count(s, width[p]) / width[p]) * n for (l, p), n in numel.items())
    want = (skipped - changes * d * d) / sum(numel.values())
    assert st.weight_skipped() == pytest.approx(want, abs=1e-12)
    assert (st.weight_skipped() < st.input_sparsity()) == (changes > 0)


# ---------------------------------------------------------------- options and refusals
def test_options_and_refusals(tmp_path):
    model = tiny_model("llama")
    ctx = _ctx(model, tmp_path)
    with pytest.raises(ValueError, match="unknown options"):
        fit_method("larosa", ctx, 0.5, bogus=1)
    with pytest.raises(ValueError, match="rotation must be"):
        fit_method("larosa", ctx, 0.5, rotation="global")
    with pytest.raises(ValueError, match="basis must be"):
        fit_method("larosa", ctx, 0.5, basis="gain")
    with pytest.raises(ValueError, match="read one input"):
        fit_method("larosa", ctx, 0.5, projections=["q", "k"])
    c, _ = ctx.cache.load_cov(1, "ffn_in")                     # basis "scaled": the PCA of g ⊙ n
    g = ctx.lm.model.model.layers[1].post_attention_layernorm.weight.detach().double()
    scaled = fit_method("larosa", ctx, 0.5, rotation="block", basis="scaled")
    assert scaled.part("larosa").scaled and torch.equal(scaled.part("larosa").rotations[1]["ffn_in"],
                                                 pca_rotation(g[:, None] * c * g[None, :])[0])
    assert not torch.equal(scaled.part("larosa").rotations[1]["ffn_in"], pca_rotation(c)[0])
    plan = fit_method("larosa", ctx, 0.5, projections=["gate", "up", "down"])
    assert plan.part("larosa").sparsity[0] == {"ffn_in": 0.5, "down": 0.5} and set(plan.part("larosa").rotations[0]) == {"ffn_in"}
    no_cov = capture_activations(ctx.lm, _tokens(0), components=("inhist",), root=tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="no covariances"):
        fit_method("larosa", FitContext(ctx.lm, no_cov, [0, 1]), 0.5)
    opt = tiny_model("opt")
    with pytest.raises(ValueError, match="supports pre-norm|RMSNorm"):
        fit_method("larosa", _ctx(opt, tmp_path / "opt"), 0.5)


def test_wina_score_ranks_by_the_folded_weights(tmp_path):
    """Score "wina": each token keeps the top-k of |r_j|·‖W'[:, j]‖₂, W' the block's folded consumers stacked
    (gate and up); the kept set is recomputed here from the norm's input, the rotation and the swapped weights."""
    model = tiny_model("llama")
    ctx = _ctx(model, tmp_path)
    s = 0.6
    plan = fit_method("larosa", ctx, s, score="wina", projections=["gate", "up"])
    seen = []
    with torch.no_grad(), apply_sparsity(model, plan):
        mlp, norm = model.model.layers[0].mlp, model.model.layers[0].post_attention_layernorm
        cols = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).float().norm(dim=0)
        torch.testing.assert_close(norm.scale, cols)
        hook = norm.register_forward_hook(lambda m, a, out: seen.append((a[0], out)))
        model(input_ids=_tokens(6, 2, 16).windows)
        hook.remove()
        h, out = seen[0]
        r = rms_normalized(norm.orig, h) @ norm.q
    score = (r.abs() * cols).reshape(-1, 48)
    want = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.topk(keep_count(s, 48), dim=1).indices, True)
    assert torch.equal(out.reshape(-1, 48) != 0, want)
    assert not torch.equal(want, torch.zeros_like(want).scatter_(1, r.reshape(-1, 48).abs().topk(
        keep_count(s, 48), dim=1).indices, True))        # the column norms changed the choice somewhere


def test_registered_and_accepted_by_a_sweep_spec():
    from orchestrator.spec import parse_spec

    spec = parse_spec({"name": "rotated", "models": ["smollm2-135m"],
                       "methods": [{"name": "larosa", "sparsity": [0.3, 0.4],
                                    "options": {"rotation": "none", "basis": "scaled", "score": "wina"}}]})
    assert [m.name for m in spec.methods] == ["larosa"]
    with pytest.raises(ValueError, match="unknown option"):
        parse_spec({"name": "rotated", "models": ["smollm2-135m"],
                    "methods": [{"name": "larosa", "sparsity": [0.3], "options": {"threshold": 0.1}}]})
