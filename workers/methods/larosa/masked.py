"""LaRoSA's masked form: a :class:`~workers.methods.larosa.part.RotatedPlan` on a Hugging Face model, the exact
function with dense products and the dropped entries zeroed (the deployable form is :mod:`.runtime`).

The pre-norm is swapped for a :class:`RotatedTopKNorm` that emits the masked r (:mod:`.rotations`), the consumers
for plain ``nn.Linear`` with the folded weights W', o and down for a :class:`TopKInputLinear`. The simulation
rotates online at every rotated input; the bytes charged are those of the deployable form
(``rotations.rotation_numel``). Realized sparsities are counted in ``input_sparse.InputStats`` like TEAL's.
``.revert()`` restores the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workers.loading.adapters import adapter_for, get_path, linear_weight, norm_gain
from workers.methods.larosa.rotations import GROUP_PROJECTIONS, keep_count, rotation_numel
from workers.sparsity.input_sparse import InputStats, model_projection_numel, projection_paths
from workers.sparsity.norms import is_rms_norm, rms_normalized
from workers.sparsity.swaps import ModuleSwaps


def topk_keep(score: torch.Tensor, k: int) -> torch.Tensor:
    """bool [T, n]: each row's ``k`` largest scores (exactly k per row, ties broken by position)."""
    keep = torch.zeros_like(score, dtype=torch.bool)
    if k >= score.shape[-1]:
        return keep.fill_(True)
    return keep.scatter_(-1, score.topk(k, dim=-1).indices, True)


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


# ---------------------------------------------------------------- support
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


# ---------------------------------------------------------------- apply
@dataclass
class AppliedRotated(ModuleSwaps):
    model: nn.Module
    stats: InputStats
    extra_numel: int = 0

    def __post_init__(self):
        ModuleSwaps.__init__(self)


def apply_rotated_sparsity(model: nn.Module, plan, stats: InputStats | None = None,
                           swaps: ModuleSwaps | None = None) -> AppliedRotated:
    """Swap ``plan``'s modules in (a RotatedPlan, masked mode); ``.revert()`` restores the model. ``stats``: where
    the realized sparsities are counted; ``swaps``: record the swaps there instead (``sparse_exec.apply_sparsity``).
    The result's ``extra_numel`` is ``rotations.rotation_numel``."""
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
