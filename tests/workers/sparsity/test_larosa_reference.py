"""LaRoSA at s > 0 against a reference written here, for one layer of a tiny Llama.

The reference, from the definitions (Liu et al., arXiv 2507.01299; ``workers.methods.larosa``):

1. The rotation. The layer's calibration block inputs h (the inputs of its two RMSNorms, recorded here with hooks
   on the same calibration windows) give n = h / sqrt(mean(h²) + eps) (eps from the config) and x = n (basis
   "normed") or x = g ⊙ n (basis "scaled", g the norm's gain); C = Σ x xᵀ in float64, summed over both block
   inputs (rotation "layer") or one per block input (rotation "block"). Q is the PCA basis of C: QᵀCQ diagonal,
   eigenvalues in decreasing order. The plan's Q is checked to be that basis: Qᵀ C Q against diag(eigenvalues of
   C) -- which pins every column up to its sign (a sign flip changes neither the top-k nor the product) without
   comparing eigenvectors directly (near-equal eigenvalues would make that ill-conditioned). o's rotation per KV
   group likewise, from Σ over the group's query heads of a_h a_hᵀ (a: o's input).
2. The masked layer. On evaluation tokens, each block input h the swapped norm receives is rotated, r = x·Q (Q
   the plan's, validated in 1., in float64), each token keeps its k = round((1 - s)·d) entries of largest |r_j|,
   the rest zeroed, and is rotated back, x̂ = r_k·Qᵀ, (⊙ g for "normed": the gain is folded into the
   consumers); q/k/v and gate/up are then the dense weights on x̂ (v rotated per KV head by o's R). o's input a'
   (in R's basis) keeps its top-k |a'| and is rotated back per head, down's input keeps its top-k |x| unrotated.
   Each is compared with what the library's masked mode computes; every token's count of kept entries is exact.

Tolerances: the reference is float64 on the library's own float32 inputs. The library computes n, r and the
products in float32 (unit round-off u = 2⁻²⁴) with float32 folded weights W'. Each rotated entry is off by at most
c_r·u·Σ_i |x_i||Q_ij| (c_r = 1.5·d + 10: n's mean of d squares and rsqrt, then r's sum of d products), each
output by Σ_j |W'_oj|·(that) + (d + 2)·u·Σ_j |r_j||W'_oj| + u·|y_o|. A token whose k-th and (k+1)-th |r_j| lie
within twice the entry bound could keep another entry in float32 than in float64: such tokens are left out of
the value comparisons (none are with these seeds; at most a few are allowed), never out of the count. The
calibration covariance the plan is fitted from is a float32 sum of N = 128 tokens per forward batch (4 windows of
32), stored as float32: QᵀCQ - diag(λ) is bounded by 2·‖ΔC‖_F + 3·u·sqrt(d)·λ_max, with
|ΔC_ij| <= (N + d + 12)·u·Σ|x_i||x_j| + u·|C_ij| (and Q's own rounding to float32).
"""
from __future__ import annotations

import pytest
import torch

from tests.workers.tiny_model_support import loaded, tiny_model
from workers.loading.data import TokenSet
from workers.sparsity.capture import capture_activations
from workers.sparsity.predictors import FitContext, fit_method
from workers.sparsity.sparse_exec import apply_sparsity

U = 2.0 ** -24
LAYER = 1
CALIB_WINDOWS, CALIB_LEN, CAPTURE_BATCH = 8, 32, 4
# k = round((1 - s)·n) kept per token, for the block inputs (d = 48), o's input (4 heads of 12) and down's (D = 80)
KEEP = {0.3: {"d": 34, "o": 34, "D": 56}, 0.5: {"d": 24, "o": 24, "D": 40}}


def _windows(seed: int, n: int, length: int) -> torch.Tensor:
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(seed))


class _Hooks:
    def __init__(self):
        self.seen, self.handles = {}, []

    def inp(self, name, mod):
        self.handles.append(mod.register_forward_pre_hook(
            lambda m, a: self.seen.setdefault(name, []).append(a[0].detach().clone())))

    def out(self, name, mod):
        self.handles.append(mod.register_forward_hook(
            lambda m, a, o: self.seen.setdefault(name, []).append(o.detach().clone())))

    def __getitem__(self, name):
        return torch.cat([t.reshape(-1, t.shape[-1]) for t in self.seen[name]]).double()

    def close(self):
        for h in self.handles:
            h.remove()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_model("llama")
    lm = loaded(model, "tiny-larosa-ref")
    calib = _windows(0, CALIB_WINDOWS, CALIB_LEN)
    toks = TokenSet(calib, "random", "calib", calib.numel(), 0, "larosa-ref-calib")
    cache = capture_activations(lm, toks, root=tmp_path_factory.mktemp("acts"), progress=False, dtype="float32",
                                batch_windows=CAPTURE_BATCH)
    layer = model.model.layers[LAYER]
    hooks = _Hooks()
    hooks.inp("attn_in", layer.input_layernorm)
    hooks.inp("ffn_in", layer.post_attention_layernorm)
    hooks.inp("o", layer.self_attn.o_proj)
    with torch.no_grad():
        for i in range(0, CALIB_WINDOWS, CAPTURE_BATCH):       # the capture's batches: the same float32 numbers
            model.model(input_ids=calib[i:i + CAPTURE_BATCH], use_cache=False)
    hooks.close()
    dense = {name: mod.weight.detach().double().clone() for name, mod in (
        ("attn_in", layer.input_layernorm), ("ffn_in", layer.post_attention_layernorm),
        ("q", layer.self_attn.q_proj), ("k", layer.self_attn.k_proj), ("v", layer.self_attn.v_proj),
        ("o", layer.self_attn.o_proj), ("gate", layer.mlp.gate_proj), ("up", layer.mlp.up_proj),
        ("down", layer.mlp.down_proj))}
    assert all(getattr(layer.self_attn, p).bias is None for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    return model, FitContext(lm, cache, [0, 1]), {k: hooks[k] for k in ("attn_in", "ffn_in", "o")}, dense


def _normed(h: torch.Tensor, eps: float) -> torch.Tensor:
    return h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def _assert_pca_basis(q: torch.Tensor, c: torch.Tensor, b: torch.Tensor, n_batch: int, what: str):
    """q (float32, columns) is the eigenbasis of c in decreasing order of eigenvalue (module doc: the bound)."""
    q = q.double()
    dim = q.shape[-1]
    lam = torch.linalg.eigvalsh(c).flip(-1)
    dc = (n_batch + dim + 12) * U * b + U * c.abs()
    tol = 2 * dc.norm() + 3 * U * dim ** 0.5 * lam[0]
    m = q.t() @ c @ q
    err = (m - torch.diag(lam)).abs().max()
    assert err <= tol, f"{what}: QᵀCQ off diag(eigenvalues, decreasing) by {err:.3g} > {tol:.3g} (λ_max {lam[0]:.3g})"
    assert (q.t() @ q - torch.eye(dim, dtype=q.dtype)).abs().max() < 10 * U * dim


def _topk_mask(score: torch.Tensor, k: int) -> torch.Tensor:
    idx = score.argsort(dim=-1, descending=True, stable=True)[:, :k]
    return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True)


def _assert_bounded(got, want, bound, what):
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"{what}: max error {err.max():.3g}, worst error/bound " \
                                       f"{(err / bound.clamp_min(1e-300)).max():.3g}"


@pytest.mark.parametrize("s", [0.3, 0.5])
@pytest.mark.parametrize("rotation,basis", [("layer", "normed"), ("block", "scaled")])
def test_masked_layer_matches_a_hand_written_rotated_topk(setup, s, rotation, basis):
    model, ctx, calib, dense = setup
    cfg = model.config
    d, D, n_heads, n_kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd, rep, eps = d // n_heads, n_heads // n_kv, cfg.rms_norm_eps
    scaled = basis == "scaled"
    k = KEEP[s]
    assert k == {"d": round((1 - s) * d), "o": round((1 - s) * n_heads * hd), "D": round((1 - s) * D)}

    plan = fit_method("larosa", ctx, {0: 0.0, LAYER: s}, rotation=rotation, basis=basis)
    rot = plan.part("larosa").rotations[LAYER]
    assert set(rot) == {"attn_in", "ffn_in", "o"} and list(plan.part("larosa").rotations) == [LAYER]

    # ---- 1. the rotations are the PCA bases of the calibration inputs
    xs = {}
    for g in ("attn_in", "ffn_in"):
        x = _normed(calib[g], eps)
        xs[g] = x * dense[g] if scaled else x
    n_batch = CAPTURE_BATCH * CALIB_LEN
    if rotation == "layer":
        assert rot["attn_in"] is rot["ffn_in"] or torch.equal(rot["attn_in"], rot["ffn_in"])
        c = sum(x.t() @ x for x in xs.values())
        b = sum(x.abs().t() @ x.abs() for x in xs.values())
        _assert_pca_basis(rot["attn_in"], c, b, n_batch, "layer Q")
    else:
        for g, x in xs.items():
            _assert_pca_basis(rot[g], x.t() @ x, x.abs().t() @ x.abs(), n_batch, f"{g} Q")
    a = calib["o"].reshape(-1, n_kv, rep, hd).transpose(0, 1).reshape(n_kv, -1, hd)
    for g in range(n_kv):
        _assert_pca_basis(rot["o"][g], a[g].t() @ a[g], a[g].abs().t() @ a[g].abs(), n_batch * rep, f"o R[{g}]")

    # ---- 2. the masked layer on evaluation tokens
    layer = model.model.layers[LAYER]
    hooks = _Hooks()
    with torch.no_grad(), apply_sparsity(model, plan):
        attn, mlp = layer.self_attn, layer.mlp
        for name, mod in (("h_attn", layer.input_layernorm), ("h_ffn", layer.post_attention_layernorm),
                          ("o_in", attn.o_proj), ("o_kept", attn.o_proj.lin), ("down_in", mlp.down_proj),
                          ("down_kept", mlp.down_proj.lin)):
            hooks.inp(name, mod)
        for name, mod in (("r_attn", layer.input_layernorm), ("r_ffn", layer.post_attention_layernorm),
                          ("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("gate", mlp.gate_proj),
                          ("up", mlp.up_proj), ("o", attn.o_proj), ("down", mlp.down_proj)):
            hooks.out(name, mod)
        folded = {p: getattr(attn if p in ("q", "k", "v") else mlp, f"{p}_proj").weight.detach().double().abs()
                  for p in ("q", "k", "v", "gate", "up")}
        folded["o"] = attn.o_proj.lin.weight.detach().double().abs()
        model(input_ids=_windows(7, 2, 24), use_cache=False)
        hooks.close()
    n_tok = 2 * 24
    r_o = rot["o"].double()
    compared = 0

    for g, h_name, r_name, consumers in (("attn_in", "h_attn", "r_attn", ("q", "k", "v")),
                                         ("ffn_in", "h_ffn", "r_ffn", ("gate", "up"))):
        q = rot[g].double()
        x = _normed(hooks[h_name], eps)
        if scaled:
            x = x * dense[g]
        r = x @ q
        err_r = (1.5 * d + 10) * U * (x.abs() @ q.abs())
        mask = _topk_mask(r.abs(), k["d"])
        srt = r.abs().sort(dim=-1, descending=True).values
        tie = (srt[:, k["d"] - 1] - srt[:, k["d"]]) <= 2 * err_r.max(-1).values
        ok = ~tie
        assert int(tie.sum()) <= 2, f"{g}: {int(tie.sum())} tokens with a near tie at the k-th entry"
        compared += int(ok.sum())
        r_lib = hooks[r_name]
        # exact per-token sparsity: every token keeps exactly k of d
        assert torch.equal((r_lib != 0).sum(-1), torch.full((n_tok,), k["d"])), f"{g}: kept count"
        assert torch.equal((r_lib != 0)[ok], mask[ok]), f"{g}: kept set"
        rk = r * mask
        _assert_bounded(r_lib[ok], rk[ok], (err_r * mask + U * rk.abs())[ok], f"{g}: rotated entries")
        x_hat = rk @ q.t()                                  # rotated back
        if not scaled:
            x_hat = x_hat * dense[g]                        # the gain the consumers carry
        for p in consumers:
            y = x_hat @ dense[p].t()
            if p == "v":                                    # v' = R_gᵀ v per KV head
                y = torch.einsum("tgi,gij->tgj", y.reshape(n_tok, n_kv, hd), r_o).reshape(n_tok, -1)
            bound = U * ((err_r * mask) @ folded[p].t() + (d + 2) * rk.abs() @ folded[p].t() + y.abs())
            _assert_bounded(hooks[p][ok], y[ok], bound[ok], f"{g}: {p} output")

    for name, w_abs, w, kk in (("o", folded["o"], dense["o"], k["o"]),
                               ("down", dense["down"].abs(), dense["down"], k["D"])):
        x = hooks[f"{name}_in"]
        mask = _topk_mask(x.abs(), kk)
        kept = hooks[f"{name}_kept"]
        assert torch.equal((kept != 0).sum(-1), torch.full((n_tok,), kk)), f"{name}: kept count"
        assert torch.equal(kept, torch.where(mask, x, 0)), f"{name}: kept set"
        xk = x * mask
        if name == "o":         # rotated back per query head, by its KV group's R: a_h = a'_h R_gᵀ
            xk = torch.einsum("thj,hij->thi", xk.reshape(n_tok, n_heads, hd),
                              r_o.repeat_interleave(rep, dim=0)).reshape(n_tok, -1)
        y = xk @ w.t()
        bound = U * ((x.shape[-1] + 2) * (x * mask).abs() @ w_abs.t() + y.abs())
        _assert_bounded(hooks[name], y, bound, f"{name} output")
    assert compared >= 2 * n_tok - 4
