"""Rotated (LaRoSA) and rank-sparse (R-Sparse) plans for random-weight model shapes, at a target of decoder weight
bytes skipped with their extra bytes charged: what ``benchmarks.decode`` times beside TEAL at equal bytes.

    plan = rotated_shape_plan(model, 0.4)     # one random rotation per layer, every group at the same top-k
    plan = rotated_shape_plan(model, 0.4, rotation="none")   # each token's top-k of the plain inputs
    plan = rank_shape_plan(model, 0.4)        # every projection at s = 0.4, a share ρ of it on W's columns

The values are random (a shape has no calibration data); what is timed is what a fitted plan of that shape reads:
the rotated weights' top-k rows and the adapters between layers (``workers.methods.larosa.runtime``), or the kept
rows plus the rank-r factors of every projection (``workers.methods.rsparse.fit``'s recipe: r = ⌊(1 - ρ)(1 - s)·in·out
/ (in + out)⌋, inputs kept 1 - ρ(1 - s), scored |x_i|·‖W[:, i]‖ as the reference does where ρ < 1).

Feeds: BENCHMARKS.md, "GPU decode, end to end (one H200)" (the LaRoSA and R-Sparse points, through benchmarks.decode).
"""
from __future__ import annotations

import torch

from workers.decode.latency import calibrated_input_plan
from workers.loading.adapters import adapter_for, linear_weight
from workers.methods.larosa.part import RotatedPlan
from workers.methods.larosa.rotations import GROUPS
from workers.methods.rsparse.fit import input_sparsity_for, rank_for
from workers.methods.rsparse.part import LowRankPart, RankSparsePlan
from workers.sparsity.input_sparse import projection_modules
from workers.sparsity.predictors.base import SparsityPlan


def _orthogonal(n: int, g: torch.Generator, device) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))[None, :]).float().to(device)


def rotated_shape_plan(model, net: float, seed: int = 0, rotation: str = "layer") -> SparsityPlan:
    """A LaRoSA plan (rotation per layer, shared by its two block inputs; o rotated per KV head) whose every group
    keeps the same share, chosen so that the projections' bytes skipped minus the L - 1 adapters' (d² each) is
    ``net`` of the decoder's projection bytes. ``rotation="none"``: no block-input rotation and no adapter (each
    token's top-k of the plain inputs, o still rotated per KV head: free), every group at s = ``net``."""
    if rotation not in ("layer", "none"):
        raise ValueError(f"rotation must be 'layer' or 'none', got {rotation!r}")
    ad = adapter_for(model)
    dims = ad.dims(model.config)
    layers = ad.decoder_layers(model)
    per_layer = sum(linear_weight(m).numel() for m in projection_modules(ad, layers[0]).values())
    s = net + (len(layers) - 1) * dims.d ** 2 / (len(layers) * per_layer) if rotation == "layer" else net
    if not 0 < s < 1:
        raise ValueError(f"{net:.0%} of the bytes net of the adapters needs a sparsity of {s:.3f}")
    g = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    rot = RotatedPlan()
    for l in range(len(layers)):
        q = _orthogonal(dims.d, g, dev)
        r_o = torch.stack([_orthogonal(dims.head_dim, g, dev) for _ in range(dims.n_kv_heads)])
        rot.rotations[l] = {"attn_in": q, "ffn_in": q, "o": r_o} if rotation == "layer" else {"o": r_o}
        rot.sparsity[l] = {grp: s for grp in GROUPS}
    return SparsityPlan(parts=[rot])


def rank_shape_plan(model, net: float, rho: float = 0.95, seed: int = 0) -> SparsityPlan:
    """An R-Sparse plan: every projection at budget 1 - ``net``, a share ``rho`` of it on W's columns (thresholds
    calibrated on a random prefill, ``calibrated_input_plan``) and the rest on rank-r factors; bytes skipped,
    factors charged, is ``net``."""
    s_in = input_sparsity_for(rho, 1.0 - net)
    score = "abs" if rho >= 1.0 else "wina"
    inputs = calibrated_input_plan(model, s_in, score=score).inputs
    ad = adapter_for(model)
    g = torch.Generator().manual_seed(seed)
    parts = {}
    for l, layer in ad.iter_layers(model):
        parts[l] = {}
        for p, mod in projection_modules(ad, layer).items():
            w = linear_weight(mod)
            n_out, n_in = w.shape
            r = rank_for(rho, 1.0 - net, n_in, n_out)
            a = b = None
            if r:
                a = (torch.randn(r, n_in, generator=g) / n_in ** 0.5).to(w.device, w.dtype)
                b = (torch.randn(n_out, r, generator=g) / r ** 0.5).to(w.device, w.dtype)
            parts[l][p] = LowRankPart(inputs[l][p], score, a, b)
    return SparsityPlan(parts=[RankSparsePlan(parts)])
