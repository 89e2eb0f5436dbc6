"""The decoder layer, written once for the prefill and the one-token step.

    h = forward(weights, x, fns, Prompt(blocks, cache))                              # prefill: x [B, T, d]
    h = forward(weights, x, fns, Step(blocks, plan, cache, counters, sets, fns))     # decode step: x [B, d]

:func:`forward` runs every layer on the embedded tokens ``x`` and returns the final-normed hidden state: per
layer the attention of its normed input (``impl.attn``), the post-attention norm (Gemma), the residual add and
the FFN norm, the FFN (``impl.ffn``), the post-FFN norm, the residual add and the next layer's norm (the final
norm after the last layer). A layer the step fuses (``impl.fuses``: input sparsity on every projection, CUDA,
batch 1) runs as four kernels and attention instead (``Step.fused``): QKV with the RMS norm in its prologue, O
with the residual add in its epilogue, gate|up with the FFN norm in its prologue, down with act(gate)·up in its
prologue and the residual add in its epilogue; the norm of the stream is then taken only where a layer that is
not fused (or the final norm) needs it. ``fns`` are the glue functions (workers.decode.glue). ``impl`` says how attention and
the FFN run: :class:`Prompt` (every position of the prompts, dense; K/V written at positions 0..T-1) or
:class:`Step` (one token; the plan's sparse paths, attention over the static cache). Both take
``(l, L, h, x_in, x_prev)``: layer index and weights, the normed input, the residual entering the layer and the
one entering the layer before (the inputs of residual and look-ahead predictors).
"""
from __future__ import annotations

from kernels import ops
from kernels.common import Prologue
from kernels.reference import qk_norm_rope
from workers.decode import native_layer
from workers.decode.glue import EAGER, attn_prefill


def forward(w, x, fns: dict, impl):
    nk, eps, layers = w.norm_kind, w.eps, w.layers
    if (out := getattr(impl, "whole", _none)(x)) is not None:    # every layer in one native call (Step)
        return fns["norm"](out, w.final_norm, w.final_norm_b, nk, w.final_eps)
    fused = [impl.fuses(l, L, x) for l, L in enumerate(layers)]
    h = None if fused[0] else fns["norm"](x, layers[0].n1, layers[0].n1b, nk, eps)
    x_prev = x
    for l, L in enumerate(layers):
        x_in = x
        if fused[l]:
            x = impl.fused(l, L, x)
            if l + 1 == len(layers):
                h = fns["norm"](x, w.final_norm, w.final_norm_b, nk, w.final_eps)
            elif not fused[l + 1]:
                h = fns["norm"](x, layers[l + 1].n1, layers[l + 1].n1b, nk, eps)
            x_prev = x_in
            continue
        o = impl.attn(l, L, _rotate(h, L.rot_attn), x_in, x_prev)
        if L.post_attn is not None:
            o = fns["norm"](o, L.post_attn, None, nk, eps)
        x, h = _add_norm(fns, x, o, L.adapt_ffn, L.n2, L.n2b, nk, eps)
        y = impl.ffn(l, L, _rotate(h, L.rot_ffn), x_in, x_prev)
        if L.post_ffn is not None:
            y = fns["norm"](y, L.post_ffn, None, nk, eps)
        if l + 1 < len(layers):
            nxt = layers[l + 1]
            x, h = _add_norm(fns, x, y, nxt.adapt_attn, nxt.n1, nxt.n1b, nk, eps)
        else:
            x, h = fns["add_norm"](x, y, w.final_norm, w.final_norm_b, nk, w.final_eps)
        x_prev = x_in
    return h


def _add_norm(fns, x, y, adapt, n, nb, nk, eps):
    """(x + y, its norm), or with a change of basis of the stream between them (LaRoSA's adapters,
    workers.methods.larosa.runtime): x <- (x + y) @ adapt."""
    if adapt is None:
        return fns["add_norm"](x, y, n, nb, nk, eps)
    x = (x + y) @ adapt
    return x, fns["norm"](x, n, nb, nk, eps)


def _rotate(h, q):
    """An explicit rotation of a normed block input (LaRoSA's, workers.methods.larosa.runtime), or ``h`` itself."""
    return h if q is None else h @ q


def _none(x):
    return None


def split_qkv(qkv, dims):
    """Views q [..., H, hd], k and v [..., KV, hd] of a packed QKV product [..., (H + 2 KV) · hd]."""
    H, KV, hd = dims.n_heads, dims.n_kv_heads, dims.head_dim
    return (qkv[..., : H * hd].unflatten(-1, (H, hd)), qkv[..., H * hd: (H + KV) * hd].unflatten(-1, (KV, hd)),
            qkv[..., (H + KV) * hd:].unflatten(-1, (KV, hd)))


class Prompt:
    """The prefill's attention and FFN over every position of the prompts (h [B, T, d]), dense and eager."""

    def __init__(self, blocks, cache):
        self.b, self.cache = blocks, cache

    def fuses(self, l, L, x) -> bool:
        return False

    def attn(self, l, L, h, x_in, x_prev):
        """Causal (+ window) attention; writes the prompts' K/V at positions 0..T-1."""
        b, w, T = self.b, self.b.w, h.shape[1]
        q, k, v = (t.transpose(1, 2) for t in split_qkv(b.linear(h, L.w_qkv, L.b_qkv), w.dims))
        rows = (L.rope[0][:T], L.rope[1][:T]) if L.rope is not None else (None, None)
        q, k = qk_norm_rope(q, k, *rows, L.qn, L.kn, w.eps)
        self.cache.write_prompt(l, k, v)
        return b.linear_t(attn_prefill(q, k, v, L.window), L.w_o_t, L.b_o)

    def ffn(self, l, L, h, x_in, x_prev):
        B, T = h.shape[:2]
        return self.b.ffn_dense_(L, h.reshape(B * T, -1), EAGER["act_mul"]).reshape(B, T, -1)


class Step:
    """One decode token's attention and FFN: the paths of the plan (workers.decode.plan.RuntimePlan), active sets
    from ``sets`` (workers.decode.select.Lookahead), realized sparsity added to ``counters``."""

    def __init__(self, blocks, plan, cache, counters, sets, fns: dict):
        self.b, self.rp, self.cache, self.c, self.sets, self.fns = blocks, plan, cache, counters, sets, fns
        self.native = native_layer.for_step(blocks, plan, cache, fns, counters.inputs)   # quantized CPU layers
        self.attn_paths, self.ffn_paths = step_paths(plan, len(blocks.w.layers))

    def fuses(self, l, L, x) -> bool:
        """Whether layer ``l`` runs fused (:meth:`fused`): the plan has input sparsity on its QKV, O, gate|up and
        down and nothing else, a pre-norm gated Llama / Qwen layer (RMS norms, no sandwich norms), the Triton
        kernels (CUDA; the interpreter in tests), batch 1, and the blocks fuse and do not count inputs. Or the
        whole layer runs in one native call (workers.decode.native_layer: quantized weights on the CPU)."""
        if self.native is not None:
            return self.native.covers(l)
        b, rp, w = self.b, self.rp, self.b.w
        if not (b.fuse and not b.count_inputs and x.shape[0] == 1 and ops.backend_name(x) == "triton" and w.gated
                and w.norm_kind in ("rms", "rms1p") and L.post_attn is None and L.post_ffn is None):
            return False
        ia, ifn = rp.in_attn.get(l) or {}, rp.in_ffn.get(l) or {}
        return (l not in rp.heads and l not in rp.mlp and l not in rp.attn_fn and l not in rp.ffn_fn
                and {"qkv", "o"} <= ia.keys() and {"gu", "down"} <= ifn.keys())

    def whole(self, x):
        """The stream after every layer in one native call, where every layer runs natively (else None)."""
        return self.native.run_all(x) if self.native is not None and self.native.dense is None else None

    def fused(self, l, L, x):
        """The whole layer on the residual stream ``x`` -> the stream after it (four input-sparse launches and
        attention; or one native call)."""
        if self.native is not None:
            self.sets.layer_start(l, len(self.b.w.layers), x)
            return self.native.run(l, x)
        b, w, cache = self.b, self.b.w, self.cache
        ia, ifn = self.rp.in_attn[l], self.rp.in_ffn[l]
        self.sets.layer_start(l, len(w.layers), x)
        qkv = b.in_linear(x, L.w_qkv_t, ia["qkv"], None, L.b_qkv, prologue=Prologue(w.norm_kind, L.n1, w.eps))
        q, k, v = split_qkv(qkv, w.dims)
        a = self.fns["attn"](q, k, v, cache.k[l], cache.v[l], cache.pos, *(L.rope or (None, None)), L.qn, L.kn,
                             w.eps, L.window)
        x = b.in_linear(a, L.w_o_t, ia["o"], None, L.b_o, residual=x)
        gu = b.in_linear(x, L.w_gu_t, ifn["gu"], None, prologue=Prologue(w.norm_kind, L.n2, w.eps))
        return b.in_linear(gu, L.w_down_t, ifn["down"], None, L.b_down, prologue=Prologue("act_mul", act=w.act),
                           residual=x)

    def attn(self, l, L, h, x_in, x_prev):
        """Layer ``l``'s attention by its path in the plan's table (:func:`step_paths`)."""
        self.sets.layer_start(l, len(self.b.w.layers), x_in)   # look-ahead for l+1 (from x entering l), residual for l
        return self.attn_paths[l](self, l, L, h, x_in, x_prev)

    def ffn(self, l, L, h, x_in, x_prev):
        """Layer ``l``'s FFN by its path in the plan's table (:func:`step_paths`)."""
        return self.ffn_paths[l](self, l, L, h, x_in, x_prev)

    # ---- attention paths
    def part_attn(self, l, L, h, x_in, x_prev):
        """A plan part's own attention (workers.methods.<method>.runtime)."""
        return self.rp.attn_fn[l](self, l, L, h)

    def dense_attn(self, l, L, h, x_in, x_prev):
        """Every head; input sparsity on QKV and on O where the plan has it."""
        b, ia = self.b, self.rp.in_attn.get(l) or {}
        if "qkv" in ia:
            qkv = b.in_linear(h, L.w_qkv_t, ia["qkv"], ia["qkv"].counts(self.c.inputs[l]), L.b_qkv)
        else:
            qkv = b.linear(h, L.w_qkv, L.b_qkv)
        a = self.attend(l, L, qkv)
        if "o" in ia:
            return b.in_linear(a, L.w_o_in, ia["o"], ia["o"].counts(self.c.inputs[l]), L.b_o)
        return b.out_dense(L, a)

    def head_attn(self, l, L, h, x_in, x_prev):
        """The heads the layer's predictor keeps (from the residual entering this layer or the one before)."""
        hp = self.rp.heads[l]
        q_idx, q_count = self.sets.get("attn", l, x_in if hp.input_kind == "residual" or l == 0 else x_prev)
        o = self.b.sparse_attn(L, l, h, q_idx, q_count, self.cache, self.fns["attn"])
        if q_count is not None:
            self.c.heads[l] += q_count[0]
        return o

    def attend(self, l, L, qkv):
        """RoPE, the cache write and the attention of the packed QKV product (every head)."""
        w, cache = self.b.w, self.cache
        q, k, v = split_qkv(qkv, w.dims)
        return self.fns["attn"](q, k, v, cache.k[l], cache.v[l], cache.pos, *(L.rope or (None, None)), L.qn, L.kn,
                                w.eps, L.window)

    # ---- FFN paths
    def part_ffn(self, l, L, h, x_in, x_prev):
        """A plan part's own FFN (workers.methods.<method>.runtime)."""
        return self.rp.ffn_fn[l](self, l, L, h)

    def dense_ffn(self, l, L, h, x_in, x_prev):
        return self.b.ffn_dense_(L, h, self.fns["act_mul"])

    def input_sparse_ffn(self, l, L, h, x_in, x_prev):
        """Input sparsity on the FFN's projections."""
        return self.b.ffn_input_sparse(L, h, self.rp.in_ffn[l], self.c.inputs[l], self.fns["act_mul"])

    def threshold_ffn(self, l, L, h, x_in, x_prev):
        """The gate threshold: the first projection dense, up / down on the kept neurons."""
        return self.b.ffn_threshold(L, h, self.rp.thr_ffn[l], self.c.mlp[l])

    def predicted_ffn(self, l, L, h, x_in, x_prev):
        """The neurons the layer's predictor keeps (from the FFN's input, or the residual entering this layer or
        the one before)."""
        rp, c, kind = self.rp, self.c, self.rp.mlp[l].input_kind
        idx, count = self.sets.get("mlp", l, h if kind == "ffn_in" else
                                   (x_in if kind == "residual" or l == 0 else x_prev))
        if count is not None:
            c.mlp[l] += count[0]
        return self.b.sparse_ffn(L, h, idx, count, rp.seq_thr.get(l), rp.seq_w.get(l))


def step_paths(rp, n_layers: int) -> tuple[list, list]:
    """The plan's table: per layer, the attention and the FFN path a step runs (:class:`Step` methods), chosen
    once per plan (``rp.paths`` keeps it; ``RuntimePlan.drop_ffn`` clears it)."""
    if n_layers not in rp.paths:
        attn = [Step.part_attn if l in rp.attn_fn else Step.head_attn if l in rp.heads else Step.dense_attn
                for l in range(n_layers)]
        ffn = [Step.part_ffn if l in rp.ffn_fn else
               (Step.threshold_ffn if l in rp.thr_ffn else Step.predicted_ffn) if l in rp.mlp else
               Step.input_sparse_ffn if l in rp.in_ffn else Step.dense_ffn for l in range(n_layers)]
        rp.paths[n_layers] = attn, ffn
    return rp.paths[n_layers]
