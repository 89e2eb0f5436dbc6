"""LaRoSA's groups, bases and bytes: what the masked form, the runtime form and the fit share.

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

**What the rotation costs** (:func:`rotation_numel`, charged in "decoder bytes skipped" by
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
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from workers.loading.adapters import adapter_for

GROUPS = ("attn_in", "o", "ffn_in", "down")
GROUP_PROJECTIONS = {"attn_in": ("q", "k", "v"), "o": ("o",), "ffn_in": ("gate", "up"), "down": ("down",)}
BLOCK_INPUTS = ("attn_in", "ffn_in")            # the rotations that act on the normalized residual stream
ROTATABLE = BLOCK_INPUTS + ("o",)
SCORES = ("abs", "wina")


def keep_count(s: float, n: int) -> int:
    """Entries a token keeps of ``n`` at sparsity ``s``: n - round(s·n), at least 1."""
    return max(1, n - int(round(s * n)))


# ---------------------------------------------------------------- bases and cost
def residual_foldable(model: nn.Module) -> bool:
    """Block outputs go straight into the residual stream (no gain-carrying norm after them): the rotations can
    be carried by the residual stream itself."""
    return not adapter_for(model).ffn.post_norm


def residual_bases(plan, n_layers: int, foldable: bool) -> "ResidualBases":
    """Where the deployable form changes the residual stream's basis (module doc) for a ``RotatedPlan``, the one
    map both the bytes charged (:func:`rotation_numel`) and the decode runtime (its ``runtime`` module) follow.

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


def rotation_numel(model: nn.Module, plan) -> int:
    """Weight elements read per token by the rotations themselves in the deployable form (module doc): d² per
    adapter where the residual stream carries the bases, else d² per rotated block input
    (:func:`residual_bases`). o's rotations fold into v and o: none."""
    ad = adapter_for(model)
    d = ad.dims(model.config).d
    bases = residual_bases(plan, len(ad.decoder_layers(model)), residual_foldable(model))
    return bases.products() * d * d
