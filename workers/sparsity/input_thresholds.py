"""Input-sparsity thresholds read from the activation cache's histograms (TEAL, WINA).

The capture stores, per (layer, projection) input and cache shard, three histograms on the fixed grid of
:mod:`workers.sparsity.histograms` (``inhist``): |x| over x > 0, |x| over x <= 0, and the WINA score
|x_i|·‖W[:, i]‖₂. A projection that should drop a fraction s of its inputs keeps input i iff its score > t, with
t the s-quantile of the score, read from the histogram (exact whatever the shape of the distribution).
TEAL's code instead takes icdf(0.5 + s/2) of the *signed* distribution, which equals the |x| quantile only if x is
symmetric around 0; ``symmetric=True`` reproduces that rule and :func:`symmetry_gaps` measures how far apart the
two are on a cache.

This module is the bottom of the input-sparsity stack: allocation (:mod:`workers.sparsity.input_allocation`) and
the method fits (:mod:`workers.methods.teal.fit`) import it, it imports neither.
"""
from __future__ import annotations

from workers.sparsity import histograms as H

_ROW = {"pos": 0, "neg": 1, "wina": 2}      # the rows of a projection input's stored [3, bins] histograms


def abs_hist(h):
    """|x| histogram of a projection input from its stored rows (x > 0 and x <= 0)."""
    return h[_ROW["pos"]] + h[_ROW["neg"]]


def threshold_for(h, s: float, score: str = "abs", symmetric: bool = False) -> float:
    """The threshold that drops a fraction ``s`` of a projection's calibration inputs (``h``: its [3, bins]
    histograms). ``symmetric``: TEAL's icdf(0.5 + s/2) of the signed input instead (exact only for symmetric x)."""
    if not 0.0 <= s < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {s}")
    if symmetric:
        if score != "abs":
            raise ValueError("the symmetric (signed icdf) rule applies to TEAL's |x| score only")
        return max(H.signed_icdf(h[_ROW["pos"]], h[_ROW["neg"]], 0.5 + s / 2), 0.0)
    return H.quantile(abs_hist(h) if score == "abs" else h[_ROW["wina"]], s)


def calib_sparsity(h, t: float, score: str = "abs") -> float:
    """Fraction of the calibration inputs whose score is <= t."""
    return H.cdf(abs_hist(h) if score == "abs" else h[_ROW["wina"]], t)


def input_hist(ctx, layer: int, proj: str):
    """The stored histograms of ``proj``'s input in ``layer`` (``ctx``: a ``predictors.base.FitContext``)."""
    if "inhist" not in ctx.cache.components:
        raise ValueError("the activation cache has no input histograms: collect it with the 'inhist' component")
    return ctx.cache.load_hist(layer, proj)


class Thresholds:
    """The thresholds of one fit context and score, each computed once: the greedy allocations try the same
    (layer, projection, sparsity) many times. Sparsity 0 is threshold -1 (every input kept, |x| >= 0 > -1)."""

    def __init__(self, ctx, score: str):
        self.ctx, self.score = ctx, score
        self._hists: dict[tuple[int, str], object] = {}
        self._memo: dict[tuple[int, str, float], float] = {}

    def hist(self, layer: int, proj: str):
        if (layer, proj) not in self._hists:
            self._hists[(layer, proj)] = input_hist(self.ctx, layer, proj)
        return self._hists[(layer, proj)]

    def __call__(self, layer: int, proj: str, s: float) -> float:
        key = (layer, proj, round(s, 9))
        if key not in self._memo:
            self._memo[key] = threshold_for(self.hist(layer, proj), s, self.score) if s > 0 else -1.0
        return self._memo[key]


def symmetry_gaps(cache, layers, projections, sparsities=(0.25, 0.4, 0.5)) -> dict:
    """Per projection input: how far TEAL's signed icdf(0.5 + s/2) threshold is from the |x| quantile.

    Returns {proj: {s: {"realized": mean over layers of the calibration sparsity the symmetric rule gives,
    "max_abs_err": its largest |realized - s| over layers, "neg_frac": mean fraction of x <= 0}}}."""
    out = {}
    for p in projections:
        out[p] = {}
        for s in sparsities:
            real, negs = [], []
            for l in layers:
                h = cache.load_hist(l, p)
                real.append(calib_sparsity(h, threshold_for(h, s, symmetric=True)))
                negs.append(float(h[_ROW["neg"]].sum() / abs_hist(h).sum()))
            out[p][s] = {"realized": sum(real) / len(real), "max_abs_err": max(abs(r - s) for r in real),
                         "neg_frac": sum(negs) / len(negs)}
    return out
