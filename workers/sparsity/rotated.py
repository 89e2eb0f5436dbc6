"""Rotated input sparsity (LaRoSA) on a Hugging Face model: each block input is rotated into a basis where few
entries carry the signal, and every token keeps exactly its top-k entries there.

Reference: Liu et al., "LaRoSA: Enhancing LLM Efficiency via Layerwise Rotated Sparse Activation", ICML 2025
(arXiv 2507.01299; code alibaba/EfficientAI, ``larosa/``). The rotations are fitted by
:mod:`workers.sparsity.predictors.larosa`; this module puts a :class:`RotatedPlan` on a model.

A layer has four distinct projection inputs (``GROUPS``): the attention's block input (read by q, k, v), the
attention output (o), the FFN's block input (gate, up) and the FFN intermediate (down). With a pre-norm RMSNorm
x = g ⊙ n, n = h / rms(h), and an orthogonal Q (its columns a basis), a consumer W of x computes

    W x = (W diag(g) Q) (Qᵀ n) = W' r,      r = Qᵀ n,  W' = W diag(g) Q

(the norm's gain folded into the next linear first, then the rotation: SliceGPT / QuaRot's computational
invariance). Each token keeps the k = round((1 - s)·d) entries of r with the largest |r_j| (or, option ``wina``,
|r_j|·‖W'[:, j]‖₂ over the block's consumers stacked), so every token has exactly the target sparsity, and W'
reads only those k columns. o's input gets a rotation per KV head group, R_g [head_dim, head_dim], folded into v
(rows: v' = R_gᵀ v) and into o (columns: W_o' = W_o R_g per query head of the group): attention is linear in v,
so this costs nothing at run time. down's input follows a nonlinearity, so a rotation there would be a D×D
product per token (more bytes than down itself): down keeps its top-k |x| unrotated, as the reference code does.

**What the rotation costs** (``rotation_numel``, charged in "decoder bytes skipped" by
``input_sparse.decoder_weight_skipped``). Where block outputs go straight into the residual stream (Llama,
Mistral, Qwen2) the residual stream itself can be carried in the basis of the next rotated input: rms(h Q) =
rms(h), so norm(h Q) = n Q, and the outputs of o and down are rotated by folding Qᵀ into their rows. A change of
basis between two rotated inputs is then one d×d product on the residual stream (the paper's adapter
Q_lᵀ Q_{l+1}); the first basis folds into (an untied copy of) the embeddings and the last into the LM head, at no
extra bytes per token. So: one d² per change between consecutive rotated inputs (a rotation per layer: L - 1;
one per block input: 2L - 1; one for the whole model: 0). Where a block output passes a norm with a gain before
the residual add (Gemma-3's post-norms), the residual stream cannot be rotated (the gain is diagonal in the
original basis): every rotated input is an explicit d×d product per token, d² each. The reference code rotates
the norm's output g ⊙ n instead (``RotatedPlan.scaled``: PCA of g ⊙ n, W' = W Q); the residual stream never
carries that basis, so it is charged d² per rotated input on every model.

Masked mode here (the exact function, dense products with the dropped entries zeroed; the decode runtime's
deployable form is workers.decode.rotate): the pre-norm is swapped
for a :class:`RotatedTopKNorm` that emits the masked r, the consumers for plain ``nn.Linear`` with the folded
weights W', o and down for a :class:`TopKInputLinear`. The simulation rotates online at every rotated input; the
bytes charged are those of the deployable form above. Realized sparsities are counted in
``input_sparse.InputStats`` like TEAL's. ``.revert()`` restores the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from workers.loading.adapters import adapter_for, get_path, linear_weight, norm_gain
from workers.sparsity.input_sparse import InputStats, model_projection_numel, projection_paths
from workers.sparsity.swaps import ModuleSwaps

GROUPS = ("attn_in", "o", "ffn_in", "down")
GROUP_PROJECTIONS = {"attn_in": ("q", "k", "v"), "o": ("o",), "ffn_in": ("gate", "up"), "down": ("down",)}
BLOCK_INPUTS = ("attn_in", "ffn_in")            # the rotations that act on the normalized residual stream
ROTATABLE = BLOCK_INPUTS + ("o",)
SCORES = ("abs", "wina")


# ---------------------------------------------------------------- the plan
@dataclass
class RotatedPlan:
    """{layer: {group: s}} (groups of ``GROUPS``; absent = dense) and {layer: {group: rotation}}: ``attn_in`` /
    ``ffn_in`` an orthogonal Q [d, d] (columns the basis), ``o`` R [n_kv_heads, head_dim, head_dim]. A sparse
    block input without a rotation keeps its top-k entries of the norm's own output (no rotation). ``scaled``:
    the block-input rotations act on the norm's output x = g ⊙ n (r = Qᵀ x, W' = W Q: the reference code's form)
    instead of on n; the residual stream cannot carry that basis, so each is an explicit d×d product."""
    sparsity: dict[int, dict[str, float]] = field(default_factory=dict)
    rotations: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    score: str = "abs"
    scaled: bool = False

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"rotated top-k score must be one of {SCORES}, got {self.score!r}")
        for l, per in self.sparsity.items():
            bad = set(per) - set(GROUPS)
            if bad:
                raise ValueError(f"layer {l}: unknown input groups {sorted(bad)}; known: {GROUPS}")
            for g, s in per.items():
                if not 0.0 <= s < 1.0:
                    raise ValueError(f"layer {l} {g}: sparsity must be in [0, 1), got {s}")
        for l, per in self.rotations.items():
            bad = set(per) - set(ROTATABLE)
            if bad:
                raise ValueError(f"layer {l}: no rotation for {sorted(bad)}; rotatable: {ROTATABLE}")

    def layers(self) -> list[int]:
        return sorted(set(self.sparsity) | set(self.rotations))


def keep_count(s: float, n: int) -> int:
    """Entries a token keeps of ``n`` at sparsity ``s``: n - round(s·n), at least 1."""
    return max(1, n - int(round(s * n)))


def topk_keep(score: torch.Tensor, k: int) -> torch.Tensor:
    """bool [T, n]: each row's ``k`` largest scores (exactly k per row, ties broken by position)."""
    keep = torch.zeros_like(score, dtype=torch.bool)
    if k >= score.shape[-1]:
        return keep.fill_(True)
    return keep.scatter_(-1, score.topk(k, dim=-1).indices, True)


# ---------------------------------------------------------------- norms
def is_rms_norm(norm: nn.Module) -> bool:
    """An RMSNorm (no mean subtraction, no bias): what the rotation commutes with."""
    return type(norm).__name__.endswith("RMSNorm") and (hasattr(norm, "variance_epsilon") or hasattr(norm, "eps"))


def rms_normalized(norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """n = h / rms(h) as the RMSNorm ``norm`` computes it before its gain (float32, or h's dtype if wider)."""
    if not is_rms_norm(norm):
        raise ValueError(f"{type(norm).__name__} is not an RMSNorm: rotated input sparsity needs one")
    eps = getattr(norm, "variance_epsilon", None)
    eps = norm.eps if eps is None else eps
    x = h.to(torch.promote_types(h.dtype, torch.float32))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ---------------------------------------------------------------- modules
class RotatedTopKNorm(nn.Module):
    """Replaces a block's pre-norm: emits each token's top-k of r = Qᵀ n (``q`` given; n before the gain, which the
    consumers carry) or of the norm's own output (``q`` None), the other entries zero."""

    def __init__(self, orig: nn.Module, q: torch.Tensor | None, k: int, scale: torch.Tensor | None, layer: int,
                 projections: tuple[str, ...], stats: InputStats, scaled: bool = False):
        super().__init__()
        self.orig = orig                       # kept so revert and state_dict see the same parameters
        self.k, self.layer, self.projections, self._stats, self.scaled = k, layer, projections, stats, scaled
        self.register_buffer("q", None if q is None else q.detach().clone(), persistent=False)
        self.register_buffer("scale", None if scale is None else scale.detach().float(), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.q is None:
            r = self.orig(h)
        else:
            n = self.orig(h) if self.scaled else rms_normalized(self.orig, h)
            n = n.to(torch.promote_types(n.dtype, torch.float32))
            r = n @ self.q.to(n.dtype)
        score = r.abs() if self.scale is None else r.abs() * self.scale.to(r.dtype)
        keep = topk_keep(score.reshape(-1, r.shape[-1]), self.k).reshape(r.shape)
        t = keep.shape[:-1].numel()
        for p in self.projections:
            self._stats.add(self.layer, p, t * r.shape[-1], t * self.k)
        return (r * keep).to(h.dtype)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, k={self.k}, rotated={self.q is not None}, scaled={self.scaled}, " \
               f"score={'wina' if self.scale is not None else 'abs'}, feeds={','.join(self.projections)}"


class TopKInputLinear(nn.Module):
    """A projection that uses only each token's k largest inputs (|x|, or |x_i|·‖W[:, i]‖₂ with ``scale``)."""

    def __init__(self, lin: nn.Module, k: int, scale: torch.Tensor | None, layer: int, proj: str, stats: InputStats):
        super().__init__()
        self.lin = lin
        self.k, self.layer, self.proj, self._stats = k, layer, proj, stats
        self.register_buffer("scale", None if scale is None else scale.detach().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        score = x.abs() if self.scale is None else x.abs() * self.scale.to(x.dtype)
        keep = topk_keep(score.reshape(-1, x.shape[-1]), self.k).reshape(x.shape)
        t = keep.shape[:-1].numel()
        self._stats.add(self.layer, self.proj, t * x.shape[-1], t * self.k)
        return self.lin(torch.where(keep, x, 0))

    def extra_repr(self) -> str:
        return f"layer={self.layer}, proj={self.proj}, k={self.k}, score={'wina' if self.scale is not None else 'abs'}"


def folded_linear(orig: nn.Module, gain: torch.Tensor | None = None, q: torch.Tensor | None = None,
                  row_rot: torch.Tensor | None = None, col_rot: torch.Tensor | None = None) -> nn.Linear:
    """A new ``nn.Linear`` computing ``orig`` on the rotated input: W' = Rᵀ W diag(g) Q (``row_rot`` R, block
    diagonal [groups, b, b] over the output rows; its bias rotated likewise), or W' = W blockdiag(``col_rot``)
    (o's input: [heads, b, b], one block per head). Computed in float64, stored in ``orig``'s dtype and device."""
    w0 = linear_weight(orig).detach()
    w = w0.double()
    bias = getattr(orig, "bias", None)
    b = None if bias is None else bias.detach().double()
    if gain is not None:
        w = w * gain.to(w.device, torch.float64)[None, :]
    if q is not None:
        w = w @ q.to(w.device, torch.float64)
    if row_rot is not None:
        g, bs, _ = row_rot.shape
        r = row_rot.to(w.device, torch.float64)
        w = (r.transpose(1, 2) @ w.reshape(g, bs, -1)).reshape(g * bs, -1)
        if b is not None:
            b = (r.transpose(1, 2) @ b.reshape(g, bs, 1)).reshape(-1)
    if col_rot is not None:
        h, bs, _ = col_rot.shape
        r = col_rot.to(w.device, torch.float64)
        w = (w.reshape(-1, h, 1, bs) @ r[None]).reshape(w.shape[0], h * bs)
    out = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w0.device, dtype=w0.dtype)
    with torch.no_grad():
        out.weight.copy_(w.to(w0.dtype))
        if b is not None:
            out.bias.copy_(b.to(w0.dtype))
    return out


def _col_norms(*mods: nn.Module) -> torch.Tensor:
    """‖W[:, j]‖₂ over the rows of every module stacked (the WINA weight of a shared input), float32."""
    return torch.cat([linear_weight(m).detach().float() for m in mods]).norm(dim=0)


# ---------------------------------------------------------------- support and cost
def check_model(model: nn.Module) -> None:
    """Rotated input sparsity needs RMSNorm pre-norms before separate q/k/v and a gated FFN (Llama, Mistral,
    Qwen2, Gemma-3); a clear error otherwise."""
    ad = adapter_for(model)
    if ad.attn.qkv_fused or not ad.ffn.gated or not ad.attn.norm or not ad.ffn.norm:
        raise ValueError(f"rotated input sparsity supports pre-norm models with separate q/k/v and a gated FFN; "
                         f"{ad.family} is not one")
    layer = ad.decoder_layers(model)[0]
    for path in (ad.attn.norm, ad.ffn.norm):
        if not is_rms_norm(get_path(layer, path)):
            raise ValueError(f"rotated input sparsity needs RMSNorm block norms; {ad.family}'s {path} is "
                             f"{type(get_path(layer, path)).__name__}")


def residual_foldable(model: nn.Module) -> bool:
    """Block outputs go straight into the residual stream (no gain-carrying norm after them): the rotations can
    be carried by the residual stream itself."""
    return not adapter_for(model).ffn.post_norm


def residual_bases(plan: RotatedPlan, n_layers: int, foldable: bool) -> "ResidualBases":
    """Where the deployable form changes the residual stream's basis (module doc), the one map both the bytes
    charged (:func:`rotation_numel`) and the decode runtime (workers.decode.rotate) follow.

    Walk the block inputs in order (layer by layer, ``attn_in`` then ``ffn_in``). A rotated input wants its Q; a
    sparse input without a rotation wants the original basis (its top-k is over the norm's own output); a dense
    one takes whatever basis the stream is in. ``foldable`` (the residual stream can carry a basis, and the plan is
    not ``scaled``): the stream starts in the first wanted basis (folded into the embeddings), and each input that
    wants another basis than the stream's gets an adapter there (one d×d product on the stream); the LM head takes
    the last basis. Otherwise the stream stays in the original basis and every rotated input is an explicit d×d
    product on its normed input (``explicit``)."""
    wants = []
    for l in range(n_layers):
        rot, sp = plan.rotations.get(l, {}), plan.sparsity.get(l, {})
        for g in BLOCK_INPUTS:
            q = rot.get(g)
            wants.append(((l, g), q if q is not None else (IDENTITY if sp.get(g, 0.0) > 0 else None)))
    if not foldable or plan.scaled:
        return ResidualBases(explicit={key: q for key, q in wants if q is not None and q is not IDENTITY})
    first = next((q for _, q in wants if q is not None), IDENTITY)
    cur, at, adapters = first, {}, {}
    for key, q in wants:
        if q is not None and not _same(q, cur):
            adapters[key] = (cur, q)
            cur = q
        at[key] = cur
    return ResidualBases(initial=first, at=at, adapters=adapters, final=cur)


IDENTITY = "identity"        # the original basis, in ResidualBases


def _same(a, b) -> bool:
    if a is IDENTITY or b is IDENTITY:
        return a is b
    return a is b or (a.shape == b.shape and torch.equal(a, b))


@dataclass
class ResidualBases:
    """:func:`residual_bases`: ``initial`` (the embeddings'), ``at[(l, group)]`` (the stream's basis at that block
    input, after its adapter), ``adapters[(l, group)]`` = (from, to), ``final`` (the LM head's); or, explicit form,
    ``explicit[(l, group)]`` = Q. A basis is an orthogonal [d, d] (its columns) or ``IDENTITY``."""
    initial: object = IDENTITY
    at: dict = field(default_factory=dict)
    adapters: dict = field(default_factory=dict)
    final: object = IDENTITY
    explicit: dict = field(default_factory=dict)

    def products(self) -> int:
        """d×d products per token: the adapters, or the explicit rotations."""
        return len(self.adapters) + len(self.explicit)


def rotation_numel(model: nn.Module, plan: RotatedPlan) -> int:
    """Weight elements read per token by the rotations themselves in the deployable form (module doc): d² per
    adapter where the residual stream carries the bases, else d² per rotated block input
    (:func:`residual_bases`). o's rotations fold into v and o: none."""
    ad = adapter_for(model)
    d = ad.dims(model.config).d
    bases = residual_bases(plan, len(ad.decoder_layers(model)), residual_foldable(model))
    return bases.products() * d * d


# ---------------------------------------------------------------- apply
@dataclass
class AppliedRotated(ModuleSwaps):
    model: nn.Module
    stats: InputStats
    extra_numel: int = 0

    def __post_init__(self):
        ModuleSwaps.__init__(self)


def apply_rotated_sparsity(model: nn.Module, plan: RotatedPlan, stats: InputStats | None = None,
                           swaps: ModuleSwaps | None = None) -> AppliedRotated:
    """Swap the plan's modules in (masked mode); ``.revert()`` restores the model. ``stats``: where the realized
    sparsities are counted; ``swaps``: record the swaps there instead (``sparse_exec.apply_sparsity``). The result's
    ``extra_numel`` is :func:`rotation_numel`."""
    check_model(model)
    ad = adapter_for(model)
    dims = ad.dims(model.config)
    layers = ad.decoder_layers(model)
    paths = projection_paths(ad)
    stats = stats if stats is not None else InputStats(model_projection_numel(model))
    applied = AppliedRotated(model, stats, rotation_numel(model, plan))
    log = swaps if swaps is not None else applied
    n_rep = dims.n_heads // dims.n_kv_heads
    try:
        for l in plan.layers():
            if not 0 <= l < len(layers):
                raise ValueError(f"rotated plan for layer {l}, model has {len(layers)}")
            layer, sp, rot = layers[l], plan.sparsity.get(l, {}), plan.rotations.get(l, {})
            mods = {p: get_path(layer, paths[p]) for p in paths}
            for p, m in mods.items():
                if not isinstance(m, nn.Linear):
                    raise ValueError(f"layer {l} {p}: {type(m).__name__} is not a plain projection "
                                     "(already swapped by another plan part?)")
            r_o = rot.get("o")
            if r_o is not None and tuple(r_o.shape) != (dims.n_kv_heads, dims.head_dim, dims.head_dim):
                raise ValueError(f"layer {l}: o rotation of shape {tuple(r_o.shape)}, expected "
                                 f"{(dims.n_kv_heads, dims.head_dim, dims.head_dim)}")
            new = {}
            for group, norm_path in (("attn_in", ad.attn.norm), ("ffn_in", ad.ffn.norm)):
                q, s = rot.get(group), sp.get(group, 0.0)
                consumers = GROUP_PROJECTIONS[group]
                if q is None and s <= 0:
                    continue
                norm = get_path(layer, norm_path)
                if q is not None:
                    if tuple(q.shape) != (dims.d, dims.d):
                        raise ValueError(f"layer {l}: {group} rotation of shape {tuple(q.shape)}, expected "
                                         f"{(dims.d, dims.d)}")
                    gain = None if plan.scaled else norm_gain(norm)
                    for p in consumers:
                        new[p] = folded_linear(mods[p], gain, q, row_rot=r_o if p == "v" else None)
                scale = _col_norms(*(new.get(p, mods[p]) for p in consumers)) if plan.score == "wina" else None
                log.swap(layer, norm_path, RotatedTopKNorm(norm, q, keep_count(s, dims.d), scale, l, consumers,
                                                           stats, plan.scaled))
            if r_o is not None:
                if "v" not in new:
                    new["v"] = folded_linear(mods["v"], row_rot=r_o)
                new["o"] = folded_linear(mods["o"], col_rot=r_o.repeat_interleave(n_rep, dim=0))
            for p, lin in new.items():
                log.swap(layer, paths[p], lin)
            for group, p in (("o", "o"), ("down", "down")):
                s = sp.get(group, 0.0)
                if s > 0:
                    lin = new.get(p, mods[p])
                    scale = _col_norms(lin) if plan.score == "wina" else None
                    n_in = linear_weight(lin).shape[1]
                    log.swap(layer, paths[p], TopKInputLinear(lin, keep_count(s, n_in), scale, l, p, stats))
    except Exception:
        log.revert()
        raise
    return applied
