"""LaRoSA's runtime form: a :class:`~workers.methods.larosa.part.RotatedPlan` folded into the decode runtime's
weights, and the step's top-k paths over them.

    w2 = rotated_weights(w, plan)     # ModelWeights in the plan's bases (w is untouched; what no rotation changes
                                      # is shared with it): RotatedPlan.runtime_weights, at set_plan
    pr = compile_plan(plan, w2)       # workers.decode.plan.PartRuntime: per layer the attention / FFN callables

The deployable form of :mod:`.rotations`' module doc, built once at ``set_plan``:

- **Residual stream in a basis** (Llama, Mistral, Qwen2; plan not ``scaled``): the stream is carried in the basis
  that ``rotations.residual_bases`` assigns to each block input. A basis C (orthogonal, its columns) at a block
  input folds the norm's gain and C into that input's consumers (W' = W diag(g) C; the gain becomes 1), and Cᵀ
  into the rows of the projection that writes the block's output back (W_o' = Cᵀ W_o, W_down' = Cᵀ W_down, biases
  likewise). The embeddings take the first basis (an untied copy), the final norm's gain and the last basis fold
  into the LM head, and a change of basis is the layer's ``adapt_attn`` / ``adapt_ffn`` (x <- x @ Cᵀ_old C_new):
  one d×d product on the stream, the bytes ``rotation_numel`` charges.
- **Explicit** (Gemma-3's post-norms, or a ``scaled`` plan): the stream stays in the original basis and a rotated
  input is ``rot_attn`` / ``rot_ffn`` (h <- h @ Q on the normed input; W' = W diag(g) Q with the gain 1, or W Q
  with the gain kept where ``scaled``).
- o's rotation R (per KV head) goes into v's rows and o's columns (attention is linear in v): no product per token.

With every sparsity at 0 the rotated runtime's logits are the dense ones up to rounding (test). The top-k itself is
the step's (:func:`attn`, :func:`ffn`, the layer's callables): each token keeps its k largest |r| (or
|r|·‖W'[:, j]‖ for the ``wina`` score) and the consumers read those k rows of W'ᵀ only (for |r|: the input-sparse
kernels with the k-th largest as the threshold, workers.decode.blocks.topk_in_linear).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from kernels import ops
from workers.decode.plan import PartRuntime, gu_t, in_features, layer_column_norms, out_sizes, qkv_t
from workers.decode.weights import PROJ, LayerWeights, ModelWeights
from workers.methods.larosa.rotations import GROUP_PROJECTIONS, IDENTITY, ResidualBases, keep_count, \
    residual_bases


# ---------------------------------------------------------------- the weights
def foldable(w: ModelWeights) -> bool:
    """Whether the residual stream can carry a basis: block outputs go straight into it (no post-norms)."""
    return all(L.post_attn is None and L.post_ffn is None for L in w.layers)


def check(w: ModelWeights) -> None:
    if w.quantized:
        raise NotImplementedError("rotated input sparsity folds its rotations into the weights: it runs over float "
                                  "weights (from_hf), not over a GGUF's blocks (that would requantize them)")
    if not w.gated or w.norm_kind not in ("rms", "rms1p") or any(L.n1b is not None for L in w.layers):
        raise ValueError("rotated input sparsity needs RMS norms and a gated FFN (Llama, Mistral, Qwen2, Gemma-3)")


@torch.no_grad()
def rotated_weights(w: ModelWeights, plan) -> ModelWeights:
    """``w`` with ``plan``'s rotations folded in (the module doc): the tensors they change recomputed in float64,
    the others shared with ``w``."""
    check(w)
    bases = residual_bases(plan, len(w.layers), foldable(w))
    layers = [_layer(w, l, L, plan, bases) for l, L in enumerate(w.layers)]
    embed, final_norm, lm_head = w.embed, w.final_norm, w.lm_head
    if bases.initial is not IDENTITY:
        embed = _cast(w.embed.double() @ bases.initial.to(w.device, torch.float64), w.embed)
    if bases.final is not IDENTITY:
        head = w.lm_head.double() * w.final_norm.to(torch.float64)[None, :]
        lm_head = _cast(head @ bases.final.to(w.device, torch.float64), w.lm_head)
        final_norm = torch.ones_like(w.final_norm)
    return dataclasses.replace(w, layers=tuple(layers), embed=embed, final_norm=final_norm, lm_head=lm_head)


def _cast(t64: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t64.to(device=like.device, dtype=like.dtype).contiguous()


def _q(q, w: ModelWeights):
    return None if q is None or q is IDENTITY else q.to(w.device, torch.float64)


def _layer(w: ModelWeights, l: int, L: LayerWeights, plan, bases: ResidualBases) -> LayerWeights:
    dims = w.dims
    H, KV, hd = dims.n_heads, dims.n_kv_heads, dims.head_dim
    rot = plan.rotations.get(l, {})
    new = {}
    # the stream's basis at each block input (folded form) or the explicit rotation of the normed input
    ca, cf = (_q(bases.at.get((l, g), IDENTITY), w) for g in ("attn_in", "ffn_in"))
    ea, ef = (_q(bases.explicit.get((l, g)), w) for g in ("attn_in", "ffn_in"))
    for g, field in (("attn_in", "adapt_attn"), ("ffn_in", "adapt_ffn")):
        if (l, g) in bases.adapters:          # x_new = x @ C_oldᵀ C_new (an identity basis: I)
            src, dst = (_q(b, w) for b in bases.adapters[(l, g)])
            eye = torch.eye(dims.d, dtype=torch.float64, device=w.device)
            new[field] = _cast((eye if src is None else src.t()) @ (eye if dst is None else dst), L.w_qkv)
    new["rot_attn"] = None if ea is None else _cast(ea, L.w_qkv)
    new["rot_ffn"] = None if ef is None else _cast(ef, L.w_qkv)

    def consumers(weight, gain, q):
        """W diag(g) Q (the gain is kept in the norm when ``plan.scaled``)."""
        w64 = weight.double()
        if not plan.scaled:
            w64 = w64 * gain.to(torch.float64)[None, :]
        return w64 @ q

    # only what a rotation changes is recomputed (float64) and replaced; the rest stays shared with ``w``
    q_in = ca if ca is not None else ea
    r_o = rot.get("o")
    if r_o is not None and tuple(r_o.shape) != (KV, hd, hd):
        raise ValueError(f"layer {l}: o rotation of shape {tuple(r_o.shape)}, expected {(KV, hd, hd)}")
    r = None if r_o is None else r_o.to(w.device, torch.float64)
    if q_in is not None or r is not None:
        qkv = L.w_qkv.double() if q_in is None else consumers(L.w_qkv, L.n1, q_in)
        b_qkv = None if L.b_qkv is None else L.b_qkv.double()
        if r is not None:                    # v's rows: Rᵀ per KV head (attention is linear in v)
            v0 = (H + KV) * hd
            qkv[v0:] = (r.transpose(1, 2) @ qkv[v0:].reshape(KV, hd, -1)).reshape(KV * hd, -1)
            if b_qkv is not None:
                b_qkv[v0:] = (r.transpose(1, 2) @ b_qkv[v0:].reshape(KV, hd, 1)).reshape(-1)
        new["w_qkv"] = _cast(qkv, L.w_qkv)
        new["b_qkv"] = None if b_qkv is None else _cast(b_qkv, L.b_qkv)
    if q_in is not None and not plan.scaled:
        new["n1"] = torch.ones_like(L.n1)
    q_ffn = cf if cf is not None else ef
    if q_ffn is not None:
        new["w_gate"] = _cast(consumers(L.w_gate, L.n2, q_ffn), L.w_gate)
        new["w_up"] = _cast(consumers(L.w_up, L.n2, q_ffn), L.w_up)
        if not plan.scaled:
            new["n2"] = torch.ones_like(L.n2)
    if r is not None or ca is not None:
        o_t = L.w_o_t.double()
        b_o = None if L.b_o is None else L.b_o.double()
        if r is not None:                    # W_oᵀ's rows: Rᵀ per query head of the group
            rq = r.repeat_interleave(H // KV, dim=0)
            o_t = (rq.transpose(1, 2) @ o_t.reshape(H, hd, -1)).reshape(H * hd, -1)
        if ca is not None:                   # the attention's output is written back in the stream's basis
            o_t = o_t @ ca
            b_o = None if b_o is None else b_o @ ca
        new["w_o_t"] = _cast(o_t, L.w_o_t)
        new["b_o"] = None if b_o is None else _cast(b_o, L.b_o)
    if cf is not None:                       # the FFN's output likewise
        new["w_down_t"] = _cast(L.w_down_t.double() @ cf, L.w_down_t)
        if L.b_down is not None:
            new["b_down"] = _cast(L.b_down.double() @ cf, L.b_down)
    new["layouts"] = {}                      # the copy's own Wᵀ layouts (set_plan makes them)
    return dataclasses.replace(L, **new)


# ---------------------------------------------------------------- the plan compiled
class TopK(NamedTuple):
    """A group's top-k: each token keeps its ``k`` largest |x_j| (``scale`` None) or |x_j|·scale_j; ``sizes`` the
    output segment of each of its projections in the fused product (as plan.InputGroup's)."""
    k: int
    scale: torch.Tensor | None
    sizes: tuple[int, ...]


def compile_plan(plan, w: ModelWeights) -> PartRuntime:
    """Per layer, the top-k of each sparse group of ``plan`` over the rotated weights ``w`` (WINA's ‖W'[:, j]‖
    over the group's consumers stacked), and the layer's attention / FFN callables over them."""
    dims = w.dims
    out = PartRuntime()
    for l, per in plan.sparsity.items():
        l = int(l)
        if not 0 <= l < len(w.layers):
            raise ValueError(f"rotated plan for layer {l}, model has {len(w.layers)}")
        norms = layer_column_norms(w, l) if plan.score == "wina" else None
        ent = {}
        for g, s in per.items():
            names = GROUP_PROJECTIONS[g]
            n = in_features(dims, names[0])
            if s <= 0 or keep_count(s, n) >= n:
                continue
            scale = None          # ‖W'[:, j]‖ over the group's consumers stacked
            if norms is not None:
                scale = torch.stack([norms[p] for p in names]).pow(2).sum(0).sqrt()
            ent[g] = TopK(keep_count(s, n), None if scale is None else scale.to(w.device, w.dtype),
                          out_sizes(dims, names))
            for p in names:
                out.inputs.setdefault(l, {})[p] = ent[g].k
            if g == "attn_in":
                qkv_t(w.layers[l])
                out.layouts.setdefault(l, set()).add("qkv_t")
            elif g == "ffn_in":
                gu_t(w.layers[l])
                out.layouts.setdefault(l, set()).add("gu_t")
        if ent:
            out.attn[l] = functools.partial(attn, groups=ent)
            out.ffn[l] = functools.partial(ffn, groups=ent)
    out.extra_numel = sum(t.numel() for L in w.layers for t in (L.adapt_attn, L.adapt_ffn, L.rot_attn, L.rot_ffn)
                          if t is not None)
    return out


# ---------------------------------------------------------------- the step's paths (workers.decode.layer.Step)
def attn(step, l, L, h, groups: dict):
    """The attention: QKV on each token's top-k of the rotated input, O on its top-k (weights rotated at
    set_plan)."""
    b = step.b
    if "attn_in" in groups:
        qkv = _linear(step, l, h, L.w_qkv_t, groups["attn_in"], L.b_qkv, PROJ.index("q"), 3)
    else:
        qkv = b.linear(h, L.w_qkv, L.b_qkv)
    a = step.attend(l, L, qkv)
    if "o" in groups:
        return _linear(step, l, a, L.w_o_t, groups["o"], L.b_o, PROJ.index("o"), 1)
    return b.out_dense(L, a)


def ffn(step, l, L, h, groups: dict):
    """The FFN: gate|up on each token's top-k of the rotated input, down on its top-k."""
    b, w = step.b, step.b.w
    if "ffn_in" in groups:
        gu = _linear(step, l, h, L.w_gu_t, groups["ffn_in"], None, PROJ.index("gate"), 2)
    else:
        gu = b.linear(h, L.gu())
    a = step.fns["act_mul"](gu, w.act)
    if "down" in groups:
        return _linear(step, l, a, L.w_down_t, groups["down"], L.b_down, PROJ.index("down"), 1)
    return b.linear_t(a, L.w_down_t, L.b_down)


def _linear(step, l, x, w_t, tk: TopK, bias, col, n):
    counts = step.c.inputs[l, col: col + n] if step.b.count_inputs or x.device.type == "cpu" else None
    if tk.scale is None and (x.shape[0] == 1 or ops.backend_name(x) == "cpu"):
        # each token's k-th largest |x_j| as the input-sparse kernels' threshold: exactly its top-k (and any
        # entry tied with the k-th), without a top-k or a gather
        return step.b.topk_in_linear(x, w_t, tk.k, tk.sizes, col, bias, counts)
    s = x.abs() if tk.scale is None else x.abs() * tk.scale
    return step.b.topk_linear(x, w_t, step.sets.sel.topk(s, tk.k), bias, counts)
