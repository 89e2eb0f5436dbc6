"""Whitened truncated SVD: the rank-r map that is best on the data, not on the weights (SVDP, arXiv 2603.14110).

From calibration inputs Z1 [N, d]: ``S = cholesky(Z1ᵀZ1)`` in float64 (when the Gram is numerically not positive
definite -- Cholesky fails or a pivot is below ``d·eps_machine`` of the largest diagonal entry -- ``εI`` is added,
ε = 1e-6·trace/d and ×10 until it works). ``U Σ Vᵀ = svd(W S)``, ``A = (Vᵀ S⁻¹)[:r]`` (a triangular solve, no
explicit inverse), ``B = U[:, :r] diag(Σ[:r])``. ``B A`` is the rank-r W that minimises ‖(W − BA) Z1ᵀ‖ (plain SVD,
:func:`plain_lowrank`, the reference it is compared against, minimises ‖W − BA‖ instead), and ``B A = W`` at r = d.

Where W is not defined on the predictor's input (a predictor reading the residual stream for a map defined on the
FFN input), :func:`whitened_map` uses the least-squares map from Z1 to the target on the same tokens; whitening
then makes BA its best rank-r reduced-rank regression.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch


class WhiteningFactor(NamedTuple):
    S: torch.Tensor      # lower Cholesky factor of Z1ᵀZ1 (+ εI), float64 [d, d]
    eps: float           # the ε that had to be added (0.0 if none)


class LowRank(NamedTuple):
    A: torch.Tensor      # [r, d]
    B: torch.Tensor      # [D, r]; B A is the rank-r map


@contextlib.contextmanager
def _one_thread():
    """Run small LAPACK factorizations on one thread. On a busy 2-core box a 2-thread float64 SVD of a
    [1536, 576] matrix spin-waits: ~20 s wall / 4 s CPU instead of ~0.2 s CPU on one thread."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def whitening_factor(Z1: torch.Tensor) -> WhiteningFactor:
    """Lower Cholesky factor S of Z1ᵀZ1 (float64) and the ε that had to be added (0.0 if none)."""
    X = Z1.double()
    G = X.T @ X
    d = G.shape[0]
    diag = torch.diagonal(G)
    scale = float(diag.max()) if d else 0.0
    tiny = d * torch.finfo(torch.float64).eps * max(scale, 1e-300)
    eps, base = 0.0, 1e-6 * float(diag.sum()) / max(d, 1)
    if not base > 0:
        base = 1e-6
    eye = torch.eye(d, dtype=torch.float64)
    for _ in range(40):
        with _one_thread():
            L, info = torch.linalg.cholesky_ex(G + eps * eye if eps else G)
        if int(info) == 0 and bool(torch.isfinite(L).all()) and float(torch.diagonal(L).min()) ** 2 > tiny:
            return WhiteningFactor(L, eps)
        eps = base if eps == 0.0 else eps * 10.0
    raise np.linalg.LinAlgError("cannot make the calibration Gram positive definite")


def whitened_map(W: torch.Tensor, S: torch.Tensor, Z1: torch.Tensor | None = None,
                 X1: torch.Tensor | None = None) -> torch.Tensor:
    """``W S`` ([D, d], float64): what :func:`whitened_lowrank` factors.

    ``Z1`` None: W acts on the input S whitens. Otherwise W acts on ``X1`` and the predictor reads ``Z1`` (the same
    tokens): the map from Z1 is the least-squares ``W_eff = C G⁻¹`` with ``C = (X1 Wᵀ)ᵀ Z1`` and ``G = Z1ᵀZ1 = S Sᵀ``,
    so ``W_eff S = C S⁻ᵀ`` (a triangular solve)."""
    if Z1 is None:
        return W.double() @ S
    C = (X1.double() @ W.double().T).T @ Z1.double()
    with _one_thread():
        return torch.linalg.solve_triangular(S, C.T, upper=False).T


def whitened_lowrank(WS: torch.Tensor, S: torch.Tensor, rank: int) -> LowRank:
    """From ``W S`` ([D, d], float64) and lower-triangular S: ``A = (Vᵀ S⁻¹)[:r]`` [r, d], ``B = U_r Σ_r`` [D, r]."""
    with _one_thread():
        U, sig, Vh = torch.linalg.svd(WS, full_matrices=False)
        Vr = Vh[:rank]                                               # [r, d]
        A = torch.linalg.solve_triangular(S.T, Vr.T, upper=True).T   # Vr S⁻¹ (S⁻ᵀ Vrᵀ = solve(Sᵀ, Vrᵀ))
    return LowRank(A, U[:, :rank] * sig[:rank])


def plain_lowrank(W: torch.Tensor, rank: int) -> LowRank:
    """Unwhitened truncated SVD of W (the naive predictor, the reference): ``A = Vᵀ[:r]``, ``B = U_r Σ_r``."""
    with _one_thread():
        U, sig, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    return LowRank(Vh[:rank], U[:, :rank] * sig[:rank])
