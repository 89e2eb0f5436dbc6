"""LaRoSA: layerwise rotated sparse activation, training-free (method ``larosa``).

Reference: Liu et al., "LaRoSA: Enhancing LLM Efficiency via Layerwise Rotated Sparse Activation", ICML 2025
(arXiv 2507.01299); code alibaba/EfficientAI, ``larosa/gen_act/grab_acts_rotate_diff_Q_llama.py`` (the fit) and
``larosa/inference/modeling_llama_larosa.py`` (rotate, top-k, un-rotate before q/k/v and gate/up; o's and down's
inputs a plain top-k). Each layer's block inputs are rotated by the eigenvectors of their calibration covariance
(PCA: the reference adds 0.01 · mean(diag) to the diagonal and takes ``eigh`` in float64, as here), and each
token keeps its top-k rotated entries, so every token has exactly the target sparsity (TEAL's thresholds give
each token a different count). How the rotations are folded into the weights and what they cost in bytes:
:mod:`.rotations`; how a plan runs: :mod:`.masked` (accuracy) and :mod:`.runtime` (decode).

Fitted from the activation cache's ``cov`` component (:mod:`workers.sparsity.capture`): per layer Σ n nᵀ of the
rms-normalized block inputs before the norm's gain (the gain is folded into the next linear), at the attention
and at the FFN, and per KV head group of o's input. The sweep's per-layer budget s is given to every listed input
group of the layer (uniform inside the layer, as TEAL's default).

Options:
  ``rotation``     ``"layer"`` (default, the paper's: one Q per layer from the sum of its two block inputs'
                   covariances; one d×d adapter per layer boundary is charged on models whose residual stream can
                   carry it), ``"block"`` (a Q per block input, as the reference code fits: two per layer),
                   ``"model"`` (one Q for every layer: no adapter at all where the residual stream carries it),
                   ``"none"`` (no rotation: a per-token top-k of the plain input, TEAL's rule with exact counts)
  ``rotate_o``     rotate o's input per KV head group, folded into v and o (free at run time; default true)
  ``basis``        ``"normed"`` (default: Q from the covariance of n, the norm's gain folded into the consumers;
                   the residual stream can carry it) or ``"scaled"`` (the reference code's: Q from the covariance of
                   the norm's output g ⊙ n, i.e. diag(g) Σ n nᵀ diag(g); an explicit d×d product per rotated input)
  ``score``        ``"abs"`` (default: |r_j|) or ``"wina"`` (|r_j|·‖W'[:, j]‖₂ over the input's consumers)
  ``projections``  the projections to sparsify (default all; q/k/v and gate/up only together: they share an input)
"""
from __future__ import annotations

import torch

from workers.loading.adapters import get_path, norm_gain
from workers.methods.larosa.masked import check_model
from workers.methods.larosa.part import RotatedPlan
from workers.methods.larosa.rotations import BLOCK_INPUTS, GROUP_PROJECTIONS, GROUPS, SCORES, keep_count
from workers.sparsity.input_sparse import projection_paths
from workers.sparsity.predictors.base import FitContext, SparsityPlan, register

ROTATIONS = ("layer", "block", "model", "none")
BASES = ("normed", "scaled")
DAMP = 0.01        # added to the covariance's diagonal, times its mean diagonal (the reference's)


def pca_rotation(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, eigenvalues) of a covariance (or a batch of them, [..., n, n]): Q's columns the eigenvectors of
    cov + DAMP · mean(diag) · I in decreasing order of their eigenvalue, float32; eigenvalues of the undamped
    covariance along them, float64."""
    c = cov.double()
    damp = DAMP * torch.diagonal(c, dim1=-2, dim2=-1).mean(-1)
    ev, vec = torch.linalg.eigh(c + damp[..., None, None] * torch.eye(c.shape[-1], dtype=c.dtype))
    ev, vec = ev.flip(-1), vec.flip(-1)
    return vec.float().contiguous(), ev - damp[..., None]


def _groups(ad, projections) -> list[str]:
    known = tuple(projection_paths(ad))
    if projections is None:
        return list(GROUPS)
    projections = list(projections)
    if not projections or len(set(projections)) != len(projections) or set(projections) - set(known):
        raise ValueError(f"larosa: projections must be distinct names among {list(known)}, got {projections}")
    out = []
    for g in GROUPS:
        part = set(GROUP_PROJECTIONS[g]) & set(projections)
        if part and part != set(GROUP_PROJECTIONS[g]):
            raise ValueError(f"larosa: {'/'.join(GROUP_PROJECTIONS[g])} read one input and are sparsified together; "
                             f"got {sorted(part)}")
        if part:
            out.append(g)
    return out


def _kept_variance(ev: torch.Tensor, s: float) -> float:
    """The fraction of the calibration variance in the top (1 - s) principal directions."""
    ev = ev.clamp_min(0)
    return round(float(ev[:keep_count(s, ev.shape[-1])].sum() / ev.sum()), 5)


@register("larosa", captures=("cov",), fit_cost=1)
def fit_larosa(ctx: FitContext, sparsity: dict[int, float], rank=None, rotation: str = "layer",
               rotate_o: bool = True, score: str = "abs", projections=None, basis: str = "normed",
               **unknown) -> SparsityPlan:
    if unknown:
        raise ValueError(f"larosa: unknown options {sorted(unknown)}")
    if rotation not in ROTATIONS:
        raise ValueError(f"larosa: rotation must be one of {ROTATIONS}, got {rotation!r}")
    if score not in SCORES:
        raise ValueError(f"larosa: score must be one of {SCORES}, got {score!r}")
    if basis not in BASES:
        raise ValueError(f"larosa: basis must be one of {BASES}, got {basis!r}")
    check_model(ctx.lm.model)
    groups = _groups(ctx.lm.adapter, projections)
    layers = [l for l, s in sorted(sparsity.items()) if s > 0]
    rotated_inputs = [g for g in BLOCK_INPUTS if g in groups] if rotation != "none" else []
    if (rotated_inputs or (rotate_o and "o" in groups)) and layers and "cov" not in ctx.cache.components:
        raise ValueError("larosa: the activation cache has no covariances: collect it with the 'cov' component")

    ad = ctx.lm.adapter
    decoder = ad.decoder_layers(ctx.lm.model)

    def cov(l, g):
        c = ctx.cache.load_cov(l, g)[0]
        if basis == "scaled" and g in BLOCK_INPUTS:       # Σ x xᵀ of x = g ⊙ n
            gain = norm_gain(get_path(decoder[l], ad.attn.norm if g == "attn_in" else ad.ffn.norm)).double()
            c = gain[:, None] * c * gain[None, :]
        return c

    covs = {(l, g): cov(l, g) for l in layers for g in rotated_inputs}
    plan = RotatedPlan(score=score, scaled=basis == "scaled")
    out = SparsityPlan(parts=[plan])
    shared = None
    if rotation == "model" and layers and rotated_inputs:
        shared = pca_rotation(sum(covs.values()))
    for l in layers:
        s = sparsity[l]
        plan.sparsity[l] = {g: s for g in groups}
        rot, kept = {}, {}
        if rotation == "block":
            for g in rotated_inputs:
                q, ev = pca_rotation(covs[(l, g)])
                rot[g], kept[g] = q, _kept_variance(ev, s)
        elif rotated_inputs:
            q, ev = shared if shared is not None else pca_rotation(sum(covs[(l, g)] for g in rotated_inputs))
            for g in rotated_inputs:
                rot[g] = q                     # one tensor: the same basis (no adapter between the blocks)
            kept["+".join(rotated_inputs)] = _kept_variance(ev, s)
        if rotate_o and "o" in groups:
            rot["o"], ev = pca_rotation(cov(l, "o"))
            kept["o"] = round(sum(_kept_variance(e, s) for e in ev) / ev.shape[0], 5)
        if rot:
            plan.rotations[l] = rot
        out.info[l] = {"larosa": {"target_sparsity": s, "rotation": rotation, "rotate_o": bool(rotate_o),
                                  "score": score, "basis": basis, "groups": list(groups), "pca_kept_variance": kept}}
    return out
