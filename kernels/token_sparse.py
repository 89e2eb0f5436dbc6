"""Per-token sparse FFN and head-sparse output projection for many tokens at once (prefill, evaluation).

Decode kernels (``kernels.ops``: ``sparse_ffn``, ``head_sparse_out``) take one shared active set (an index
buffer) for a batch of up to 8 tokens; the ``token_sparse_*`` ops here take a boolean mask per token. Evaluating a
predictor over a 512-token window needs a *different* set per token; gathering ``W[idx[t]]`` per token would
materialize T·k·d weights. Here the selection is a CSR pattern over (token, neuron) and only the selected
entries are computed: the gate/up values with a sampled dense-dense product (SDDMM: one dot product per
selected (token, neuron) pair), the down projection with a CSR × dense product over ``W_downᵀ`` (each selected
neuron contributes one row). Cost scales with the number of selected pairs; nothing dense is computed and
then masked. Works on any torch device that implements sparse CSR (CPU, CUDA).

``masked_token_ffn`` computes the same function as dense products with the unselected entries zeroed (the
evaluation path where that is faster); ``reference_token_sparse_ffn`` is it with int counts, for tests.
"""
from __future__ import annotations

import warnings

import torch

from kernels.common import apply_act

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


def _csr(mask_rows: torch.Tensor, cols: torch.Tensor, n_rows: int, n_cols: int, values: torch.Tensor):
    counts = torch.bincount(mask_rows, minlength=n_rows)
    crow = torch.zeros(n_rows + 1, dtype=torch.int64, device=cols.device)
    crow[1:] = counts.cumsum(0)
    return torch.sparse_csr_tensor(crow, cols, values, size=(n_rows, n_cols), check_invariants=False)


def _sampled(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Values of (x @ w.T) at the (rows, cols) pairs only."""
    T, D = x.shape[0], w.shape[0]
    pattern = _csr(rows, cols, T, D, torch.zeros(cols.numel(), dtype=x.dtype, device=x.device))
    return torch.sparse.sampled_addmm(pattern, x, w.t(), beta=0.0).values()


def token_sparse_ffn(x: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor, mask: torch.Tensor,
                     act: str, w_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None,
                     b_down: torch.Tensor | None = None, filter_threshold: float | None = None,
                     filter_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, int, int]:
    """FFN on the selected neurons of each token.

    x [T, d]; w_up, w_gate, w_down_t [D, d] (w_down_t = W_downᵀ); mask bool [T, D].
    Gated: h = act(gate)·up. Non-gated: h = act(up + b_up).
    ``filter_threshold`` (sequential pipeline): after the first projection, entries with |act(·)| <= threshold
    are dropped before the remaining projections (false positives of the predictor cost one dot product).
    With ``filter_weight`` c [D] (gated only), gate and up both run on the selected pairs and the filter reads
    the damage |h|·c_i instead: entries with |h_ti|·c_i <= threshold are dropped before down.
    Returns (y [T, d], pairs computed in the first projection (and in up, with ``filter_weight``), pairs kept for
    the down projection).
    """
    _check_filter(w_gate, filter_threshold, filter_weight)
    if x.dim() != 2 or mask.shape != (x.shape[0], w_up.shape[0]):
        raise ValueError(f"x must be [T, d] and mask [T, D]; got {tuple(x.shape)} and {tuple(mask.shape)}")
    if w_down_t.shape != w_up.shape:
        raise ValueError("w_down_t must be W_down transposed: [D, d]")
    T, d = x.shape
    D = w_up.shape[0]
    rows, cols = mask.nonzero(as_tuple=True)
    n_first = rows.numel()
    first = w_gate if w_gate is not None else w_up
    z = _sampled(x, first, rows, cols)
    if w_gate is None and b_up is not None:
        z = z + b_up[cols]
    a = apply_act(z, act)
    if filter_weight is not None:      # the damage filter needs up on every selected pair
        h = a * _sampled(x, w_up, rows, cols)
        keep = _passes_filter(a, h, filter_threshold, filter_weight[cols])
        rows, cols, h = rows[keep], cols[keep], h[keep]
    else:                              # the gate filter (if any) before up: up only on the survivors
        if filter_threshold is not None:
            keep = _passes_filter(a, None, filter_threshold, None)
            rows, cols, a = rows[keep], cols[keep], a[keep]
        h = a * _sampled(x, w_up, rows, cols) if w_gate is not None else a
    y = _csr(rows, cols, T, D, h.to(x.dtype)) @ w_down_t
    if b_down is not None:
        y = y + b_down
    return y, n_first, rows.numel()


def _passes_filter(a, h, threshold: float, weight):
    """The sequential pipeline's filter: |h|·c > f with the damage weights c, else |act(first projection)| > f."""
    return (h.abs() * weight if weight is not None else a.abs()) > threshold


def _check_filter(w_gate, filter_threshold, filter_weight) -> None:
    if filter_weight is not None and (w_gate is None or filter_threshold is None):
        raise ValueError("filter_weight (the damage filter) needs a gated FFN and a filter_threshold")


def token_sparse_head_out(attn: torch.Tensor, w_o: torch.Tensor, head_mask: torch.Tensor, head_dim: int,
                          b_o: torch.Tensor | None = None) -> torch.Tensor:
    """Output projection over each token's active heads only (``kernels.ops.head_sparse_out`` is the decode op
    over one shared index buffer of heads, with W_oᵀ).

    attn [T, H·hd] (every head's output, concatenated), w_o [d, H·hd], head_mask bool [T, H].
    """
    T, width = attn.shape
    H = head_mask.shape[1]
    if width != H * head_dim:
        raise ValueError(f"attn width {width} != {H} heads x {head_dim}")
    rows, heads = head_mask.nonzero(as_tuple=True)
    off = torch.arange(head_dim, device=attn.device)
    cols = (heads[:, None] * head_dim + off).reshape(-1)
    rows = rows.repeat_interleave(head_dim)
    vals = attn[rows, cols]
    y = _csr(rows, cols, T, width, vals) @ w_o.t()
    return y + b_o if b_o is not None else y


def masked_token_ffn(x, w_up, w_down_t, mask, act, w_gate=None, b_up=None, b_down=None, filter_threshold=None,
                     filter_weight=None, count: bool = True):
    """``token_sparse_ffn``'s function and counts as dense products with the unselected (token, neuron) entries
    zeroed (the evaluation path where dense is cheaper than the sparse products; ``sparse_exec`` mode "masked").
    The counts stay tensors on x's device: no host sync per call. ``count=False``: no counts (None, None).
    ``mask``: bool [T, D], or a function of the activations (a = act(first projection), h = what down reads) that
    gives it (a predictor whose scores are those activations: not computed twice)."""
    _check_filter(w_gate, filter_threshold, filter_weight)
    if w_gate is not None:
        a = apply_act(x @ w_gate.t(), act)
    else:
        a = apply_act(x @ w_up.t() + (b_up if b_up is not None else 0), act)
    h = a * (x @ w_up.t()) if w_gate is not None else a
    if callable(mask):
        mask = mask(a, h)
    keep = mask if filter_threshold is None else mask & _passes_filter(a, h, filter_threshold, filter_weight)
    y = (h * keep) @ w_down_t
    y = y + b_down if b_down is not None else y
    return (y, mask.sum(), keep.sum()) if count else (y, None, None)


def reference_token_sparse_ffn(x, w_up, w_down_t, mask, act, w_gate=None, b_up=None, b_down=None,
                               filter_threshold=None, filter_weight=None):
    """Dense computation, then the selection applied (``masked_token_ffn`` with int counts): the ground truth for
    tests."""
    y, n_first, n_kept = masked_token_ffn(x, w_up, w_down_t, mask, act, w_gate, b_up, b_down, filter_threshold,
                                          filter_weight)
    return y, int(n_first), int(n_kept)
