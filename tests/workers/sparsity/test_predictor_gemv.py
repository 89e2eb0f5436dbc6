"""Predictor GEMVs (``predictors.base.linear``): the CPU row kernel for a few fp32 tokens at inference, ``F.linear``
under autograd; the same scores either way."""
from __future__ import annotations

import torch

from kernels import cpu as cpu_kernels
from workers.sparsity.predictors import base
from workers.methods.dejavu.predictor import DejaVuMLPPredictor
from workers.methods.svd.predictor import SVDPredictor


def _counting(monkeypatch):
    calls = []
    real = cpu_kernels.rows_dot

    def rows_dot(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(cpu_kernels, "rows_dot", rows_dot)
    return calls


def test_linear_matches_fp64_and_uses_the_row_kernel(monkeypatch):
    assert cpu_kernels.native_available(), "the CPU row kernels did not build (a C compiler is needed)"
    calls = _counting(monkeypatch)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 97, generator=g)
    for B in (1, 3, 8):
        x = torch.randn(B, 97, generator=g)
        ref = x.double() @ w.double().T
        torch.testing.assert_close(base.linear(x, w).double(), ref, rtol=1e-5, atol=1e-4)
    assert len(calls) == 3
    big = torch.randn(40, 97, generator=g)           # more tokens than the row kernel takes: F.linear
    torch.testing.assert_close(base.linear(big, w), big @ w.T)
    assert len(calls) == 3


def test_linear_keeps_autograd():
    w = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(2, 8)
    base.linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(16, 8))


def test_scores_at_decode_equal_the_batched_scores(monkeypatch):
    """One token's scores (row kernel) equal its row of a 32-token batch (F.linear), for both low-rank predictors."""
    calls = _counting(monkeypatch)
    g = torch.Generator().manual_seed(1)
    d, D, r = 64, 160, 24
    dv = DejaVuMLPPredictor(d, r, D, k=40)
    dv.reset_random(g)
    svd = SVDPredictor(torch.randn(r, d, generator=g), torch.randn(D, r, generator=g), torch.randn(D, generator=g),
                       target="product", act="silu", A_up=torch.randn(r, d, generator=g),
                       B_up=torch.randn(D, r, generator=g))
    x = torch.randn(32, d, generator=g)
    for pred in (dv, svd):
        with torch.no_grad():
            batch = pred.scores(x)
            n = len(calls)
            one = torch.cat([pred.scores(x[i:i + 1]) for i in range(4)])
        assert len(calls) > n
        # the SVD product's scores reach about 1e4 here: fp32 summation order moves them by ulps of that scale
        torch.testing.assert_close(one, batch[:4], rtol=1e-4, atol=1e-6 * float(batch.abs().max()) + 1e-6)
