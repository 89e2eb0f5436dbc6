"""The decode runtime's products over :class:`ModelWeights`: embedding, dense / sparse projections, the FFN
variants, head-sparse attention, the LM head. Stateless apart from six backend options: ``ffn_dense``,
``cpu_rows``, ``o_proj`` (below), ``input_path`` (the input-sparse kernel path, kernels.ops.INPUT_PATHS),
``count_inputs`` (whether accelerators count the active inputs; the CPU kernels count as they go) and
``fuse`` (whether a layer input-sparse on every projection runs with the norms, act(gate)·up and the residual
adds fused into its kernels: CUDA, batch 1, not while counting inputs; workers.decode.layer).

``ffn_dense`` "auto": the dense FFN through the kernels where they are fastest (CPU row kernels with
``cpu_rows``; on CUDA, batch <= 8, the fused FFN kernel over every row), "torch": plain matmuls.
``cpu_rows`` (CPU backend): dense projections (QKV, O, LM head, dense FFN) through kernels.cpu's row kernels
(True) or torch matmuls (False/None); which is faster depends on the CPU (``workers.decode.timing.pick_cpu_dense``).
Sparse FFN on the CPU: kernels.cpu reads only the active rows of gate/up and of W_downᵀ, in one pass; over
GGUF blocks (``ModelWeights.quantized``) kernels.cpu_quant reads the active whole quantized rows of gate/up (of
QKV for head sparsity) and then the active rows of W_down's (W_o's) exact transposed blocks.
``o_proj``: the dense O projection through "torch" (``linear_t``: cuBLAS on CUDA, the row kernels with
``cpu_rows``), "kernel" (the down kernel over every head's rows of W_oᵀ, ``kernels.ops.head_sparse_out``) or
"auto" (the kernel on CUDA up to ``kernels.configs.O_KERNEL_MAX_BATCH``, else "torch").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu as cpu_kernels
from kernels import cpu_quant, ops
from kernels.common import ACTS, MAX_BATCH, apply_act
from kernels.configs import O_KERNEL_MAX_BATCH, use_dense
from kernels.quant import QuantWeight
from workers.decode.plan import InputGroup
from workers.decode.weights import LayerWeights, ModelWeights
from workers.loading.adapters import activation_fn

FFN_DENSE = ("auto", "torch")
O_PROJ = ("auto", "torch", "kernel")


class Blocks:
    def __init__(self, w: ModelWeights, *, ffn_dense: str = "auto", cpu_rows: bool | None = None,
                 count_inputs: bool = True, input_path: str = "auto", o_proj: str = "auto", fuse: bool = True):
        if ffn_dense not in FFN_DENSE:
            raise ValueError(f"ffn_dense must be one of {FFN_DENSE}, got {ffn_dense!r}")
        self.o_proj = o_proj
        self.w, self.ffn_dense, self.cpu_rows = w, ffn_dense, cpu_rows
        self.input_path = input_path
        # accelerators: counting active inputs costs a few small kernels per projection (the CPU kernels count
        # as they go); a timed run turns it off and measures realized sparsity in an untimed pass
        self.count_inputs = count_inputs
        self.fuse = fuse
        self.kv_all = torch.arange(w.dims.n_kv_heads, device=w.device, dtype=torch.int32)
        self.full_idx = torch.arange(w.dims.D, device=w.device, dtype=torch.int32)
        self.q_all = torch.arange(w.dims.n_heads, device=w.device, dtype=torch.int32)

    @property
    def o_proj(self) -> str:
        """The dense O projection's path (O_PROJ)."""
        return self._o_proj

    @o_proj.setter
    def o_proj(self, value: str):
        if value not in O_PROJ:
            raise ValueError(f"o_proj must be one of {O_PROJ}, got {value!r}")
        self._o_proj = value

    @property
    def input_path(self) -> str:
        """The input-sparse kernel path (kernels.ops.INPUT_PATHS)."""
        return self._input_path

    @input_path.setter
    def input_path(self, value: str):
        self._input_path = ops.check_input_path(value)

    def embed(self, ids, pos_ids):
        w = self.w
        x = cpu_quant.embedding(ids, w.embed) if isinstance(w.embed, QuantWeight) else F.embedding(ids, w.embed)
        if w.embed_scale is not None:
            x = x * w.embed_scale
        if w.proj_in is not None:
            x = x @ w.proj_in.t()
        if w.pos_embed is not None:
            x = x + F.embedding(pos_ids + w.pos_offset, w.pos_embed)
        return x

    def rows(self, h) -> bool:
        """Whether this product goes through the CPU row kernels."""
        return bool(self.cpu_rows) and h.dim() == 2 and h.shape[0] <= MAX_BATCH and ops.backend_name(h) == "cpu"

    def linear(self, h, w, b=None):
        """h @ wᵀ (+ b)."""
        if isinstance(w, QuantWeight):
            return cpu_quant.linear(h, w, b)
        if self.rows(h):
            return cpu_kernels.linear(h, w, b)
        z = h @ w.t()
        return z + b if b is not None else z

    def linear_t(self, a, w_t, b=None):
        """a @ w_t (+ b), w_t = Wᵀ [in, out] (or the quantized W [out, in] in that slot: the same map)."""
        if isinstance(w_t, QuantWeight):
            return cpu_quant.linear(a, w_t, b)
        if self.rows(a):
            return cpu_kernels.linear_t(a, w_t, b)
        z = a @ w_t
        return z + b if b is not None else z

    def o_kernel(self, batch: int) -> bool:
        """Whether the dense O projection at ``batch`` runs through the down kernel (``o_proj`` resolved)."""
        return self.o_proj == "kernel" or (
            self.o_proj == "auto" and self.w.device.type == "cuda" and batch <= O_KERNEL_MAX_BATCH)

    def out_dense(self, L: LayerWeights, a):
        """The dense O projection a @ W_o^T (+ b) of the attention output ``a`` [B, H * hd] (``o_proj``)."""
        if self.o_kernel(a.shape[0]) and not self.w.quantized:
            return ops.head_sparse_out(a, L.w_o_t, self.q_all, None, self.w.dims.head_dim, L.b_o)
        return self.linear_t(a, L.w_o_t, L.b_o)

    def logits(self, h):
        w = self.w
        if w.proj_out is not None:
            h = h @ w.proj_out.t()
        z = self.linear(h, w.lm_head)
        if w.softcap is not None:
            z = torch.tanh(z.float() / w.softcap) * w.softcap
        return z

    # ------------------------------------------------------------------ FFN
    def ffn_dense_(self, L: LayerWeights, h, act_mul):
        w = self.w
        act = w.act
        if w.quantized:       # the GGUF's blocks: one parallel region per FFN (kernels.cpu_quant.dense_ffn)
            return cpu_quant.dense_ffn(h, L.w_gate, L.w_up, L.w_down_t, act, b_up=L.b_up, b_down=L.b_down)
        if self.ffn_dense == "auto" and act in ACTS and self.rows(h):
            if w.gated:       # the whole FFN in one pass of the row kernel (kernels.cpu.dense_ffn)
                return ops.dense_ffn(h, L.w_gate, L.w_up, L.w_down_t, act)
            return ops.dense_mlp(h, L.w_up, L.b_up, L.w_down_t, L.b_down, act)
        # the full-index row kernel where it beats cuBLAS (batch 1, gated); elsewhere cuBLAS itself, not the
        # masked reference the sparse op falls back to (a mask build and multiply per layer: 1.5 ms per step at
        # batch 4 on a 7B model)
        if (w.device.type == "cuda" and self.ffn_dense == "auto" and act in ACTS and h.shape[0] <= MAX_BATCH
                and not use_dense(h.shape[0], w.dims.D, w.dims.D, gated=w.gated)):
            return self.sparse_ffn(L, h, self.full_idx, None)
        if w.gated:
            a = act_mul(h @ L.gu().t(), act)
        else:
            z = h @ L.w_up.t()
            a = activation_fn(act)(z + L.b_up if L.b_up is not None else z)
        y = a @ L.w_down_t
        return y + L.b_down if L.b_down is not None else y

    def sparse_ffn(self, L: LayerWeights, h, idx, count, seq_thr=None, seq_w=None):
        """The FFN over the neurons ``idx`` (``count`` None: all of idx) only; ``seq_thr`` the sequential filter
        on |act(gate)|, or with ``seq_w`` (c_i per neuron) on the damage |act(gate)·up|·c_i."""
        w = self.w
        if w.quantized:       # the GGUF's blocks: whole rows of gate / up, rows of W_down's exact transposed blocks
            down = _transposed(L, "down_t")
            if seq_w is not None:
                return cpu_quant.damage_filter_ffn(h, L.w_gate, L.w_up, down, idx, count, w.act, seq_thr, seq_w)
            if w.gated:
                return cpu_quant.sparse_ffn(h, L.w_gate, L.w_up, down, idx, count, w.act, seq_thr)
            return cpu_quant.sparse_mlp(h, L.w_up, L.b_up, down, L.b_down, idx, count, w.act)
        if seq_w is not None:
            return ops.damage_filter_ffn(h, L.w_gate, L.w_up, L.w_down_t, idx, count, w.act, seq_thr, seq_w)
        if w.gated:
            return ops.sparse_ffn(h, L.w_gate, L.w_up, L.w_down_t, idx, count, w.act, seq_thr,
                                  allow_dense=count is None)
        return ops.sparse_mlp(h, L.w_up, L.b_up, L.w_down_t, L.b_down, idx, count, w.act, allow_dense=count is None)

    def in_linear(self, x, w_t, group, counts, bias=None, prologue=None, residual=None):
        """x @ w_t (+ bias) over the active inputs only (input sparsity); ``group`` a ``plan.InputGroup``.
        ``counts`` (its columns of the layer's input counters) get the active entries. ``prologue`` /
        ``residual``: the fused layer's (kernels.ops.input_sparse_linear_segments; counts None then)."""
        thr, sizes = group.thresholds, group.sizes
        if isinstance(w_t, cpu_quant.TransposedParts):      # GGUF blocks (plan.py made the layout)
            assert prologue is None and residual is None, "the quantized layer fuses natively (native_layer)"
            y = cpu_quant.input_sparse_linear_parts(x, w_t, thr, bias, counts=counts)
        elif prologue is not None or residual is not None:
            assert counts is None, "the fused layer does not count inputs"
            return ops.input_sparse_linear_segments(x, w_t, thr, sizes, bias, path=self.input_path,
                                                    prologue=prologue, residual=residual)
        elif ops.backend_name(x) == "cpu":
            y = cpu_kernels.input_sparse_linear_segments(x, w_t, thr, sizes, bias, counts=counts)
        else:
            y = ops.input_sparse_linear_segments(x, w_t, thr, sizes, bias, path=self.input_path)
            if self.count_inputs:
                on = x.abs().float()[:, None, :] > (thr[None, :, :] if thr.dim() == 2 else thr[None, :, None])
                counts.add_(on.sum((0, 2)).to(counts.dtype))
        return y

    def topk_in_linear(self, x, w_t, k, sizes, col, bias=None, counts=None):
        """x @ w_t (+ bias) over each token's ``k`` largest |x_j|, through the input-sparse kernels (TEAL's): on
        the CPU the kernel finds each token's threshold itself (any batch); elsewhere one token's threshold comes
        from ``ops.topk_threshold`` (one launch). ``sizes`` / ``col``: the group's segments and first counter."""
        if ops.backend_name(x) == "cpu":
            return cpu_kernels.input_sparse_linear_segments(x, w_t, None, sizes, bias, counts=counts, topk=k)
        assert x.shape[0] == 1, "one threshold per segment: beyond one token, topk_linear"
        thr = ops.topk_threshold(x, k, len(sizes))[0]
        return self.in_linear(x, w_t, InputGroup(thr, tuple(sizes), col), counts, bias)

    def topk_linear(self, x, w_t, top, bias=None, counts=None):
        """x @ w_t (+ bias) over each row's inputs ``top`` [B, k] only (LaRoSA's top-k): the rows of w_t
        [in, out] of the active inputs (the batch's union beyond batch 1), read once (``ops.gather_down``)."""
        B = x.shape[0]
        if B == 1:
            idx, count = top.reshape(-1).to(torch.int32), None
            u = x.index_select(1, idx)
        else:
            keep = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter_(1, top.long(), True)
            idx, count = ops.union_active(keep)
            u = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)).index_select(1, idx.long())
        if counts is not None:
            counts.add_(B * top.shape[1])
        return ops.gather_down(u.contiguous(), w_t, idx, count, bias, out_dtype=x.dtype)

    def ffn_input_sparse(self, L: LayerWeights, h, ent, stat_in, act_mul):
        """The FFN with input sparsity on gate|up (one pass over the shared input), fc1, and/or down;
        ``stat_in`` is the layer's row of input counters."""
        w = self.w
        if w.gated:
            gu = (self.in_linear(h, L.w_gu_t, ent["gu"], ent["gu"].counts(stat_in)) if "gu" in ent
                  else self.linear(h, L.gu()))
            a = act_mul(gu, w.act)
        else:
            z = (self.in_linear(h, L.w_up_t, ent["up"], ent["up"].counts(stat_in), L.b_up) if "up" in ent
                 else self.linear(h, L.w_up, L.b_up))
            a = activation_fn(w.act)(z)
        if "down" in ent:
            return self.in_linear(a, L.w_down_in, ent["down"], ent["down"].counts(stat_in), L.b_down)
        return self.linear_t(a, L.w_down_t, L.b_down)

    def ffn_threshold(self, L: LayerWeights, h, thr, stat):
        """Gate-threshold FFN: the first projection dense once (the fastest dense product), keep the neurons with
        |act(gate)| > t, then up rows and W_downᵀ rows of the kept neurons only (1/3 + 2/3·(1 - s) of a gated
        FFN). Each token uses its own kept set; the batch reads the union's rows once. ``stat`` [1] counts the
        kept neurons."""
        w = self.w
        t, b_score = thr
        w1 = L.w_gate if w.gated else L.w_up
        b_act = None if w.gated else L.b_up
        z = self.linear(h, w1)
        w_up = L.w_up if w.gated else None
        if w.quantized:
            return cpu_quant.threshold_ffn(h, z, w_up, _transposed(L, "down_t"), t, w.act, b_act=b_act,
                                           b_score=b_score, b_down=L.b_down, stat=stat)
        if ops.backend_name(h) == "cpu":
            r = cpu_kernels.threshold_ffn(h, z, w_up, L.w_down_t, t, w.act, b_act=b_act, b_score=b_score,
                                          b_down=L.b_down, stat=stat)
            if r is not None:
                return r[0]
        a = apply_act(z if b_act is None else z + b_act, w.act)
        s = a if b_score is b_act else apply_act(z if b_score is None else z + b_score, w.act)
        keep = s.abs() > t
        coef = torch.where(keep, a, torch.zeros((), dtype=a.dtype, device=a.device))
        idx, count, cv = ops.compact(keep[0] if keep.shape[0] == 1 else keep.any(0), None, coef)
        stat += count[0]
        u = ops.gather_gemv(h, L.w_up, idx, count, scale=cv, out_dtype=torch.float32) if w.gated else cv
        return ops.gather_down(u.to(h.dtype), L.w_down_t, idx, count, L.b_down, out_dtype=h.dtype)

    # ------------------------------------------------------------------ attention
    def sparse_attn(self, L: LayerWeights, l: int, h, q_idx, q_count, cache, attn):
        """Attention of the active query heads only (``head_sparse_qkv`` / ``head_sparse_out``). K/V: every
        head (kv_mode "exact", ``cache.valid`` None) or only the KV heads the active query heads need, the
        skipped (head, position) entries masked out of later attention (kv_mode "active")."""
        dims = self.w.dims
        H, KV, hd = dims.n_heads, dims.n_kv_heads, dims.head_dim
        B, dev = h.shape[0], h.device
        exact = cache.valid is None
        if exact:
            kv_idx, kv_count = self.kv_all, None
        else:
            kv_idx, kv_count, _ = ops.kv_heads_for(q_idx, q_count, H, KV)
        quant = self.w.quantized      # the GGUF's blocks: whole QKV rows, rows of W_o's exact transposed blocks
        qkv_op = cpu_quant.head_sparse_qkv if quant else ops.head_sparse_qkv
        q, k, v = qkv_op(h.contiguous(), L.w_qkv, q_idx, q_count, kv_idx, kv_count, H, KV, hd, L.b_qkv)
        vmask = None
        if not exact:    # K/V rows of the active KV heads only; the rest go to the spare slot KV and stay masked
            ktgt = torch.where(torch.arange(kv_idx.shape[0], device=dev) < kv_count, kv_idx.long(), KV)
            k = torch.zeros(B, KV + 1, hd, device=dev, dtype=k.dtype).index_copy_(1, ktgt, k)[:, :KV]
            v = torch.zeros(B, KV + 1, hd, device=dev, dtype=v.dtype).index_copy_(1, ktgt, v)[:, :KV]
            on = torch.zeros(KV + 1, dtype=torch.bool, device=dev).index_fill_(0, ktgt, True)
            vmask = cache.mark_written(l, on)
        a_act = attn(q, k, v, cache.k[l], cache.v[l], cache.pos, *(L.rope or (None, None)), L.qn, L.kn, self.w.eps,
                     L.window, q_idx=q_idx, q_count=q_count, n_heads=H, valid=vmask)
        if quant:
            return cpu_quant.head_sparse_out(a_act, _transposed(L, "o_t"), q_idx, q_count, hd, L.b_o)
        return ops.head_sparse_out(a_act, L.w_o_t, q_idx, q_count, hd, L.b_o)


def _transposed(L: LayerWeights, key: str):
    """The exact transposed blocks (kernels.quant.QuantWeightT) of O / down that workers.decode.plan made for a
    plan's output sparsity over GGUF blocks."""
    tp = L.layouts.get(key)
    if not isinstance(tp, cpu_quant.TransposedParts):
        raise RuntimeError(f"no {key!r} layout: output sparsity over GGUF blocks needs the plan built for these "
                           "weights (set_plan; runtimes sharing weights: set a plan on one of them only)")
    return tp.one
