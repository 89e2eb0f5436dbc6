"""Activation capture checked by value against forward hooks written here, on every supported family.

Each family's module paths are spelled out below (not read from the architecture adapters), and every component
the capture records is re-derived from the model's own modules during the very same forward pass:

  ``residual``   the input of the attention's pre-norm (the residual stream entering the layer)
  ``ffn_in``     the output of the FFN's pre-norm
  ``gate``       the output of gate_proj (gated MLPs) or of fc1 / c_fc
  ``inter``      the input of down_proj / fc2 / c_proj, and act(gate) * up (or act(fc1)) through the model's own
                 activation module
  ``head_norm``  ‖slice h of o's input‖₂ per head h (slices of head_dim, head_dim from the config), in float64
  ``cov``        (RMSNorm families) Σ n nᵀ with n = h / sqrt(mean(h²) + eps) of each pre-norm's input h, eps from
                 the config, in float64; Σ over a KV group's query heads of a_h a_hᵀ of o's input
  ``inhist``     per projection input, the counts of |x| (x > 0, x <= 0) and of |x_i|·‖W[:, i]‖₂ on the fixed grid,
                 binned here in float64

Tolerances: the captured tensors are stored as float32 (``dtype="float32"``) from the same forward pass the hooks
here watch, so ``residual``, ``ffn_in``, ``gate`` and ``inter`` are the very tensors the model computed: compared
with torch.equal. ``head_norm`` and ``cov`` are sums the capture computes in float32 and the reference in float64:
they are compared within the float32 round-off bound of those sums, with u = 2⁻²⁴ (the unit round-off) and m
terms, |error| <= (m + c)·u·Σ|terms| (c covers the rounding of the terms themselves and of the stored result).
The histograms are compared bin by bin, except for values whose float32 log10 may fall on the other side of a bin
edge than their float64 one (within 2e-3 of a bin width of an edge: each such value can move one count).

The windows start with one prefix token (a BOS, as the tokenizers of real models prepend), which the capture must
not record: every reference below drops each window's first position. OPT also runs without a prefix: its layers
flatten the FFN's input to [batch·tokens, d], which the capture puts back in windows before dropping the prefix.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.workers.tiny_model_support import loaded, tiny_model
from workers.loading.data import TokenSet
from workers.sparsity.capture import COMPONENTS, capture_activations
from workers.sparsity.histograms import BINS, HI, LO

U = 2.0 ** -24                 # float32 unit round-off
N_WIN, SEQ, BOS = 3, 12, 1
LAYERS = (0, 1)

_LLAMA = dict(layers="model.layers", attn_norm="input_layernorm", ffn_norm="post_attention_layernorm",
              q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
              gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj", act="mlp.act_fn", rms=True)
PATHS = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA,
    "gemma3": {**_LLAMA, "ffn_norm": "pre_feedforward_layernorm"},
    "opt": dict(layers="model.decoder.layers", attn_norm="self_attn_layer_norm", ffn_norm="final_layer_norm",
                q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.out_proj",
                gate=None, up="fc1", down="fc2", act="activation_fn", rms=False),
    "gpt2": dict(layers="transformer.h", attn_norm="ln_1", ffn_norm="ln_2", qkv="attn.c_attn", o="attn.c_proj",
                 gate=None, up="mlp.c_fc", down="mlp.c_proj", act="mlp.act", rms=False),
}


def _mod(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


def _weight_out_in(m: nn.Module) -> torch.Tensor:
    """[out, in]: nn.Linear stores it so, GPT-2's Conv1D transposed."""
    return m.weight.detach() if isinstance(m, nn.Linear) else m.weight.detach().t()


class _Watch:
    """Forward hooks that keep, per name, each call's tensor as [tokens without the prefix, width]."""

    def __init__(self, prefix: int):
        self.prefix = prefix
        self.seen: dict[str, list[torch.Tensor]] = {}
        self.handles = []

    def _keep(self, name, x):
        x = x.detach().reshape(-1, SEQ, x.shape[-1])[:, self.prefix:]       # OPT's FFN sees [B·T, d]: same tokens
        self.seen.setdefault(name, []).append(x.reshape(-1, x.shape[-1]).clone())

    def input_of(self, name, module):
        def hook(m, args, kwargs):
            self._keep(name, args[0] if args else next(iter(kwargs.values())))
        self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def output_of(self, name, module):
        def hook(m, args, out):
            self._keep(name, out[0] if isinstance(out, tuple) else out)
        self.handles.append(module.register_forward_hook(hook))

    def __getitem__(self, name) -> torch.Tensor:
        return torch.cat(self.seen[name])

    def close(self):
        for h in self.handles:
            h.remove()


def _assert_sum_close(got: torch.Tensor, want: torch.Tensor, abs_terms: torch.Tensor, m: int, c: int, what: str):
    """|got - want| <= (m + c)·u·Σ|terms| + u·|want| (a float32 sum of m terms, stored as float32)."""
    err = (got.double() - want).abs()
    bound = (m + c) * U * abs_terms + U * want.abs()
    assert bool((err <= bound).all()), f"{what}: max error {err.max():.3g}, worst error/bound " \
                                       f"{(err / bound.clamp_min(1e-300)).max():.3g}"


def _grid_bins(log10a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bin of each value on the grid of LO, HI, BINS: bin 0 below 10^LO, bins 1..BINS equal steps of log10, bin
    BINS+1 from 10^HI; whether it lies within 2e-3 of a bin width of an inner edge)."""
    pos = (log10a - LO) / ((HI - LO) / BINS)
    b = (pos.floor() + 1).clamp(0, BINS + 1).long()
    near = ((pos - pos.round()).abs() < 2e-3) & (pos > -1) & (pos < BINS + 1)
    return b, near


def _assert_hist(got: torch.Tensor, x: torch.Tensor, colnorm: torch.Tensor, what: str):
    x = x.double()
    a = x.abs()
    la = torch.where(a > 0, a.log10(), torch.full_like(a, -1e9))
    rows = [la[x > 0], la[x <= 0], (la + colnorm.double().log10()).reshape(-1)]
    assert got.shape == (3, BINS + 2), what
    for i, lv in enumerate(rows):
        b, near = _grid_bins(lv)
        want = torch.bincount(b, minlength=BINS + 2)
        assert int(got[i].sum()) == lv.numel(), f"{what} row {i}: count"
        assert int((got[i].long() - want).abs().sum()) <= 2 * int(near.sum()), f"{what} row {i}: bins"
    assert int(got[0].sum()) == int((x > 0).sum())


@pytest.mark.parametrize("family,prefix", [
    *[(f, 1) for f in PATHS], ("opt", 0)])   # OPT flattens its FFN's input to [batch·tokens, d]: with and without a prefix
def test_every_component_matches_hooks_on_the_models_own_modules(family, prefix, tmp_path):
    P = PATHS[family]
    model = tiny_model(family)
    cfg = model.config
    n_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    lm = loaded(model, family)
    windows = torch.randint(0, 128, (N_WIN, SEQ), generator=torch.Generator().manual_seed(11))
    windows[:, :prefix] = BOS
    n_tok = N_WIN * (SEQ - prefix)
    toks = TokenSet(windows, "random", "calib", n_tok, prefix, f"ref-{family}-{prefix}")

    watch = _Watch(prefix)
    proj_paths = {p: P[p] for p in ("qkv", "q", "k", "v", "o", "gate", "up", "down") if P.get(p)}
    for l in LAYERS:
        layer = _mod(model, P["layers"])[l]
        watch.input_of(f"{l}.attn_norm_in", _mod(layer, P["attn_norm"]))
        watch.input_of(f"{l}.ffn_norm_in", _mod(layer, P["ffn_norm"]))
        watch.output_of(f"{l}.ffn_norm_out", _mod(layer, P["ffn_norm"]))
        watch.output_of(f"{l}.gate", _mod(layer, P["gate"] or P["up"]))
        watch.output_of(f"{l}.up", _mod(layer, P["up"]))
        for p, path in proj_paths.items():
            watch.input_of(f"{l}.{p}.in", _mod(layer, path))
    try:
        # batches of 2 windows: the tokens of a batch and of successive batches must come out in order
        cache = capture_activations(lm, toks, components=COMPONENTS, layers=list(LAYERS), root=tmp_path,
                                    dtype="float32", batch_windows=2, progress=False)
    finally:
        watch.close()
    assert len(watch.seen["0.attn_norm_in"]) == 2 and cache.n_tokens == n_tok

    for l in LAYERS:
        layer = _mod(model, P["layers"])[l]
        residual, ffn_in = watch[f"{l}.attn_norm_in"], watch[f"{l}.ffn_norm_out"]
        gate, inter, o_in = watch[f"{l}.gate"], watch[f"{l}.down.in"], watch[f"{l}.o.in"]
        assert residual.shape == (n_tok, cfg.hidden_size) and o_in.shape == (n_tok, n_heads * head_dim)
        assert torch.equal(cache.load(l, "residual"), residual), f"{family} layer {l} residual"
        assert torch.equal(cache.load(l, "ffn_in"), ffn_in), f"{family} layer {l} ffn_in"
        assert torch.equal(cache.load(l, "gate"), gate), f"{family} layer {l} gate"
        assert torch.equal(cache.load(l, "inter"), inter), f"{family} layer {l} inter"
        # the intermediate is act(gate) * up, or act(fc1), through the model's own activation module
        act = _mod(layer, P["act"])
        with torch.no_grad():
            want_inter = act(gate) * watch[f"{l}.up"] if P["gate"] else act(gate)
        # recomputed on another batching than the model's forward: torch's activation kernels round a vector's
        # lanes and its scalar tail differently (AVX-512 builds: one element of 2,640 one ulp apart)
        torch.testing.assert_close(inter, want_inter, rtol=4 * U, atol=4 * U * float(want_inter.abs().max()),
                                   msg=f"{family} layer {l}: down's input is not act(gate)*up")

        heads = torch.stack([o_in[:, h * head_dim:(h + 1) * head_dim].double().pow(2).sum(-1).sqrt()
                             for h in range(n_heads)], dim=1)
        got = cache.load(l, "head_norm")
        assert got.shape == (n_tok, n_heads)
        # ‖·‖₂ of head_dim float32 values: a sum of head_dim squares, halved by the square root, + rounding
        torch.testing.assert_close(got.double(), heads, rtol=(head_dim + 4) * U, atol=0)

        for p in proj_paths:
            _assert_hist(cache.load_hist(l, p), watch[f"{l}.{p}.in"],
                         _weight_out_in(_mod(layer, proj_paths[p])).float().norm(dim=0)[None, :].expand(n_tok, -1),
                         f"{family} layer {l} inhist {p}")

        if not P["rms"]:        # LayerNorm families: no covariances recorded
            with pytest.raises(KeyError, match="no covariance"):
                cache.load_cov(l, "attn_in")
            continue
        eps = cfg.rms_norm_eps
        batch_tokens = 2 * (SEQ - prefix)        # float32 sums per batch; across batches float64
        for name, key in (("attn_in", f"{l}.attn_norm_in"), ("ffn_in", f"{l}.ffn_norm_in")):
            h = watch[key].double()
            n = h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt()
            got, count = cache.load_cov(l, name)
            assert count == n_tok and got.shape == (cfg.hidden_size,) * 2
            # n in float32: its mean of d squares and rsqrt, about (d/2 + 4)·u relative per entry, twice per product
            _assert_sum_close(got, n.t() @ n, n.abs().t() @ n.abs(), batch_tokens, cfg.hidden_size + 12,
                              f"{family} layer {l} cov {name}")
        rep = n_heads // n_kv
        a = o_in.double().reshape(n_tok, n_kv, rep, head_dim).transpose(0, 1).reshape(n_kv, -1, head_dim)
        got, _ = cache.load_cov(l, "o")
        assert got.shape == (n_kv, head_dim, head_dim)
        _assert_sum_close(got, a.transpose(1, 2) @ a, a.abs().transpose(1, 2) @ a.abs(), batch_tokens * rep, 4,
                          f"{family} layer {l} cov o")

    # the head's input: the decoder's output after its last norm, batch by batch as the capture ran it
    with torch.no_grad():
        final = torch.cat([model.base_model(input_ids=windows[i:i + 2], use_cache=False).last_hidden_state
                           for i in range(0, N_WIN, 2)])
    assert torch.equal(cache.load_final(), final[:, prefix:].reshape(n_tok, -1)), f"{family} final"

