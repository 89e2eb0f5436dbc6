"""Torch reference for every kernel op: same signatures and outputs as kernels.ffn_triton /
kernels.attn_triton, any device, no sync (fixed shapes, count stays on the device).

Computes in fp32 (fp64 if the inputs are fp64, which the tests use as ground truth) and casts the
result to the output dtype of the fast op. Written for clarity, not speed (it materializes the
gathered rows; the Ascend path in kernels.npu is the one meant to run).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import apply_act, group_rows, query_heads, valid_mask


def _cdt(*ts):
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def _rows(idx, count):
    valid = valid_mask(idx, count)
    return valid, group_rows(idx, valid, 1)


def gated_gather_gemv(x, w_gate, w_up, idx, count=None, act="silu", out_dtype=None, *, config=None):
    cd = _cdt(x, w_gate)
    valid, rows = _rows(idx, count)
    xf = x.to(cd)
    g = xf @ w_gate.index_select(0, rows).to(cd).T
    u = xf @ w_up.index_select(0, rows).to(cd).T
    h = torch.where(valid[None, :], apply_act(g, act) * u, torch.zeros((), dtype=cd, device=x.device))
    return h.to(out_dtype or x.dtype)


def gather_gemv(x, w, idx, count=None, act="none", bias=None, scale=None, out_dtype=None, *, config=None):
    cd = _cdt(x, w)
    valid, rows = _rows(idx, count)
    z = x.to(cd) @ w.index_select(0, rows).to(cd).T
    if bias is not None:
        z = z + bias.index_select(0, rows).to(cd)[None, :]
    h = apply_act(z, act)
    if scale is not None:
        h = scale.to(cd) * h
    h = torch.where(valid[None, :], h, torch.zeros((), dtype=cd, device=x.device))
    return h.to(out_dtype or x.dtype)


def gather_down(h, w_t, idx, count=None, bias=None, group=1, *, out_dtype=None, config=None):
    cd = _cdt(h, w_t)
    valid = valid_mask(idx, count)
    rows = group_rows(idx, valid, group)
    vg = valid.repeat_interleave(group) if group > 1 else valid
    hh = torch.where(vg[None, :], h.to(cd), torch.zeros((), dtype=cd, device=h.device))
    y = hh @ w_t.index_select(0, rows).to(cd)
    if bias is not None:
        y = y + bias.to(cd)[None, :]
    return y.to(out_dtype or w_t.dtype)


def compact(keep, idx=None, values=None):
    keep = keep.to(torch.bool)
    n = keep.shape[0]
    order = torch.argsort((~keep).to(torch.int8), stable=True)
    kept = keep[order]
    src = idx[order].to(torch.int32) if idx is not None else order.to(torch.int32)
    idx2 = torch.where(kept, src, torch.zeros((), dtype=torch.int32, device=keep.device))
    count2 = keep.sum(dtype=torch.int32).reshape(1)
    assert idx2.shape[0] == n
    if values is not None:
        v2 = torch.where(kept[None, :], values[:, order].float(), torch.zeros((), device=keep.device))
        return idx2, count2, v2
    return idx2, count2


def union_active(mask):
    return compact(mask.any(dim=0))


def sequential_gate_filter(x, w_gate, idx, count=None, act="silu", threshold=0.0, *, config=None):
    cd = _cdt(x, w_gate)
    valid, rows = _rows(idx, count)
    a = apply_act(x.to(cd) @ w_gate.index_select(0, rows).to(cd).T, act)
    a = torch.where(valid[None, :], a, torch.zeros((), dtype=cd, device=x.device))
    keep = valid & (a.abs() > threshold).any(dim=0)
    order = torch.argsort((~keep).to(torch.int8), stable=True)
    kept = keep[order]
    idx2 = torch.where(kept, idx[order].to(torch.int32), torch.zeros((), dtype=torch.int32, device=x.device))
    a2 = torch.where(kept[None, :], a[:, order], torch.zeros((), dtype=cd, device=x.device))
    count2 = keep.sum(dtype=torch.int32).reshape(1)
    return (a2 if cd == torch.float64 else a2.float()), idx2, count2


def sparse_ffn(x, w_gate, w_up, w_down_t, idx, count=None, act="silu", threshold=None, *, path=None, config=None):
    cd = _cdt(x, w_gate)
    if threshold is not None:
        a2, idx2, count2 = sequential_gate_filter(x, w_gate, idx, count, act, threshold)
        h = gather_gemv(x, w_up, idx2, count2, scale=a2, out_dtype=cd)
        return gather_down(h, w_down_t, idx2, count2, out_dtype=x.dtype)
    h = gated_gather_gemv(x, w_gate, w_up, idx, count, act, out_dtype=cd)
    return gather_down(h, w_down_t, idx, count, out_dtype=x.dtype)


def sparse_mlp(x, w_fc1, b_fc1, w_fc2_t, b_fc2, idx, count=None, act="relu", *, path=None, config=None):
    cd = _cdt(x, w_fc1)
    h = gather_gemv(x, w_fc1, idx, count, act=act, bias=b_fc1, out_dtype=cd)
    return gather_down(h, w_fc2_t, idx, count, bias=b_fc2, out_dtype=x.dtype)


def dense_ffn(x, w_gate, w_up, w_down_t, act="silu", mask=None):
    """Dense FFN in the kernels' weight layout (w_down_t = W_down^T); ``mask`` [D] zeroes inactive neurons."""
    h = apply_act(x @ w_gate.T, act) * (x @ w_up.T)
    if mask is not None:
        h = h * mask.to(h.dtype)
    return h @ w_down_t


def dense_mlp(x, w_fc1, b_fc1, w_fc2_t, b_fc2, act="relu", mask=None):
    z = x @ w_fc1.T
    if b_fc1 is not None:
        z = z + b_fc1
    h = apply_act(z, act)
    if mask is not None:
        h = h * mask.to(h.dtype)
    y = h @ w_fc2_t
    return y + b_fc2 if b_fc2 is not None else y


def active_mask(idx, count, n):
    """[n] mask of the active rows (device-side; duplicates and padding are harmless)."""
    valid = valid_mask(idx, count)
    m = torch.zeros(n, dtype=torch.int32, device=idx.device)
    m.scatter_add_(0, torch.where(valid, idx.long(), 0), valid.to(torch.int32))
    return m > 0


# ---- input sparsity (TEAL / WINA) ---------------------------------------------------------------
def input_sparse_linear(x, w_t, threshold, bias=None, *, config=None):
    """y = mask(x) @ w_t (+ bias) with mask(x)[b, i] = x[b, i] if |x[b, i]| > threshold else 0.

    ``w_t`` is W^T [in, out]; ``threshold`` a float, a one-element tensor, or a tensor [in] of one threshold per
    input channel (compared in fp32 or finer)."""
    cd = _cdt(x, w_t)
    xf = x.to(cd)
    t = torch.as_tensor(threshold, dtype=torch.float32, device=x.device)
    t = (t.reshape(()) if t.numel() == 1 else t.reshape(x.shape[-1])).to(cd)
    xm = torch.where(xf.abs() > t, xf, torch.zeros((), dtype=cd, device=x.device))
    y = xm @ w_t.to(cd)
    if bias is not None:
        y = y + bias.to(cd)[None, :]
    return y.to(x.dtype)


def apply_prologue(x, p):
    """x through the prologue ``p`` (kernels.common.Prologue; None: x itself), as the unfused layer does it."""
    if p is None:
        return x
    if p.kind == "act_mul":
        d = x.shape[-1] // 2
        return apply_act(x[..., :d], p.act) * x[..., d:]
    return rms_norm(x, p.weight, p.eps, one_plus=p.kind == "rms1p")


def around_product(product, x, prologue=None, residual=None):
    """The fused layer's ops composed around an unfused ``product`` (a function of the input): the prologue's
    output through it, then the residual add (rounded as the layer's own add)."""
    y = product(apply_prologue(x, prologue))
    return y if residual is None else residual + y.to(residual.dtype)


def input_sparse_linear_segments(x, w_t, thresholds, sizes, bias=None, *, config=None, prologue=None,
                                 residual=None):
    """Projections sharing x, W^T concatenated along out (fused QKV): segment j (``sizes[j]`` columns) uses
    its own threshold ``thresholds[j]`` (a float tensor of len(sizes) or a sequence of floats). ``prologue``
    (kernels.common.Prologue): the input is ``apply_prologue(x, prologue)``; ``residual``: the result is
    residual + the product (the layer's residual add)."""
    if prologue is not None or residual is not None:
        return around_product(lambda h: input_sparse_linear_segments(h, w_t, thresholds, sizes, bias), x, prologue,
                              residual)
    sizes = [int(s) for s in sizes]
    assert sum(sizes) == w_t.shape[1], f"segment sizes {sizes} must sum to out = {w_t.shape[1]}"
    outs, lo = [], 0
    for j, s in enumerate(sizes):
        b = None if bias is None else bias[lo:lo + s]
        outs.append(input_sparse_linear(x, w_t[:, lo:lo + s], thresholds[j], b))
        lo += s
    return torch.cat(outs, dim=1)


# ---- attention ---------------------------------------------------------------------------------
def kv_heads_for(q_idx, q_count, n_heads, n_kv_heads):
    g = n_heads // n_kv_heads
    dev = q_idx.device
    valid = valid_mask(q_idx, q_count)
    kvh = torch.where(valid, q_idx.long() // g, 0)
    act = torch.zeros(n_kv_heads, dtype=torch.int32, device=dev)
    act.scatter_add_(0, kvh, valid.to(torch.int32))
    act = act > 0
    kv_idx, kv_count = compact(act)
    rank = torch.cumsum(act.to(torch.int32), 0) - act.to(torch.int32)
    kv_slot = torch.where(valid, rank[kvh], 0).to(torch.int32)
    return kv_idx, kv_count, kv_slot


def head_sparse_qkv(x, w_qkv, q_idx, q_count, kv_idx, kv_count, n_heads, n_kv_heads, head_dim, bias=None,
                    *, config=None):
    B = x.shape[0]
    cd = _cdt(x, w_qkv)
    outs = []
    for part_idx, part_count, off in ((q_idx, q_count, 0), (kv_idx, kv_count, n_heads),
                                      (kv_idx, kv_count, n_heads + n_kv_heads)):
        valid = valid_mask(part_idx, part_count)
        rows = group_rows(part_idx.long() + off, valid, head_dim)
        vg = valid.repeat_interleave(head_dim)
        z = x.to(cd) @ w_qkv.index_select(0, rows).to(cd).T
        if bias is not None:
            z = z + bias.index_select(0, rows).to(cd)[None, :]
        z = torch.where(vg[None, :], z, torch.zeros((), dtype=cd, device=x.device))
        outs.append(z.to(x.dtype).view(B, part_idx.shape[0], head_dim))
    return tuple(outs)


def head_sparse_out(attn, w_o_t, q_idx, q_count=None, head_dim=None, bias=None, *, config=None):
    B = attn.shape[0]
    return gather_down(attn.reshape(B, -1), w_o_t, q_idx, q_count, bias=bias, group=head_dim,
                       out_dtype=attn.dtype)


def topk_select(scores, k):
    """Indices of the ``k`` largest entries of each row of ``scores`` [B, n] (or [n]), int32, ascending; ties at
    the k-th value go to the lowest indices (stable descending sort). Same output as kernels.select_triton."""
    s = scores.float()
    s = torch.where(s == 0, torch.zeros((), device=s.device), s)          # -0.0 == +0.0
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(dim=-1).values.to(torch.int32)


HS_TILE = 16      # vocabulary rows per tile of a head screen (kernels/cpu_head.c)


@dataclass(frozen=True)
class HeadScreen:
    """A predicted head's score table S [V, r] as int8 codes with one fp32 scale per vocabulary row (scale =
    max|row| / 127), tiled for kernels/cpu_head.c: ``codes`` int8 [V / HS_TILE, r, HS_TILE] (a tile's j-th inputs
    side by side), ``scale`` fp32 [V]. ``of(s)`` quantizes; ``dequantize()`` gives the values the kernel uses."""

    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def vocab(self) -> int:
        return self.scale.shape[0]

    @property
    def rank(self) -> int:
        return self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4

    @classmethod
    def of(cls, s: torch.Tensor) -> "HeadScreen":
        v, r = s.shape
        if v % HS_TILE:
            raise ValueError(f"a head screen needs a multiple of {HS_TILE} vocabulary rows, got {v}")
        s = s.float()
        scale = s.abs().amax(1) / 127.0
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(s * inv[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.reshape(v // HS_TILE, HS_TILE, r).transpose(1, 2).contiguous(), scale.contiguous())

    def code_rows(self) -> torch.Tensor:
        """int8 [V, r]: the codes one vocabulary row each (out of the tiles)."""
        t, r, _ = self.codes.shape
        return self.codes.transpose(1, 2).reshape(t * HS_TILE, r)

    def dequantize(self) -> torch.Tensor:
        """fp32 S [V, r]: scale[v] · code[v, j]."""
        return self.code_rows().float() * self.scale[:, None]


def head_screen(z, screen: HeadScreen):
    """out [B, V] = scale[v] · Σ_j z[b, j] · code[v, j] (each row's sum in fp64, rounded to fp32)."""
    return ((z.double() @ screen.code_rows().double().t()) * screen.scale.double()).float()


def topk_index(x, k):
    """int64 [B, k]: each row's k largest values' indices (as a set; of values equal to the k-th largest, the
    lowest indices), in increasing index order."""
    x = x.float()
    kth = x.topk(k, dim=-1).values[:, -1:]
    above = x > kth
    need = k - above.sum(-1, keepdim=True)
    ties = (x == kth) & (torch.cumsum((x == kth).long(), -1) <= need)
    keep = above | ties
    return torch.nonzero(keep)[:, 1].reshape(x.shape[0], k)


def topk_threshold(x, k, nseg=1):
    """Each row's threshold for its ``k`` largest |x_j|: fp32 [B, nseg] (``nseg`` equal copies, one per output
    segment of an input-sparse product), the float just below the k-th largest |x_j| (-1 where that is 0), so
    that the input-sparse kernels' rule |x_j| > t keeps exactly those k (and any entry tied with the k-th).
    Same output as kernels.select_triton.topk_threshold."""
    a = (x[None] if x.dim() == 1 else x).abs().float()
    kth = a.kthvalue(a.shape[-1] - k + 1, dim=-1).values
    t = torch.where(kth > 0, torch.nextafter(kth, torch.zeros((), device=a.device)), torch.full_like(kth, -1.0))
    return t[:, None].expand(-1, nseg).contiguous()


# ------------------------------------------------------------------------------------------------
# decode-step glue: RMS norms and one-token attention (the reference of kernels.decode_attn_triton and of the
# CPU backend's native glue)
# ------------------------------------------------------------------------------------------------
def rms_norm(x, w, eps: float, one_plus: bool = False):
    """RMS norm over the last dim in fp32: Llama's w * (x / rms(x)).to(x.dtype); ``one_plus`` (Gemma, ``w``
    already 1 + w in fp32): (x / rms(x) * w).to(x.dtype)."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w).to(x.dtype) if one_plus else w * y.to(x.dtype)


def add_rms_norm(x, y, w, eps: float, one_plus: bool = False):
    """(x + y, rms_norm(x + y)): the residual add and the next norm."""
    x = x + y
    return x, rms_norm(x, w, eps, one_plus)


def masked_inputs(x, threshold: float, scale=None):
    """An input-sparse projection's masked input: x where its score (|x|, or |x| · scale: WINA) exceeds
    ``threshold``, else 0 (``workers.sparsity.input_sparse``'s masked mode)."""
    a = x.abs()
    if scale is not None:
        a = a * scale.to(a.dtype)
    return torch.where(a > threshold, x, 0)


def rot_half(t):
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


def qk_norm_rope(q, k, cos=None, sin=None, q_norm=None, k_norm=None, eps: float = 1e-6):
    """What attention does to q and k before the scores: the q/k norms (Gemma: ``rms_norm`` with ``one_plus``)
    and rotate-half RoPE with the table rows ``cos`` / ``sin`` (fp32, cast to q's dtype, broadcast over the
    leading dims). One definition for the decode step's reference and the prefill."""
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps, one_plus=True)
        k = rms_norm(k, k_norm, eps, one_plus=True)
    if cos is not None:
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rot_half(q) * sin
        k = k * cos + rot_half(k) * sin
    return q, k


def decode_attention(q, k, v, k_cache, v_cache, pos, cos_t=None, sin_t=None, q_norm=None, k_norm=None,
                     eps: float = 1e-6, window: int | None = None, q_idx=None, q_count=None, n_heads=None,
                     valid=None):
    """One decode position. q [B, S, hd]: every query head (``q_idx`` None, S = H) or the compact active heads
    ``q_idx`` [S] of ``n_heads`` (the first ``q_count`` valid); k/v [B, KV, hd]; caches [B, KV', L, hd]
    (KV' >= KV); pos [1] int64 on the device. Query head i reads KV head i // (H / KV). Applies the q/k norms
    (Gemma: ``rms_norm`` with ``one_plus``) and RoPE (rotate-half, tables [max_pos, hd] fp32), writes k/v at
    ``pos``, attends over the positions <= pos (and inside the sliding ``window``). Scores are not scaled (the
    scale is folded into the weights). ``valid`` [B, KV, L] bool: an extra per-(head, position) mask. Returns
    [B, S * hd]; compact rows j >= q_count hold 0."""
    B, S, hd = q.shape
    KV = k.shape[1]
    query_heads(S, q_idx, n_heads)
    rows = (cos_t.index_select(0, pos), sin_t.index_select(0, pos)) if cos_t is not None else (None, None)
    q, k = qk_norm_rope(q, k, *rows, q_norm, k_norm, eps)          # the position's table rows [1, hd]
    kc, vc = k_cache[:, :KV], v_cache[:, :KV]
    kc.index_copy_(2, pos, k.unsqueeze(2))
    vc.index_copy_(2, pos, v.unsqueeze(2))
    if q_idx is not None:   # the active heads in their places (the rest zero; slots past q_count to a spare row)
        ok = (torch.arange(S, device=q.device) < q_count) if q_count is not None else None
        tgt = q_idx.long() if ok is None else torch.where(ok, q_idx.long(), n_heads)
        q = torch.zeros(B, n_heads + 1, hd, device=q.device, dtype=q.dtype).index_copy_(1, tgt, q)[:, :n_heads]
    H = q.shape[1]
    L = kc.shape[2]
    j = torch.arange(L, device=q.device)
    m = j <= pos
    if window is not None:
        m = m & (j > pos - window)
    m = m.view(1, 1, 1, L)
    if valid is not None:
        m = m & valid[:, :, None, :]
    s = torch.matmul(q.reshape(B, KV, H // KV, hd), kc.transpose(-1, -2)).float()   # [B, KV, G, L]
    p = torch.softmax(s.masked_fill(~m, float("-inf")), dim=-1).to(q.dtype)
    a = torch.matmul(p, vc).reshape(B, H, hd)
    if q_idx is None:
        return a.reshape(B, H * hd)
    a = a.index_select(1, q_idx.long() if ok is None else torch.where(ok, q_idx.long(), 0))
    if ok is not None:
        a = torch.where(ok.view(1, S, 1), a, torch.zeros((), dtype=a.dtype, device=a.device))
    return a.reshape(B, S * hd)
