"""A compact decode runtime (gpt-fast style) that runs dense or with a :class:`SparsityPlan` applied.

    rt = DecodeRuntime.from_hf(model)                      # copies the weights (via workers.loading.adapters)
    rt = DecodeRuntime.from_config(config, dtype, device)  # random weights of the real shapes
    rt.set_plan(plan, overlap=True)                        # None: dense
    rt.setup(batch=1, max_len=160)                         # static KV cache
    logits = rt.prefill(prompt_ids)                        # dense, eager; writes the cache
    tokens = rt.decode(n)                                  # greedy; one-token step, CUDA graph on CUDA

Families: llama, mistral, qwen2, gemma3 (q/k norms, sandwich norms, scaled embedding, sliding layers), opt
(LayerNorm, biases, learned positions, ReLU fc1/fc2). Weights live in the kernels' layout: packed
``w_qkv`` [(H+2KV)·hd, d] (query rows pre-scaled by the attention scale), ``w_o_t`` = W_oᵀ, ``w_gate``/``w_up``
[D, d], ``w_down_t`` = W_downᵀ: one copy serves the dense and the sparse path.

Decode step (one token per sequence): embedding -> per layer [norm, QKV, RoPE + cache write + attention over
the static cache (masked to the filled positions and the sliding window), O, add+norm, FFN, add+norm] -> argmax.
The step reads a device position counter and writes the next token into its own input buffer, so repeated
replays need no host sync. On CUDA the pure-torch glue (norms, RoPE/attention, the gated activation) is
compiled with ``torch.compile`` (fused elementwise work; falls back to eager if compiling fails) and the whole
step is captured in one CUDA graph. On the CPU everything runs eagerly; the sparse FFN goes through kernels.cpu
(reads only the active rows of gate/up and of W_downᵀ, in place, in one pass); the dense parts are torch
matmuls (MKL) or the same row kernels over every row (``cpu_rows``; ``pick_cpu_dense`` times both and keeps the faster, as latency rows do; benchmarks/cpu_ops.py --decode
measures both: which is faster depends on the CPU).

Sparse layers (``plan.mlp`` / ``plan.attn``): the predictor's own ``scores`` (its GEMVs), then the active set on
the device -- batch 1 top-k: a fixed-size index buffer of the k largest scores (static k; on CUDA the one-CTA
radix select of ``kernels.select_triton``, indices ascending, ties to the lowest index; ``torch.topk`` elsewhere);
``positive`` rule or batch > 1: a compaction into (idx, count) (``kernels.ops.compact`` / ``union_active``) -- then ``kernels.ops.sparse_ffn`` / ``sparse_mlp``
and, for heads, ``head_sparse_qkv`` + ``head_sparse_out``. K and V are computed for every head
(``kv_mode="exact"``: the cache stays exact, the semantics of workers.sparsity.sparse_exec); ``kv_mode="active"`` computes
K/V only for the KV heads the active query heads need and masks the skipped (head, position) entries out of
later attention (Deja Vu's saving without its "recompute later": an approximation, reported separately).

Input sparsity (``plan.inputs``, TEAL / WINA): each projection with a threshold reads only the rows of its Wᵀ
[in, out] whose input entry is active (``kernels.ops.input_sparse_linear_segments``); QKV share one input and one
Wᵀ copy with three thresholds, gate|up likewise with two; O and down use ``w_o_t`` / ``w_down_t`` as stored. Wᵀ
copies exist only for the projections a plan needs. WINA's |x_i|·‖W[:, i]‖ > t runs as |x_i| > t/‖W[:, i]‖ (one
threshold per input channel, CPU only), so the product is the plain one. The active entries are counted per
(layer, projection): ``realized_sparsity()`` then adds ``inputs`` (fraction of the decoder's projection weights
not read because of input sparsity) and ``weights`` (counting every part of the plan). Input sparsity on
attention combines with a neuron predictor on the FFN.

Gate-threshold predictors (method ``threshold``: |act(W_gate h)| > t on the FFN's own gate) run the gate dense
once and then only the up / W_downᵀ rows of the kept neurons (``kernels.cpu.threshold_ffn``; elsewhere the same
through compact + gather ops), each token with its own kept set.

Predictor inputs follow each predictor's ``input_kind``: ``residual`` (the stream entering the layer),
``lookahead`` (the stream entering the previous layer), ``ffn_in`` (the normed FFN input). With
``overlap=True`` on CUDA, every predictor whose input is known before it is needed runs on a side stream:
look-ahead predictors of layer l+1 start when layer l starts, residual MLP predictors overlap their layer's
attention. ``overlap=False`` runs them in line, which is what look-ahead is measured against.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu as cpu_kernels
from kernels import ops
from kernels.common import ACTS, MAX_BATCH, apply_act
from workers.loading.adapters import activation_fn, adapter_for, get_path, linear_weight

FAMILIES = ("llama", "mistral", "qwen2", "gemma3", "opt")


# ---------------------------------------------------------------------------------------------------------
# pure-torch glue (compiled on CUDA)
def _norm(x, w, b, kind: str, eps: float):
    if kind == "ln":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "rms1p":                       # Gemma: (y * (1 + w)).to(dtype); w holds 1 + w, fp32
        return (y * w).to(x.dtype)
    return w * y.to(x.dtype)                  # Llama: w * y.to(dtype)


def _add_norm(x, y, w, b, kind: str, eps: float):
    x = x + y
    return x, _norm(x, w, b, kind, eps)


def _rot_half(t):
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


def _act_mul(gu, act: str):
    D = gu.shape[-1] // 2
    g, u = gu[..., :D], gu[..., D:]
    return apply_act(g, act) * u


def _attn_decode(q, k, v, k_cache, v_cache, cos_t, sin_t, pos, qn, kn, eps: float, window: int | None,
                 valid=None):
    """One decode position. q [B, H, hd], k/v [B, KV, hd]; caches [B, KV(+1), L, hd]; pos [1] int64.
    ``valid`` [B, KV, L] bool (kv_mode "active"): extra per-(head, position) mask. Returns [B, H*hd]."""
    B, H, hd = q.shape
    KV = k.shape[1]
    if qn is not None:
        q = _norm(q, qn, None, "rms1p", eps)
        k = _norm(k, kn, None, "rms1p", eps)
    if cos_t is not None:
        cos = cos_t.index_select(0, pos).to(q.dtype)   # [1, hd]
        sin = sin_t.index_select(0, pos).to(q.dtype)
        q = q * cos + _rot_half(q) * sin
        k = k * cos + _rot_half(k) * sin
    kc, vc = k_cache[:, :KV], v_cache[:, :KV]
    kc.index_copy_(2, pos, k.unsqueeze(2))
    vc.index_copy_(2, pos, v.unsqueeze(2))
    L = kc.shape[2]
    s = torch.matmul(q.reshape(B, KV, H // KV, hd), kc.transpose(-1, -2)).float()   # [B, KV, G, L]
    j = torch.arange(L, device=q.device)
    m = j <= pos
    if window is not None:
        m = m & (j > pos - window)
    m = m.view(1, 1, 1, L)
    if valid is not None:
        m = m & valid[:, :, None, :]
    p = torch.softmax(s.masked_fill(~m, float("-inf")), dim=-1).to(q.dtype)
    return torch.matmul(p, vc).reshape(B, H * hd)


def _attn_prefill(q, k, v, window: int | None):
    """q [B, H, T, hd] (pre-scaled), k/v [B, KV, T, hd]: causal (+ window) attention -> [B, T, H*hd]."""
    B, H, T, hd = q.shape
    G = H // k.shape[1]
    if G > 1:
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    i = torch.arange(T, device=q.device)
    m = i[None, :] <= i[:, None]
    if window is not None:
        m = m & (i[None, :] > i[:, None] - window)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=1.0)
    return o.transpose(1, 2).reshape(B, T, H * hd)


# ---------------------------------------------------------------------------------------------------------
class _Layer:
    """One decoder layer's weights in the runtime's layout (plain tensors, no nn.Module)."""

    __slots__ = ("w_qkv", "b_qkv", "w_o_t", "b_o", "n1", "n1b", "n2", "n2b", "post_attn", "post_ffn",
                 "qn", "kn", "w_gate", "w_up", "w_down_t", "b_up", "b_down", "w_gu", "window", "rope",
                 "w_qkv_t", "w_gu_t", "w_up_t")

# other layouts of weights the step already reads (not counted by weight_bytes); the *_t ones exist only while a
# plan's input sparsity needs them (Wᵀ [in, out]: an input channel's weights are one contiguous row)
_ALT_LAYOUTS = ("w_gu", "w_qkv_t", "w_gu_t", "w_up_t")
PROJ = ("q", "k", "v", "o", "gate", "up", "down")   # columns of the input-sparsity counters


class DecodeRuntime:
    def __init__(self):
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.plan = None
        self.overlap = True
        self.kv_mode = "exact"
        self.ffn_dense = "auto"
        self.cpu_rows = None          # CPU backend: dense projections (QKV, O, LM head, dense FFN) through kernels.cpu's
        #                               row kernels (True) or torch matmuls (False); which is faster depends on the
        #                               CPU: None = not chosen yet (matmuls until pick_cpu_dense() times both)
        self.select_impl = "auto"     # top-k: "auto" (Triton select where the Triton kernels run), "torch", "triton"
        self.batch = 0
        self.max_len = 0
        self._graph = None
        self.use_graph = True
        self.compile = True
        self.mlp_pred, self.head_pred, self.seq_thr = {}, {}, {}
        self.in_attn, self.in_ffn, self.thr_ffn = {}, {}, {}
        self._fns = None

    # ------------------------------------------------------------------ building
    @classmethod
    def from_config(cls, config, dtype=torch.float16, device="cuda", seed: int = 0) -> "DecodeRuntime":
        """Random weights of the real shapes (an HF model is built on ``device`` and copied)."""
        model = random_hf_model(config, dtype, device, seed)
        rt = cls.from_hf(model)
        del model
        return rt

    @classmethod
    @torch.no_grad()
    def from_hf(cls, model: nn.Module, dtype: torch.dtype | None = None, device=None) -> "DecodeRuntime":
        ad = adapter_for(model)
        if ad.family not in FAMILIES:
            raise ValueError(f"decode runtime supports {FAMILIES}, not {ad.family!r}")
        cfg = model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        rt = cls()
        p0 = next(model.parameters())
        rt.device = torch.device(device) if device is not None else p0.device
        rt.dtype = dtype or p0.dtype
        rt.family = ad.family
        rt.adapter = ad
        rt.dims = dims = ad.dims(cfg)
        rt.act = ad.act_name(cfg)
        rt.gated = ad.ffn.gated
        rt.vocab = cfg.vocab_size
        H, KV, hd, d = dims.n_heads, dims.n_kv_heads, dims.head_dim, dims.d
        fam = ad.family
        rt.norm_kind = "ln" if fam == "opt" else ("rms1p" if fam == "gemma3" else "rms")
        if fam == "opt" and not getattr(cfg, "do_layer_norm_before", True):
            raise ValueError("OPT with post-layer-norm (opt-350m) is not supported")

        def T(t):
            return None if t is None else t.detach().to(device=rt.device, dtype=rt.dtype).contiguous()

        def norm_w(m):
            if rt.norm_kind == "rms1p":
                return (1.0 + m.weight.detach().float()).to(rt.device).contiguous()
            return T(m.weight)

        def eps_of(m):
            e = getattr(m, "variance_epsilon", None)
            return float(e if e is not None else m.eps)

        rt.scale = getattr(cfg, "query_pre_attn_scalar", None)
        scale = (rt.scale if rt.scale is not None else hd) ** -0.5
        rt.q_fold = 1.0 if fam == "gemma3" else scale      # factor folded into the stored query rows
        rope = _rope_tables(model, cfg, fam)
        layer_types = getattr(cfg, "layer_types", None)
        rt.layers = []
        for i, layer in ad.iter_layers(model):
            L = _Layer()
            attn = ad.attn_module(layer)
            q, k, v, o = (get_path(attn, p) for p in (ad.attn.q, ad.attn.k, ad.attn.v, ad.attn.o))
            qn = get_path(attn, "q_norm") if fam == "gemma3" else None
            wq = q.weight.detach().float()
            bq = q.bias.detach().float() if q.bias is not None else None
            if qn is None:        # fold the attention scale into the query rows (RoPE and scores are linear)
                wq = wq * scale
                bq = bq * scale if bq is not None else None
            L.w_qkv = T(torch.cat([wq, k.weight.detach().float(), v.weight.detach().float()], 0))
            L.b_qkv = T(torch.cat([bq, k.bias.detach().float(), v.bias.detach().float()], 0)) if bq is not None else None
            L.w_o_t = T(linear_weight(o).t())
            L.b_o = T(o.bias) if getattr(o, "bias", None) is not None else None
            if qn is not None:    # Gemma: the scale goes into the q-norm weight instead
                L.qn = ((1.0 + qn.weight.detach().float()) * scale).to(rt.device).contiguous()
                L.kn = (1.0 + get_path(attn, "k_norm").weight.detach().float()).to(rt.device).contiguous()
            else:
                L.qn = L.kn = None
            n1 = get_path(layer, ad.attn.norm)
            n2 = get_path(layer, ad.ffn.norm)
            rt.eps = eps_of(n1)
            L.n1, L.n1b = norm_w(n1), T(getattr(n1, "bias", None))
            L.n2, L.n2b = norm_w(n2), T(getattr(n2, "bias", None))
            if fam == "gemma3":
                L.post_attn = norm_w(get_path(layer, "post_attention_layernorm"))
                L.post_ffn = norm_w(get_path(layer, "post_feedforward_layernorm"))
            else:
                L.post_attn = L.post_ffn = None
            w = ad.ffn_weights(layer)
            L.w_up, L.w_gate = T(w["up"]), T(w.get("gate"))
            L.w_down_t = T(w["down"].t())
            L.b_up, L.b_down = T(w.get("b_up")), T(w.get("b_down"))
            L.w_gu = L.w_qkv_t = L.w_gu_t = L.w_up_t = None
            lt = layer_types[i] if layer_types else "full_attention"
            sw = getattr(cfg, "sliding_window", None)
            if fam == "mistral":
                L.window = sw
            else:
                L.window = sw if lt == "sliding_attention" else None
            L.rope = rope.get(lt, rope.get("full_attention")) if rope else None
            rt.layers.append(L)
        emb = model.get_input_embeddings()
        rt.embed = T(emb.weight)
        rt.embed_scale = float(getattr(emb, "scalar_embed_scale", 1.0)) if fam == "gemma3" else None
        if fam == "gemma3":
            rt.embed_scale_t = torch.tensor(rt.embed_scale, dtype=rt.dtype, device=rt.device)
        rt.pos_embed, rt.proj_in, rt.proj_out = None, None, None
        if fam == "opt":
            dec = model.model.decoder
            rt.pos_embed = T(dec.embed_positions.weight)
            rt.pos_offset = getattr(dec.embed_positions, "offset", 2)
            rt.proj_in = T(dec.project_in.weight) if dec.project_in is not None else None
            rt.proj_out = T(dec.project_out.weight) if dec.project_out is not None else None
        fn = get_path(model, ad.final_norm)
        rt.final_norm, rt.final_norm_b = norm_w(fn), T(getattr(fn, "bias", None))
        rt.final_eps = eps_of(fn)
        rt.lm_head = T(model.get_output_embeddings().weight)
        rt.softcap = getattr(cfg, "final_logit_softcapping", None)
        for L in rt.layers:
            if L.rope is not None:
                L.rope = tuple(t.to(rt.device, torch.float32).contiguous() for t in L.rope)
        rt.kv_all = torch.arange(KV, device=rt.device, dtype=torch.int32)
        rt.full_idx = torch.arange(dims.D, device=rt.device, dtype=torch.int32)
        return rt

    # ------------------------------------------------------------------ configuration
    def set_plan(self, plan=None, *, overlap: bool = True, kv_mode: str = "exact") -> "DecodeRuntime":
        """Use ``plan`` (None: dense). Predictors are copied to the runtime's device and dtype."""
        if kv_mode not in ("exact", "active"):
            raise ValueError("kv_mode must be 'exact' or 'active'")
        if kv_mode != self.kv_mode:
            self.batch = self.max_len = 0          # the cache layout changes: setup() again
        self.plan, self.overlap, self.kv_mode = plan, overlap, kv_mode
        self.mlp_pred, self.head_pred, self.seq_thr = {}, {}, {}
        self.in_attn, self.in_ffn, self.thr_ffn = {}, {}, {}
        if plan is not None:
            for l, p in plan.mlp.items():
                self.mlp_pred[l] = _on(p, self.device, self.dtype)
                if plan.mlp_mode == "sequential":
                    self.seq_thr[l] = plan.seq_filter.get(l)
            for l, p in plan.attn.items():
                if p.input_kind not in ("residual", "lookahead"):
                    raise ValueError(f"layer {l}: head predictor input {p.input_kind!r} is not known before "
                                     "the attention runs (the oracle's head_out is for evaluation only)")
                self.head_pred[l] = _on(p, self.device, self.dtype)
            if self.gated is False and self.act not in ACTS:
                raise ValueError(f"activation {self.act!r} has no sparse kernel")
            for l, p in plan.mlp.items():
                fast = self._threshold_fast(l, p, plan)
                if fast is not None:
                    self.thr_ffn[l] = fast
            self._set_inputs(plan)
        self._drop_unused_layouts()
        self._graph = None
        return self

    def _threshold_fast(self, l: int, p, plan):
        """(threshold, score bias) when layer ``l``'s predictor is a gate threshold (|act(W1 h)| > t, W1 the FFN's
        own first projection, e.g. method ``threshold``): the FFN then runs the first projection dense once and
        reads up/down rows of the kept neurons only. None: the predictor runs as any other."""
        if getattr(p, "method", None) != "threshold" or getattr(p, "input_kind", None) != "ffn_in":
            return None
        if plan.mlp_mode == "sequential" or getattr(p, "act", None) != self.act or self.act not in ACTS:
            return None
        L = self.layers[l]
        w1 = L.w_gate if self.gated else L.w_up
        w = getattr(p, "_w", None)
        if w is None or tuple(w.shape) != tuple(w1.shape) or not torch.equal(w.to(w1.device, w1.dtype), w1):
            return None
        b = getattr(p, "_b", None)
        if b is not None:
            if self.gated:
                return None
            b = b.to(device=self.device, dtype=self.dtype).contiguous()
        return float(p.threshold), b

    def _set_inputs(self, plan) -> None:
        """Input sparsity (``plan.inputs``, TEAL / WINA): per layer, the thresholds of each fused group (QKV share
        h, gate|up share the FFN input) in the layout the kernels take, and the Wᵀ copies they read."""
        from workers.sparsity.input_sparse import check_plan_parts

        if not plan.inputs:
            return
        check_plan_parts(plan)
        wina = plan.input_score == "wina"
        if wina and self.device.type != "cpu":
            raise ValueError("WINA input sparsity needs a threshold per input channel: the decode runtime runs it "
                             "on the CPU only (the Triton input-sparse kernel takes one threshold per segment)")
        known = {"q", "k", "v", "o", "up", "down"} | ({"gate"} if self.gated else set())
        dims = self.dims
        H, KV, hd, d, D = dims.n_heads, dims.n_kv_heads, dims.head_dim, dims.d, dims.D
        for l, per in plan.inputs.items():
            l = int(l)
            if not 0 <= l < len(self.layers):
                raise ValueError(f"input thresholds for layer {l}, model has {len(self.layers)}")
            bad = set(per) - known
            if bad:
                raise ValueError(f"layer {l}: input sparsity on {sorted(bad)}: not projections of this model "
                                 f"({sorted(known)})")
            if not per:
                continue
            if l in self.head_pred and set(per) & {"q", "k", "v", "o"}:
                raise ValueError(f"layer {l}: input sparsity on attention projections and a head predictor on "
                                 "the same layer")
            L = self.layers[l]
            norms = _column_norms(L, self.q_fold, H * hd, KV * hd) if wina else None

            def thr(names, n_in):
                """Thresholds of the projections ``names`` sharing one input: [len] (one each) or, WINA,
                [len, n_in] (t / ‖W[:, i]‖); a projection without one keeps every input (-1)."""
                if not wina:
                    return torch.tensor([float(per.get(p, -1.0)) for p in names], dtype=torch.float32,
                                        device=self.device)
                rows = [float(per[p]) / norms[p].clamp_min(1e-30) if p in per
                        else torch.full((n_in,), -1.0, device=self.device) for p in names]
                return torch.stack(rows).to(torch.float32).contiguous()

            ent = {}
            if set(per) & {"q", "k", "v"}:
                if L.w_qkv_t is None:
                    L.w_qkv_t = L.w_qkv.t().contiguous()
                ent["qkv"] = (thr(("q", "k", "v"), d), (H * hd, KV * hd, KV * hd), 0)
            if "o" in per:
                ent["o"] = (thr(("o",), H * hd), (d,), 3)
            if ent:
                self.in_attn[l] = ent
            ent = {}
            if self.gated and set(per) & {"gate", "up"}:
                if L.w_gu_t is None:
                    L.w_gu_t = torch.cat([L.w_gate, L.w_up], 0).t().contiguous()
                ent["gu"] = (thr(("gate", "up"), d), (D, D), 4)
            elif not self.gated and "up" in per:
                if L.w_up_t is None:
                    L.w_up_t = L.w_up.t().contiguous()
                ent["up"] = (thr(("up",), d), (D,), 5)
            if "down" in per:
                ent["down"] = (thr(("down",), D), (d,), 6)
            if ent:
                self.in_ffn[l] = ent

    def _drop_unused_layouts(self) -> None:
        for l, L in enumerate(self.layers):
            if "qkv" not in self.in_attn.get(l, {}):
                L.w_qkv_t = None
            if "gu" not in self.in_ffn.get(l, {}):
                L.w_gu_t = None
            if "up" not in self.in_ffn.get(l, {}):
                L.w_up_t = None

    @property
    def sparse(self) -> bool:
        return bool(self.mlp_pred or self.head_pred)

    @property
    def input_sparse(self) -> bool:
        return bool(self.in_attn or self.in_ffn)

    def setup(self, batch: int, max_len: int) -> None:
        """Allocate the static KV cache (and drop any captured graph)."""
        dims = self.dims
        shape = (batch, dims.n_kv_heads, max_len, dims.head_dim)
        self.k_cache = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.valid = ([torch.zeros(batch, dims.n_kv_heads + 1, max_len, dtype=torch.bool, device=self.device)
                       for _ in self.layers] if self.kv_mode == "active" else None)
        self.batch, self.max_len = batch, max_len
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.tok = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.out_tokens = torch.zeros(batch, max_len, dtype=torch.long, device=self.device)
        self.stat_mlp = torch.zeros(len(self.layers), dtype=torch.float64, device=self.device)
        self.stat_heads = torch.zeros(len(self.layers), dtype=torch.float64, device=self.device)
        self.stat_in = torch.zeros(len(self.layers), len(PROJ), dtype=torch.float64, device=self.device)
        self.steps = 0
        self._graph = None
        self._fns = None

    # ------------------------------------------------------------------ pieces
    def _glue(self):
        if self._fns is None:
            fns = dict(norm=_norm, add_norm=_add_norm, act_mul=_act_mul, attn=_attn_decode)
            if self.device.type == "cuda" and self.compile:
                try:
                    import torch._dynamo
                    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
                    fns = {k: torch.compile(v, dynamic=False, fullgraph=True) for k, v in fns.items()}
                except Exception:  # pragma: no cover - compile unavailable: eager glue
                    pass
            self._fns = fns
        return self._fns

    def _embed(self, ids, pos_ids):
        x = F.embedding(ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale_t
        if self.proj_in is not None:
            x = x @ self.proj_in.t()
        if self.pos_embed is not None:
            x = x + F.embedding(pos_ids + self.pos_offset, self.pos_embed)
        return x

    def _linear(self, h, w, b=None):
        """h @ wᵀ (+ b): on the CPU backend the row kernel of kernels.cpu (faster than MKL's GEMV there)."""
        if self._cpu_rows(h):
            return cpu_kernels.linear(h, w, b)
        z = h @ w.t()
        return z + b if b is not None else z

    def _linear_t(self, a, w_t, b=None):
        """a @ w_t (+ b), w_t = Wᵀ [in, out]."""
        if self._cpu_rows(a):
            return cpu_kernels.linear_t(a, w_t, b)
        z = a @ w_t
        return z + b if b is not None else z

    def _cpu_rows(self, h) -> bool:
        return self.cpu_rows and h.dim() == 2 and h.shape[0] <= MAX_BATCH and ops.backend_name(h) == "cpu"

    def _logits(self, h):
        if self.proj_out is not None:
            h = h @ self.proj_out.t()
        z = self._linear(h, self.lm_head)
        if self.softcap is not None:
            z = torch.tanh(z.float() / self.softcap) * self.softcap
        return z

    def _ffn_dense(self, L, h, fns):
        if self.ffn_dense == "auto" and self.act in ACTS and self._cpu_rows(h):
            if self.gated:       # the whole FFN in one pass of the row kernel (kernels.cpu.dense_ffn)
                return ops.dense_ffn(h, L.w_gate, L.w_up, L.w_down_t, self.act)
            return ops.dense_mlp(h, L.w_up, L.b_up, L.w_down_t, L.b_down, self.act)
        if self.device.type == "cuda" and self.ffn_dense == "auto" and h.shape[0] <= 8 and self.act in ACTS:
            if self.gated:
                return ops.sparse_ffn(h, L.w_gate, L.w_up, L.w_down_t, self.full_idx, None, self.act)
            return ops.sparse_mlp(h, L.w_up, L.b_up, L.w_down_t, L.b_down, self.full_idx, None, self.act)
        if self.gated:
            if L.w_gu is None:
                L.w_gu = torch.cat([L.w_gate, L.w_up], 0)
            a = fns["act_mul"](h @ L.w_gu.t(), self.act)
        else:
            z = h @ L.w_up.t()
            if L.b_up is not None:
                z = z + L.b_up
            a = activation_fn(self.act)(z)
        y = a @ L.w_down_t
        return y + L.b_down if L.b_down is not None else y

    def _in_linear(self, l: int, x, w_t, ent, bias=None):
        """x @ w_t (+ bias) over the active inputs only (input sparsity); ``ent`` = (thresholds, segment sizes,
        first column of the layer's counters). The counters get the active (token, input) entries."""
        thr, sizes, col = ent
        counts = self.stat_in[l, col: col + len(sizes)]
        if ops.backend_name(x) == "cpu":
            return cpu_kernels.input_sparse_linear_segments(x, w_t, thr, sizes, bias, counts=counts)
        y = ops.input_sparse_linear_segments(x, w_t, thr, sizes, bias)
        a = x.abs().float()
        on = a[:, None, :] > (thr[None, :, :] if thr.dim() == 2 else thr[None, :, None])
        counts.add_(on.sum((0, 2)).to(counts.dtype))
        return y

    def _ffn_input_sparse(self, l: int, L, h, ent, fns):
        """The FFN with input sparsity on gate|up (one pass over the shared input), fc1, and/or down."""
        if self.gated:
            if "gu" in ent:
                gu = self._in_linear(l, h, L.w_gu_t, ent["gu"])
            else:
                if L.w_gu is None:
                    L.w_gu = torch.cat([L.w_gate, L.w_up], 0)
                gu = self._linear(h, L.w_gu)
            a = fns["act_mul"](gu, self.act)
        else:
            z = self._in_linear(l, h, L.w_up_t, ent["up"], L.b_up) if "up" in ent else self._linear(h, L.w_up, L.b_up)
            a = activation_fn(self.act)(z)
        if "down" in ent:
            return self._in_linear(l, a, L.w_down_t, ent["down"], L.b_down)
        return self._linear_t(a, L.w_down_t, L.b_down)

    def _ffn_threshold(self, l: int, L, h):
        """Gate-threshold FFN: the first projection dense once (the fastest dense product), keep the neurons with
        |act(gate)| > t, then up rows and W_downᵀ rows of the kept neurons only (1/3 + 2/3·(1 - s) of a gated
        FFN). Each token uses its own kept set; the batch reads the union's rows once."""
        t, b_score = self.thr_ffn[l]
        w1 = L.w_gate if self.gated else L.w_up
        b_act = None if self.gated else L.b_up
        z = self._linear(h, w1)
        w_up = L.w_up if self.gated else None
        if ops.backend_name(h) == "cpu":
            r = cpu_kernels.threshold_ffn(h, z, w_up, L.w_down_t, t, self.act, b_act=b_act, b_score=b_score,
                                          b_down=L.b_down, stat=self.stat_mlp[l])
            if r is not None:
                return r[0]
        a = apply_act(z if b_act is None else z + b_act, self.act)
        s = a if b_score is b_act else apply_act(z if b_score is None else z + b_score, self.act)
        keep = s.abs() > t
        coef = torch.where(keep, a, torch.zeros((), dtype=a.dtype, device=a.device))
        idx, count, cv = ops.compact(keep[0] if keep.shape[0] == 1 else keep.any(0), None, coef)
        self.stat_mlp[l] += count[0]
        if self.gated:
            u = ops.gather_gemv(h, L.w_up, idx, count, scale=cv, out_dtype=torch.float32)
        else:
            u = cv
        return ops.gather_down(u.to(h.dtype), L.w_down_t, idx, count, L.b_down, out_dtype=h.dtype)

    # ------------------------------------------------------------------ prefill (dense, eager)
    @torch.no_grad()
    @torch.no_grad()
    def pick_cpu_dense(self, steps: int = 4, rounds: int = 3) -> bool:
        """On the CPU: time dense decode steps through torch matmuls and through the row kernels, alternately,
        and keep the faster for every dense product (``cpu_rows``). Which one wins depends on the CPU (caches,
        MKL's GEMV); the dense baseline of a latency row must be the fastest dense we can run. Returns
        ``cpu_rows``. The plan and the KV cache are restored (setup() again before decoding)."""
        if self.device.type != "cpu":
            return self.cpu_rows
        import time

        plan, overlap, kv_mode = self.plan, self.overlap, self.kv_mode
        self.set_plan(None)
        self.setup(1, steps + 2)
        ids = torch.zeros(1, 1, dtype=torch.long)
        best = {False: [], True: []}
        for r in range(rounds + 1):
            for rows in ((False, True) if r % 2 == 0 else (True, False)):
                self.cpu_rows = rows
                self.prefill(ids)
                t0 = time.perf_counter()
                for _ in range(steps):
                    self.step()
                if r:                      # round 0 warms both paths up
                    best[rows].append(time.perf_counter() - t0)
        self.cpu_rows = min(best[True]) < min(best[False])
        self.set_plan(plan, overlap=overlap, kv_mode=kv_mode)
        self.batch = self.max_len = 0
        return self.cpu_rows

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Dense forward of the prompts ``ids`` [B, T] (B == setup's batch); fills the cache; returns the last
        position's logits [B, V] and sets the step's input token (greedy) and position."""
        B, Tn = ids.shape
        assert B == self.batch and Tn < self.max_len, "setup(batch, max_len) first; prompt must fit"
        dims = self.dims
        H, KV, hd = dims.n_heads, dims.n_kv_heads, dims.head_dim
        ids = ids.to(self.device)
        pos_ids = torch.arange(Tn, device=self.device)
        x = self._embed(ids, pos_ids[None, :])
        nk, eps = self.norm_kind, self.eps
        for l, L in enumerate(self.layers):
            h = _norm(x, L.n1, L.n1b, nk, eps)
            qkv = h @ L.w_qkv.t()
            if L.b_qkv is not None:
                qkv = qkv + L.b_qkv
            q = qkv[..., : H * hd].view(B, Tn, H, hd).transpose(1, 2)
            k = qkv[..., H * hd: (H + KV) * hd].view(B, Tn, KV, hd).transpose(1, 2)
            v = qkv[..., (H + KV) * hd:].view(B, Tn, KV, hd).transpose(1, 2)
            if L.qn is not None:
                q, k = _norm(q, L.qn, None, "rms1p", eps), _norm(k, L.kn, None, "rms1p", eps)
            if L.rope is not None:
                cos, sin = (t[:Tn].to(q.dtype) for t in L.rope)
                q = q * cos + _rot_half(q) * sin
                k = k * cos + _rot_half(k) * sin
            self.k_cache[l][:, :KV, :Tn] = k
            self.v_cache[l][:, :KV, :Tn] = v
            if self.valid is not None:
                self.valid[l].zero_()
                self.valid[l][:, :, :Tn] = True
            a = _attn_prefill(q, k, v, L.window)
            o = a @ L.w_o_t
            if L.b_o is not None:
                o = o + L.b_o
            if L.post_attn is not None:
                o = _norm(o, L.post_attn, None, nk, eps)
            x = x + o
            h = _norm(x, L.n2, L.n2b, nk, eps)
            y = self._ffn_dense(L, h.reshape(B * Tn, -1), _glue_eager()).reshape(B, Tn, -1)
            if L.post_ffn is not None:
                y = _norm(y, L.post_ffn, None, nk, eps)
            x = x + y
        h = _norm(x[:, -1], self.final_norm, self.final_norm_b, nk, self.final_eps)
        logits = self._logits(h)
        self.tok.copy_(logits.argmax(-1))
        self.pos.fill_(Tn)
        self.out_tokens.zero_()
        self.stat_mlp.zero_()
        self.stat_heads.zero_()
        self.stat_in.zero_()
        self.steps = 0
        self._all_logits = None
        return logits

    # ------------------------------------------------------------------ sparse selection
    def _select(self, pred, xin, n: int):
        """Active set of ``pred`` for the batch: (idx, count) per kernels.common's convention."""
        s = pred.scores(xin)
        if getattr(pred, "rule", "topk") == "topk":
            k = max(1, min(n, int(pred.k)))
            top = self._topk(s, k)
            if s.shape[0] == 1:
                return top.reshape(-1), None
            m = torch.zeros(s.shape, dtype=torch.bool, device=s.device).scatter_(1, top.long(), True)
            return ops.union_active(m)
        keep = s > 0
        return ops.compact(keep[0]) if s.shape[0] == 1 else ops.union_active(keep)

    def _topk(self, s, k: int):
        """Top-k indices per row of the scores [B, n]: the one-CTA radix select (kernels.select_triton; indices
        ascending, ties to the lowest index) where the Triton kernels run, else ``torch.topk``."""
        if self.select_impl == "triton" or (self.select_impl == "auto" and ops.backend_name(s) == "triton"):
            from kernels.select_triton import topk_select

            return topk_select(s, k)
        return torch.topk(s, k, dim=-1, sorted=False).indices

    # ------------------------------------------------------------------ the one-token step
    def _step(self, keep_logits: bool = False):
        dims = self.dims
        H, KV, hd = dims.n_heads, dims.n_kv_heads, dims.head_dim
        B = self.batch
        fns = self._glue()
        nk, eps = self.norm_kind, self.eps
        cuda = self.device.type == "cuda"
        side = self._side if (cuda and self.overlap and self.sparse) else None
        pending: dict = {}   # (kind, layer) -> (event or None, (idx, count))
        keep = self._keep

        def launch(kind, l, pred, xin, n):
            if side is None:
                pending[(kind, l)] = (None, self._select(pred, xin, n))
                return
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                sel = self._select(pred, xin, n)
                ev = torch.cuda.Event()
                ev.record(side)
            keep.extend([xin, *[t for t in sel if t is not None]])
            pending[(kind, l)] = (ev, sel)

        def get(kind, l, pred, xin, n):
            if (kind, l) not in pending:
                launch(kind, l, pred, xin, n)
            ev, sel = pending.pop((kind, l))
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)
            return sel

        x = self._embed(self.tok, self.pos)
        prev_x = x
        nl = len(self.layers)
        h = fns["norm"](x, self.layers[0].n1, self.layers[0].n1b, nk, eps)
        for l, L in enumerate(self.layers):
            # predictors whose input is known now: look-ahead for l+1 (from x entering l), residual for l
            if side is not None:
                for ll in (l, l + 1):
                    if ll >= nl:
                        continue
                    for kind, preds, n in (("mlp", self.mlp_pred, dims.D), ("attn", self.head_pred, H)):
                        p = preds.get(ll)
                        if p is None or (kind, ll) in pending:
                            continue
                        if p.input_kind == "lookahead" and (ll == l + 1 or l == 0):
                            launch(kind, ll, p, x, n)
                        elif p.input_kind == "residual" and ll == l and kind == "mlp":
                            launch(kind, ll, p, x, n)
            # ---- attention
            hp = self.head_pred.get(l)
            ia = self.in_attn.get(l)
            if hp is None:
                if ia is not None and "qkv" in ia:
                    qkv = self._in_linear(l, h, L.w_qkv_t, ia["qkv"], L.b_qkv)
                else:
                    qkv = self._linear(h, L.w_qkv, L.b_qkv)
                q = qkv[:, : H * hd].view(B, H, hd)
                k = qkv[:, H * hd: (H + KV) * hd].view(B, KV, hd)
                v = qkv[:, (H + KV) * hd:].view(B, KV, hd)
                a = fns["attn"](q, k, v, self.k_cache[l], self.v_cache[l], *(L.rope or (None, None)), self.pos,
                                L.qn, L.kn, eps, L.window, None)
                if ia is not None and "o" in ia:
                    o = self._in_linear(l, a, L.w_o_t, ia["o"], L.b_o)
                else:
                    o = self._linear_t(a, L.w_o_t, L.b_o)
            else:
                xin = x if hp.input_kind == "residual" or l == 0 else prev_x
                q_idx, q_count = get("attn", l, hp, xin, H)
                o = self._sparse_attn(L, l, h, q_idx, q_count, fns)
                if q_count is not None:
                    self.stat_heads[l] += q_count[0]
            if L.post_attn is not None:
                o = fns["norm"](o, L.post_attn, None, nk, eps)
            x_in_layer = x
            x, h = fns["add_norm"](x, o, L.n2, L.n2b, nk, eps)
            # ---- FFN
            mp = self.mlp_pred.get(l)
            if mp is None:
                ifn = self.in_ffn.get(l)
                y = self._ffn_dense(L, h, fns) if ifn is None else self._ffn_input_sparse(l, L, h, ifn, fns)
            elif l in self.thr_ffn:
                y = self._ffn_threshold(l, L, h)
            else:
                kind = mp.input_kind
                xin = h if kind == "ffn_in" else (x_in_layer if kind == "residual" or l == 0 else prev_x)
                idx, count = get("mlp", l, mp, xin, dims.D)
                thr = self.seq_thr.get(l)
                if count is not None:
                    self.stat_mlp[l] += count[0]
                if self.gated:
                    y = ops.sparse_ffn(h, L.w_gate, L.w_up, L.w_down_t, idx, count, self.act, thr,
                                       allow_dense=count is None)
                else:
                    y = ops.sparse_mlp(h, L.w_up, L.b_up, L.w_down_t, L.b_down, idx, count, self.act,
                                       allow_dense=count is None)
            if L.post_ffn is not None:
                y = fns["norm"](y, L.post_ffn, None, nk, eps)
            prev_x = x_in_layer
            if l + 1 < nl:
                nxt = self.layers[l + 1]
                x, h = fns["add_norm"](x, y, nxt.n1, nxt.n1b, nk, eps)
            else:
                x, h = fns["add_norm"](x, y, self.final_norm, self.final_norm_b, nk, self.final_eps)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        logits = self._logits(h)
        nxt_tok = logits.argmax(-1)
        self.out_tokens.index_copy_(1, self.pos, nxt_tok[:, None])
        self.tok.copy_(nxt_tok)
        self.pos.add_(1)
        return logits if keep_logits else None

    def _sparse_attn(self, L, l, h, q_idx, q_count, fns):
        dims = self.dims
        H, KV, hd = dims.n_heads, dims.n_kv_heads, dims.head_dim
        B = h.shape[0]
        Kq = q_idx.shape[0]
        dev = h.device
        if self.kv_mode == "exact":
            kv_idx, kv_count, valid = self.kv_all, None, None
        else:
            kv_idx, kv_count, _ = ops.kv_heads_for(q_idx, q_count, H, KV)
            valid = self.valid[l]
        q, k, v = ops.head_sparse_qkv(h.contiguous(), L.w_qkv, q_idx, q_count, kv_idx, kv_count, H, KV, hd, L.b_qkv)
        jq = torch.arange(Kq, device=dev)
        if q_count is None:
            tgt, src = q_idx.long(), q_idx.long()
        else:
            ok = jq < q_count
            tgt = torch.where(ok, q_idx.long(), H)
            src = torch.where(ok, q_idx.long(), 0)
        q_full = torch.zeros(B, H + 1, hd, device=dev, dtype=q.dtype)
        q_full.index_copy_(1, tgt, q)
        if self.kv_mode == "exact":
            k_full, v_full = k, v
            vmask = None
        else:    # K/V rows of the active KV heads only; the rest go to the spare slot KV and stay masked
            jk = torch.arange(kv_idx.shape[0], device=dev)
            ktgt = torch.where(jk < kv_count, kv_idx.long(), KV)
            k_full = torch.zeros(B, KV + 1, hd, device=dev, dtype=k.dtype).index_copy_(1, ktgt, k)
            v_full = torch.zeros(B, KV + 1, hd, device=dev, dtype=v.dtype).index_copy_(1, ktgt, v)
            on = torch.zeros(KV + 1, dtype=torch.bool, device=dev).index_fill_(0, ktgt, True)
            valid.index_copy_(2, self.pos, on.view(1, KV + 1, 1).expand(B, KV + 1, 1).contiguous())
            k_full, v_full = k_full[:, :KV], v_full[:, :KV]
            vmask = valid[:, :KV]
        a = fns["attn"](q_full[:, :H], k_full, v_full, self.k_cache[l], self.v_cache[l],
                        *(L.rope or (None, None)), self.pos, L.qn, L.kn, self.eps, L.window, vmask)
        a_act = a.view(B, H, hd).index_select(1, src).reshape(B, Kq * hd).contiguous()
        return ops.head_sparse_out(a_act, L.w_o_t, q_idx, q_count, hd, L.b_o)

    # ------------------------------------------------------------------ driving
    def _capture(self):
        """Warm up (Triton compiles, glue compiles) on a side stream, restore the state, capture one step."""
        self._side = torch.cuda.Stream()
        pos, tok = self.pos.clone(), self.tok.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._keep = []
                self._step()
                self.pos.copy_(pos)
                self.tok.copy_(tok)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self._keep = []      # tensors shared across streams stay alive as long as the graph
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._step()
        self._graph, self._graph_keep = g, self._keep
        self.pos.copy_(pos)
        self.tok.copy_(tok)
        self.stat_mlp.zero_()
        self.stat_heads.zero_()
        self.stat_in.zero_()

    @torch.no_grad()
    def step(self, keep_logits: bool = False):
        """One decode token for every sequence (greedy). Returns logits only when ``keep_logits`` (eager)."""
        if self.device.type == "cuda" and self.use_graph and not keep_logits:
            if self._graph is None:
                self._capture()
            self._graph.replay()
            out = None
        else:
            if getattr(self, "_side", None) is None and self.device.type == "cuda":
                self._side = torch.cuda.Stream()
            self._keep = []
            out = self._step(keep_logits)
            self._keep = []
        self.steps += 1
        return out

    @torch.no_grad()
    def decode(self, n: int) -> torch.Tensor:
        """``n`` greedy tokens after ``prefill``: [B, n] (the first is prefill's argmax)."""
        start = int(self.pos)
        first = self.tok.clone()
        for _ in range(n - 1):
            self.step()
        out = self.out_tokens[:, start: start + n - 1]
        return torch.cat([first[:, None], out], 1)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        if self.batch != ids.shape[0] or self.max_len < ids.shape[1] + n:
            self.setup(ids.shape[0], ids.shape[1] + n)
        self.prefill(ids)
        return self.decode(n)

    def realized_sparsity(self) -> dict:
        """Mean sparsity over the decode steps so far, over all layers (dense layers count as 0):
        ``mlp`` (neurons of the batch's active set), ``heads`` (query heads)."""
        out = {}
        n, nl = max(self.steps, 1), len(self.layers)
        for key, preds, N, stat in (("mlp", self.mlp_pred, self.dims.D, self.stat_mlp),
                                    ("heads", self.head_pred, self.dims.n_heads, self.stat_heads)):
            if not preds:
                continue
            dyn = stat.cpu()
            kept = 0.0
            for l in range(nl):
                p = preds.get(l)
                if p is None:
                    kept += N
                elif getattr(p, "rule", "topk") == "topk" and self.batch == 1:
                    kept += max(1, min(N, int(p.k)))
                else:
                    kept += float(dyn[l]) / n
            out[key] = 1.0 - kept / (N * nl)
        if self.input_sparse:
            out.update(self._weights_skipped())
        return out

    def _proj_numel(self) -> dict[str, tuple[int, int]]:
        """Projection -> (weight elements, input length) per layer."""
        dims = self.dims
        H, KV, hd, d, D = dims.n_heads, dims.n_kv_heads, dims.head_dim, dims.d, dims.D
        out = dict(q=(d * H * hd, d), k=(d * KV * hd, d), v=(d * KV * hd, d), o=(H * hd * d, H * hd),
                   up=(d * D, d), down=(D * d, D))
        if self.gated:
            out["gate"] = (d * D, d)
        return out

    def _weights_skipped(self) -> dict:
        """``inputs``: fraction of the decoder's projection weights (q, k, v, o, gate, up, down of every layer)
        not read per decode step because of input sparsity; ``weights``: the same fraction counting every part
        of the plan (input sparsity, the FFN rows a neuron predictor skipped, the q/o rows of skipped heads)."""
        numel = self._proj_numel()
        nl = len(self.layers)
        total = nl * sum(n for n, _ in numel.values())
        seen = max(self.steps, 1) * max(self.batch, 1)
        stat = self.stat_in.cpu()
        skipped_in = 0.0
        for l in range(nl):
            for ent in (*self.in_attn.get(l, {}).values(), *self.in_ffn.get(l, {}).values()):
                _, sizes, col = ent
                for j in range(len(sizes)):
                    p = PROJ[col + j]
                    if p not in numel or not self._thresholded(l, p):
                        continue
                    n, n_in = numel[p]
                    skipped_in += (1.0 - float(stat[l, col + j]) / (seen * n_in)) * n
        skipped = skipped_in
        sp = {}
        for key, preds, N in (("mlp", self.mlp_pred, self.dims.D), ("heads", self.head_pred, self.dims.n_heads)):
            if preds:
                sp[key] = 1.0 - (self._kept_per_layer(key, preds, N) / N)
        if "mlp" in sp:
            for l, frac_skip in enumerate(sp["mlp"]):
                if l not in self.mlp_pred:
                    continue
                parts = ("up", "down") if (l in self.thr_ffn or (self.plan is not None and self.plan.dense_gate)) \
                    else (("gate", "up", "down") if self.gated else ("up", "down"))
                skipped += float(frac_skip) * sum(numel[p][0] for p in parts)
        if "heads" in sp:
            for l, frac_skip in enumerate(sp["heads"]):
                if l in self.head_pred:
                    skipped += float(frac_skip) * (numel["q"][0] + numel["o"][0])
        return {"inputs": skipped_in / total, "weights": skipped / total}

    def _thresholded(self, l: int, p: str) -> bool:
        return self.plan is not None and p in self.plan.inputs.get(l, {})

    def _kept_per_layer(self, key, preds, N) -> torch.Tensor:
        """Mean kept count per layer (dense layers: N), as in realized_sparsity."""
        stat = (self.stat_mlp if key == "mlp" else self.stat_heads).cpu()
        n = max(self.steps, 1)
        out = torch.full((len(self.layers),), float(N), dtype=torch.float64)
        for l, p in preds.items():
            if getattr(p, "rule", "topk") == "topk" and self.batch == 1:
                out[l] = max(1, min(N, int(p.k)))
            else:
                out[l] = float(stat[l]) / n
        return out

    def weight_bytes(self) -> int:
        """Bytes of weights one dense decode step reads (layers + final norm + LM head)."""
        n = 0
        for L in self.layers:
            for name in _Layer.__slots__:
                t = getattr(L, name)
                if isinstance(t, torch.Tensor) and name not in _ALT_LAYOUTS:
                    n += t.numel() * t.element_size()
        return n + self.lm_head.numel() * self.lm_head.element_size()


# ---------------------------------------------------------------------------------------------------------
def _glue_eager():
    return dict(norm=_norm, add_norm=_add_norm, act_mul=_act_mul, attn=_attn_decode)


def _column_norms(L: _Layer, q_fold: float, nq: int, nkv: int) -> dict[str, torch.Tensor]:
    """‖W[:, i]‖₂ of every projection's input channels (fp32), from the runtime's layout (the query rows hold
    the folded attention scale ``q_fold``: divided out again), as workers.sparsity.input_sparse.column_norms."""
    w = L.w_qkv.float()
    out = dict(q=w[:nq].norm(dim=0) / q_fold, k=w[nq: nq + nkv].norm(dim=0), v=w[nq + nkv:].norm(dim=0),
               o=L.w_o_t.float().norm(dim=1), up=L.w_up.float().norm(dim=0), down=L.w_down_t.float().norm(dim=1))
    if L.w_gate is not None:
        out["gate"] = L.w_gate.float().norm(dim=0)
    return out


def _on(pred: nn.Module, device, dtype) -> nn.Module:
    p = copy.deepcopy(pred).to(device=device)
    if torch.device(device).type == "cuda":
        p = p.to(dtype=dtype)
    for k, v in list(vars(p).items()):          # plain tensor attributes (GateThreshold keeps its weight so)
        if isinstance(v, torch.Tensor):
            setattr(p, k, v.to(device))
    return p.eval()


def _rope_tables(model, cfg, family):
    """{layer_type: (cos, sin)} [max_pos, hd] float32 from the model's own rotary module (any RoPE scaling)."""
    if family == "opt":
        return None
    rot = get_path(model, "model.rotary_emb")
    n = int(getattr(cfg, "max_position_embeddings", 4096))
    n = min(n, 1 << 16)
    p0 = next(model.parameters())
    pos = torch.arange(n, device=p0.device)[None, :]
    dummy = torch.zeros(1, dtype=torch.float32, device=p0.device)
    out = {}
    types = sorted(set(getattr(cfg, "layer_types", None) or ["full_attention"]))
    for lt in types:
        try:
            cos, sin = rot(dummy, pos, lt)
        except TypeError:
            cos, sin = rot(dummy, pos)
        out[lt] = (cos[0].float(), sin[0].float())
    return out


def random_hf_model(config, dtype=torch.float16, device="cuda", seed: int = 0) -> nn.Module:
    """An HF causal LM built from ``config`` with random weights, directly on ``device`` in ``dtype``."""
    import transformers as tf

    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = tf.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(prev)
    return model.to(device=device, dtype=dtype).eval()
