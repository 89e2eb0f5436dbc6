"""Magnitude histograms on a fixed log-spaced grid, and quantiles read from them.

Input-sparsity calibration needs, per projection input, the s-quantile of |x| (or of a score such as
|x_i|·‖W[:, i]‖₂) over millions of (token, channel) values. Keeping the raw inputs of every projection would
double the activation cache; a histogram on one fixed grid is a few kB, sums across cache shards, and gives
the quantile to within a fraction of a bin (interpolated log-linearly inside the bin).

Grid: bin 0 holds [0, 10^LO) (exact zeros included), bins 1..BINS split [10^LO, 10^HI) into equal steps of
log10, bin BINS+1 holds [10^HI, inf). With LO=-6, HI=5, BINS=4096 one bin spans 0.62 % of its value.
"""
from __future__ import annotations

import math

import torch

LO, HI, BINS = -6.0, 5.0, 4096
N_COUNTS = BINS + 2
_STEP = (HI - LO) / BINS


def log_magnitude(a: torch.Tensor) -> torch.Tensor:
    """log10 of non-negative values (zeros map far below the grid), float32."""
    return torch.log10(a.detach().float().clamp_min(1e-30))


def bin_of_log(loga: torch.Tensor) -> torch.Tensor:
    """Bin of each value given its log10 -> int64 indices in [0, BINS+1]."""
    return ((loga - LO) / _STEP).floor_().add_(1).clamp_(0, BINS + 1).long()


def bin_index(a: torch.Tensor) -> torch.Tensor:
    """Bin of each non-negative value of ``a`` (any shape) -> int64 indices in [0, BINS+1]."""
    return bin_of_log(log_magnitude(a))


def signed_histograms(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts of |x| over x > 0 and over x <= 0 as a [2, N_COUNTS] tensor, log10|x|) in one pass."""
    loga = log_magnitude(x.abs())
    idx = bin_of_log(loga) + N_COUNTS * (x <= 0).long()
    return torch.bincount(idx.reshape(-1), minlength=2 * N_COUNTS).view(2, N_COUNTS), loga


def histogram(a: torch.Tensor) -> torch.Tensor:
    """Counts of the non-negative values ``a`` on the grid, int64 [N_COUNTS] (on ``a``'s device)."""
    return torch.bincount(bin_index(a).reshape(-1), minlength=N_COUNTS)


def _bin_value(j: int, frac: float) -> float:
    """The value a fraction ``frac`` of the way through bin ``j`` (linear in bin 0, log-linear above)."""
    if j == 0:
        return frac * 10.0 ** LO
    if j > BINS:
        return 10.0 ** HI
    return 10.0 ** (LO + (j - 1 + frac) * _STEP)


def quantile(counts: torch.Tensor, q: float) -> float:
    """The q-quantile of the values counted in ``counts`` (a [N_COUNTS] histogram), interpolated in its bin."""
    if counts.shape != (N_COUNTS,):
        raise ValueError(f"expected a [{N_COUNTS}] histogram, got {tuple(counts.shape)}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    c = counts.double().cpu()
    total = c.sum().item()
    if total <= 0:
        raise ValueError("empty histogram")
    rank = q * total
    cum = c.cumsum(0)
    j = int(torch.searchsorted(cum, torch.tensor([rank], dtype=torch.float64)).item())
    j = min(j, N_COUNTS - 1)
    before = cum[j - 1].item() if j > 0 else 0.0
    frac = 0.0 if c[j] == 0 else (rank - before) / c[j].item()
    return _bin_value(j, min(max(frac, 0.0), 1.0))


def cdf(counts: torch.Tensor, v: float) -> float:
    """Fraction of the counted values <= v (interpolated inside v's bin, the inverse of :func:`quantile`)."""
    c = counts.double().cpu()
    total = c.sum().item()
    if v <= 0:
        return 0.0
    if v < 10.0 ** LO:
        j, frac = 0, v / 10.0 ** LO
    elif v >= 10.0 ** HI:
        return 1.0
    else:
        p = (math.log10(v) - LO) / _STEP
        j, frac = int(math.floor(p)) + 1, p - math.floor(p)
    return (c[:j].sum().item() + frac * c[j].item()) / total


def signed_icdf(pos: torch.Tensor, neg: torch.Tensor, q: float) -> float:
    """The q-quantile of a signed variable x from the histograms of |x| over x > 0 (``pos``) and x <= 0 (``neg``)."""
    n_pos, n_neg = pos.double().sum().item(), neg.double().sum().item()
    rank = q * (n_pos + n_neg)
    if rank >= n_neg:      # at or above zero: a quantile of the positive part
        return quantile(pos, (rank - n_neg) / n_pos) if n_pos else 0.0
    return -quantile(neg, (n_neg - rank) / n_neg)
