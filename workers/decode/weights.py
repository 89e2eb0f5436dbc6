"""Weight conversion for the decode runtime: an HF causal LM (or a config: random weights of the real shapes) ->
frozen per-layer weight structs in the kernels' layout.

    w = from_hf(model)                         # copies (dtype / device optional), via workers.loading.adapters
    w = from_config(config, torch.float16, "cuda")
    w.layers[l].w_qkv, w.lm_head, w.dims, ...

Families: llama, mistral, qwen2, gemma3 (q/k norms, sandwich norms, scaled embedding, sliding layers), opt
(LayerNorm, biases, learned positions, ReLU fc1/fc2). Layout: packed ``w_qkv`` [(H+2KV)·hd, d] (query rows
pre-scaled by the attention scale; Gemma: the scale sits in the q-norm weight), ``w_o_t`` = W_oᵀ,
``w_gate``/``w_up`` [D, d], ``w_down_t`` = W_downᵀ: one copy serves the dense and the sparse path. Other layouts
of the same weights (gate|up packed, Wᵀ copies for input sparsity) live in ``LayerWeights.layouts``, made on
demand and dropped with the plan that needed them; :meth:`ModelWeights.weight_bytes` never counts them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import nn

from kernels import cpu_quant
from kernels.quant import QuantWeight
from workers.loading.adapters import adapter_for, get_path, linear_weight

FAMILIES = ("llama", "mistral", "qwen2", "gemma3", "opt")
PROJ = ("q", "k", "v", "o", "gate", "up", "down")   # columns of the input-sparsity counters


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One decoder layer's weights (plain tensors; None where the family has no such part)."""

    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o_t: torch.Tensor
    b_o: torch.Tensor | None
    n1: torch.Tensor                  # attention norm (weight, bias)
    n1b: torch.Tensor | None
    n2: torch.Tensor                  # FFN norm
    n2b: torch.Tensor | None
    post_attn: torch.Tensor | None    # Gemma's sandwich norms
    post_ffn: torch.Tensor | None
    qn: torch.Tensor | None           # Gemma's q/k norms (q: times the attention scale)
    kn: torch.Tensor | None
    w_gate: torch.Tensor | None
    w_up: torch.Tensor
    w_down_t: torch.Tensor
    b_up: torch.Tensor | None
    b_down: torch.Tensor | None
    window: int | None                # sliding window of this layer
    rope: tuple | None                # (cos, sin) [max_pos, hd] fp32
    layouts: dict = field(default_factory=dict)   # derived layouts: "gu", "qkv_t", "gu_t", "up_t", "o_t", "down_t"
    # rotated input sparsity (workers.methods.larosa.runtime): the residual stream's change of basis before the
    # attention / FFN norm (x <- x @ A), or an explicit rotation of the normed input (h <- h @ Q); None: nothing
    adapt_attn: torch.Tensor | None = None
    adapt_ffn: torch.Tensor | None = None
    rot_attn: torch.Tensor | None = None
    rot_ffn: torch.Tensor | None = None

    def gu(self) -> torch.Tensor:
        """gate|up packed [2D, d] (made on first use: the dense FFN's one GEMM)."""
        if "gu" not in self.layouts:
            self.layouts["gu"] = torch.cat([self.w_gate, self.w_up], 0)
        return self.layouts["gu"]

    @property
    def w_qkv_t(self):
        return self.layouts.get("qkv_t")

    @property
    def w_gu_t(self):
        return self.layouts.get("gu_t")

    @property
    def w_up_t(self):
        return self.layouts.get("up_t")

    @property
    def w_o_in(self):
        """Wᵀ of O as input sparsity reads it: the plan's transposed blocks over GGUF weights, else ``w_o_t``."""
        return self.layouts.get("o_t", self.w_o_t)

    @property
    def w_down_in(self):
        """Wᵀ of down as input sparsity reads it (as :attr:`w_o_in`)."""
        return self.layouts.get("down_t", self.w_down_t)

    def nbytes(self) -> int:
        return sum(t.nbytes for f in fields(self)
                   if isinstance(t := getattr(self, f.name), (torch.Tensor, QuantWeight)))


@dataclass(frozen=True, eq=False)
class ModelWeights:
    family: str
    dims: object                      # workers.loading.adapters.ModelDims
    act: str
    gated: bool
    vocab: int
    norm_kind: str                    # "ln" | "rms" | "rms1p"
    eps: float
    final_eps: float
    q_fold: float                     # factor folded into the stored query rows
    layers: tuple
    embed: torch.Tensor
    embed_scale: torch.Tensor | None  # Gemma's scaled embedding
    pos_embed: torch.Tensor | None    # OPT's learned positions (offset pos_offset)
    pos_offset: int
    proj_in: torch.Tensor | None
    proj_out: torch.Tensor | None
    final_norm: torch.Tensor
    final_norm_b: torch.Tensor | None
    lm_head: torch.Tensor
    softcap: float | None
    device: torch.device
    dtype: torch.dtype

    def weight_bytes(self) -> int:
        """Bytes of weights one dense decode step reads (layers + final norm + LM head)."""
        return sum(L.nbytes() for L in self.layers) + self.lm_head.nbytes

    @property
    def quantized(self) -> bool:
        """Whether the projections are GGUF blocks (workers.decode.quant_weights), not tensors."""
        return isinstance(self.lm_head, QuantWeight)

    def proj_numel(self) -> dict[str, tuple[int, int]]:
        """Projection -> (weight elements, input length) per layer."""
        d = self.dims
        H, KV, hd, D = d.n_heads, d.n_kv_heads, d.head_dim, d.D
        out = dict(q=(d.d * H * hd, d.d), k=(d.d * KV * hd, d.d), v=(d.d * KV * hd, d.d), o=(H * hd * d.d, H * hd),
                   up=(d.d * D, d.d), down=(D * d.d, D))
        if self.gated:
            out["gate"] = (d.d * D, d.d)
        return out


# ---------------------------------------------------------------------------------------------------------
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


def from_config(config, dtype=torch.float16, device="cuda", seed: int = 0) -> ModelWeights:
    """Random weights of the real shapes (an HF model is built on ``device`` and copied)."""
    model = random_hf_model(config, dtype, device, seed)
    w = from_hf(model)
    del model
    return w


@dataclass(frozen=True)
class _Cast:
    """Copies of HF tensors on the runtime's device, in its dtype (or float32)."""

    device: torch.device
    dtype: torch.dtype
    rms1p: bool                       # norms store 1 + weight (Gemma)

    def copy(self, t):
        return None if t is None else t.detach().to(device=self.device, dtype=self.dtype).contiguous()

    def f32(self, t):
        return t.to(device=self.device, dtype=torch.float32).contiguous()

    def norm(self, m):
        return self.f32(1.0 + m.weight.detach().float()) if self.rms1p else self.copy(m.weight)


def _eps_of(m) -> float:
    e = getattr(m, "variance_epsilon", None)
    return float(e if e is not None else m.eps)


@torch.no_grad()
def from_hf(model: nn.Module, dtype: torch.dtype | None = None, device=None) -> ModelWeights:
    ad = adapter_for(model)
    fam = ad.family
    if fam not in FAMILIES:
        raise ValueError(f"decode runtime supports {FAMILIES}, not {fam!r}")
    cfg = model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    if fam == "opt" and not getattr(cfg, "do_layer_norm_before", True):
        raise ValueError("OPT with post-layer-norm (opt-350m) is not supported")
    p0 = next(model.parameters())
    dev = torch.device(device) if device is not None else p0.device
    dtype = dtype or p0.dtype
    dims = ad.dims(cfg)
    norm_kind = "ln" if fam == "opt" else ("rms1p" if fam == "gemma3" else "rms")
    c = _Cast(dev, dtype, norm_kind == "rms1p")
    q_scalar = getattr(cfg, "query_pre_attn_scalar", None)
    scale = (q_scalar if q_scalar is not None else dims.head_dim) ** -0.5
    rope = _rope_tables(model, cfg, fam)
    layer_types = getattr(cfg, "layer_types", None)
    sw = getattr(cfg, "sliding_window", None)
    layers, eps = [], None
    for i, layer in ad.iter_layers(model):
        eps = _eps_of(get_path(layer, ad.attn.norm))
        lt = layer_types[i] if layer_types else "full_attention"
        rt = rope.get(lt, rope.get("full_attention")) if rope else None
        window = sw if fam == "mistral" or lt == "sliding_attention" else None
        layers.append(_layer_weights(ad, c, layer, scale, rt, window))
    emb = model.get_input_embeddings()
    pos_embed, pos_offset, proj_in, proj_out = _opt_inputs(model, c) if fam == "opt" else (None, 0, None, None)
    fn = get_path(model, ad.final_norm)
    embed_scale = (torch.tensor(float(getattr(emb, "scalar_embed_scale", 1.0)), dtype=dtype, device=dev)
                   if fam == "gemma3" else None)
    return ModelWeights(
        family=fam, dims=dims, act=ad.act_name(cfg), gated=ad.ffn.gated, vocab=cfg.vocab_size,
        norm_kind=norm_kind, eps=eps, final_eps=_eps_of(fn), q_fold=1.0 if fam == "gemma3" else scale,
        layers=tuple(layers), embed=c.copy(emb.weight), embed_scale=embed_scale, pos_embed=pos_embed,
        pos_offset=pos_offset, proj_in=proj_in, proj_out=proj_out, final_norm=c.norm(fn),
        final_norm_b=c.copy(getattr(fn, "bias", None)), lm_head=c.copy(model.get_output_embeddings().weight),
        softcap=getattr(cfg, "final_logit_softcapping", None), device=dev, dtype=dtype)


def _layer_weights(ad, c: _Cast, layer, scale: float, rope, window: int | None) -> LayerWeights:
    """One decoder layer in the runtime's layout; ``scale``, the attention scale, goes into the query rows (Gemma:
    into the q-norm weight)."""
    gemma = ad.family == "gemma3"
    attn = ad.attn_module(layer)
    q, k, v, o = (get_path(attn, p) for p in (ad.attn.q, ad.attn.k, ad.attn.v, ad.attn.o))
    qn = get_path(attn, "q_norm") if gemma else None
    wq = q.weight.detach().float()
    bq = q.bias.detach().float() if q.bias is not None else None
    if qn is None:        # fold the attention scale into the query rows (RoPE and scores are linear)
        wq = wq * scale
        bq = bq * scale if bq is not None else None
    n1, n2 = get_path(layer, ad.attn.norm), get_path(layer, ad.ffn.norm)
    w = ad.ffn_weights(layer)
    return LayerWeights(
        w_qkv=c.copy(torch.cat([wq, k.weight.detach().float(), v.weight.detach().float()], 0)),
        b_qkv=(c.copy(torch.cat([bq, k.bias.detach().float(), v.bias.detach().float()], 0))
               if bq is not None else None),
        w_o_t=c.copy(linear_weight(o).t()),
        b_o=c.copy(o.bias) if getattr(o, "bias", None) is not None else None,
        n1=c.norm(n1), n1b=c.copy(getattr(n1, "bias", None)), n2=c.norm(n2), n2b=c.copy(getattr(n2, "bias", None)),
        post_attn=c.norm(get_path(layer, "post_attention_layernorm")) if gemma else None,
        post_ffn=c.norm(get_path(layer, "post_feedforward_layernorm")) if gemma else None,
        qn=c.f32((1.0 + qn.weight.detach().float()) * scale) if qn is not None else None,
        kn=c.f32(1.0 + get_path(attn, "k_norm").weight.detach().float()) if qn is not None else None,
        w_gate=c.copy(w.get("gate")), w_up=c.copy(w["up"]), w_down_t=c.copy(w["down"].t()),
        b_up=c.copy(w.get("b_up")), b_down=c.copy(w.get("b_down")),
        window=window, rope=tuple(c.f32(t) for t in rope) if rope is not None else None)


def _opt_inputs(model, c: _Cast) -> tuple:
    """OPT's (learned positions, their offset, project_in, project_out)."""
    dec = model.model.decoder
    proj_in = c.copy(dec.project_in.weight) if dec.project_in is not None else None
    proj_out = c.copy(dec.project_out.weight) if dec.project_out is not None else None
    return c.copy(dec.embed_positions.weight), getattr(dec.embed_positions, "offset", 2), proj_in, proj_out


def column_norms(L: LayerWeights, q_fold: float, nq: int, nkv: int) -> dict[str, torch.Tensor]:
    """‖W[:, i]‖₂ of every projection's input channels (fp32), from the runtime's layout (the query rows hold
    the folded attention scale ``q_fold``: divided out again), as workers.sparsity.input_sparse.column_norms."""
    quant = isinstance(L.w_qkv, QuantWeight)        # GGUF blocks: the O / down slots hold W [out, in] itself
    f = (lambda t: cpu_quant.dequantize(t)) if quant else (lambda t: t.float())
    w = f(L.w_qkv)
    t_dim = 0 if quant else 1
    out = dict(q=w[:nq].norm(dim=0) / q_fold, k=w[nq: nq + nkv].norm(dim=0), v=w[nq + nkv:].norm(dim=0),
               o=f(L.w_o_t).norm(dim=t_dim), up=f(L.w_up).norm(dim=0), down=f(L.w_down_t).norm(dim=t_dim))
    if L.w_gate is not None:
        out["gate"] = f(L.w_gate).norm(dim=0)
    return out


def _rope_tables(model, cfg, family):
    """{layer_type: (cos, sin)} [max_pos, hd] float32 from the model's own rotary module (any RoPE scaling)."""
    if family == "opt":
        return None
    rot = get_path(model, "model.rotary_emb")
    n = min(int(getattr(cfg, "max_position_embeddings", 4096)), 1 << 16)
    p0 = next(model.parameters())
    pos = torch.arange(n, device=p0.device)[None, :]
    dummy = torch.zeros(1, dtype=torch.float32, device=p0.device)
    out = {}
    for lt in sorted(set(getattr(cfg, "layer_types", None) or ["full_attention"])):
        try:
            cos, sin = rot(dummy, pos, lt)
        except TypeError:
            cos, sin = rot(dummy, pos)
        out[lt] = (cos[0].float(), sin[0].float())
    return out
