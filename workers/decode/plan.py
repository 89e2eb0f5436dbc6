"""A :class:`SparsityPlan` compiled for the decode runtime's weights: which layers run which sparse path.

    rp = RuntimePlan.build(plan, weights)     # plan None: dense
    rp.mlp[l], rp.heads[l]                    # predictors on the runtime's device / dtype (copies)
    rp.thr_ffn[l]                             # gate-threshold fast path: (threshold, score bias)
    rp.in_attn[l], rp.in_ffn[l]               # input sparsity: {group: InputGroup} (R-Sparse: with low-rank terms)
    rp.rot[l]                                 # a rotated plan's top-k: {group: TopK} (over weights rotated by
                                              # workers.decode.rotate, which set_plan passes here)
    rp.dense                                  # nothing sparse left: the runtime runs its dense step

Keep-all parts are dropped, so they run the dense code (greedy tokens at s = 0 are the dense ones on every
device): a top-k predictor with k >= N, a gate threshold t < 0 (|act| > t keeps every neuron), an input
threshold t < 0, a ``positive``-rule MLP predictor whose layer was fitted at target sparsity 0. ``reports`` keeps
what the plan had (``mlp``, ``heads``, ``inputs``) so realized sparsity still reports 0 for them.

Gate-threshold predictors (method ``threshold``: |act(W_gate h)| > t on the FFN's own gate) run the gate dense
once and then only the up / W_downᵀ rows of the kept neurons (``thr_ffn``). Over GGUF blocks a layer with an FFN
predictor reads the active neurons' whole quantized rows of gate / up and their rows of W_down's exact transposed
blocks (layout ``down_t``), a layer with a head predictor the active heads' rows of W_oᵀ (``o_t``). Input
sparsity (``plan.inputs``, TEAL / WINA): QKV share one input and one Wᵀ copy with three thresholds, gate|up
likewise with two; O and down use ``w_o_t`` / ``w_down_t`` as stored (over GGUF blocks: their transposed blocks,
``o_t`` / ``down_t``); the Wᵀ copies exist only for the projections the plan needs (in ``LayerWeights.layouts``,
dropped with the plan). WINA's |x_i|·‖W[:, i]‖ > t runs as |x_i| > t/‖W[:, i]‖ (one threshold per input channel,
read by the kernels with x). Runtimes that share one ModelWeights share those
layouts: set a plan on one of them only (another's set_plan drops the layouts its own plan does not need).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from kernels import cpu_quant
from kernels.common import ACTS
from kernels.quant import QuantWeight
from workers.decode.weights import PROJ, ModelWeights, column_norms
from workers.sparsity.predictors.base import neuron_out_norm
from workers.sparsity.predictors.threshold import GateThreshold
from workers.sparsity.rotated import GROUP_PROJECTIONS, keep_count


class InputGroup(NamedTuple):
    """Projections that read one input under input sparsity (QKV, gate|up, or one projection alone)."""
    thresholds: torch.Tensor        # [n] (one per projection) or, WINA, [n, n_in] (t / ‖W[:, i]‖ per input channel)
    sizes: tuple[int, ...]          # the output segment of each projection in the fused product
    col: int                        # the first projection's column of the input counters (PROJ); the rest follow
    lowrank: tuple = ()             # rank-sparse: a LowRankTerm per projection with factors (the dropped inputs)

    @classmethod
    def of(cls, thresholds: torch.Tensor, sizes: tuple[int, ...], projections: tuple[str, ...]) -> "InputGroup":
        col = PROJ.index(projections[0])
        if PROJ[col: col + len(projections)] != projections or len(sizes) != len(projections):
            raise ValueError(f"{projections}: not consecutive counter columns of {PROJ}, or not one size each")
        return cls(thresholds, tuple(sizes), col)

    def with_lowrank(self, terms: tuple) -> "InputGroup":
        return self._replace(lowrank=tuple(terms))

    @property
    def projections(self) -> tuple[str, ...]:
        return PROJ[self.col: self.col + len(self.sizes)]

    def counts(self, row: torch.Tensor) -> torch.Tensor:
        """The group's columns of a layer's row of input counters (a view: kernels add to it)."""
        return row[self.col: self.col + len(self.sizes)]


@dataclass
class RuntimePlan:
    plan: object = None                       # the SparsityPlan as given (None: dense)
    mlp: dict = field(default_factory=dict)
    heads: dict = field(default_factory=dict)
    seq_thr: dict = field(default_factory=dict)
    seq_w: dict = field(default_factory=dict)    # the damage filter's c_i per layer (SparsityPlan.seq_filter_on)
    thr_ffn: dict = field(default_factory=dict)
    in_attn: dict = field(default_factory=dict)
    in_ffn: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)   # input-sparse projections {layer: {projection: threshold or k}}
    rot: dict = field(default_factory=dict)      # rotated top-k: {layer: {group: TopK}} (weights rotated already)
    extra_numel: int = 0                         # weight elements a token reads beside the projections
    reports: frozenset = frozenset()
    native: dict = field(default_factory=dict, repr=False)   # packed forms for the native layers (native_layer)

    @property
    def dense(self) -> bool:
        return not (self.mlp or self.heads or self.in_attn or self.in_ffn or self.rot)

    @property
    def dense_gate(self) -> bool:
        return self.plan is not None and bool(self.plan.dense_gate)

    def drop_ffn(self, l: int) -> None:
        """Layer ``l``'s FFN runs dense from now on: its predictor, gate threshold and sequential filter go."""
        for part in (self.mlp, self.thr_ffn, self.seq_thr, self.seq_w):
            part.pop(l, None)
        self.native.clear()

    @classmethod
    def build(cls, plan, w: ModelWeights) -> "RuntimePlan":
        """``w``: for a rotated plan, the weights with its rotations folded in (workers.decode.rotate)."""
        rp = cls(plan=plan)
        if plan is not None:
            rotated, lowrank = getattr(plan, "rotated", None), getattr(plan, "lowrank", None)
            rp.reports = frozenset(k for k, on in (("mlp", plan.mlp), ("heads", plan.attn),
                                                   ("inputs", plan.inputs or rotated or lowrank)) if on)
            _predictors(rp, plan, w)
            _inputs(rp, plan, w)
            if rotated is not None:
                _rotated(rp, rotated, w)
            if lowrank is not None:
                _lowrank(rp, lowrank, w)
        _drop_unused_layouts(rp, w)
        return rp


def keeps_all(pred, n: int, info: dict | None = None) -> bool:
    """Whether ``pred`` keeps all ``n`` neurons / heads for every input (see the module doc)."""
    rule = getattr(pred, "rule", "topk")
    if getattr(pred, "method", None) == "threshold" and hasattr(pred, "threshold"):
        return float(pred.threshold) < 0
    if rule == "topk":
        return pred.k is not None and int(pred.k) >= n
    return rule == "positive" and (info or {}).get("target_sparsity", None) == 0


def _predictors(rp: RuntimePlan, plan, w: ModelWeights) -> None:
    dims = w.dims
    for l, p in plan.attn.items():
        if p.input_kind not in ("residual", "lookahead"):
            raise ValueError(f"layer {l}: head predictor input {p.input_kind!r} is not known before "
                             "the attention runs (the oracle's head_out is for evaluation only)")
    if plan.mlp and w.gated is False and w.act not in ACTS:
        raise ValueError(f"activation {w.act!r} has no sparse kernel")
    for l, p in plan.mlp.items():
        if keeps_all(p, dims.D, plan.info.get(l)):
            continue
        rp.mlp[l] = _on(p, w.device, w.dtype)
        L = w.layers[l]
        if w.quantized:           # the active neurons' rows of W_downᵀ, exact (kernels.cpu_quant.sparse_ffn)
            _layout(L, "down_t", None, L.w_down_t)
        if plan.mlp_mode == "sequential":
            rp.seq_thr[l] = plan.seq_filter.get(l)
            if plan.seq_filter_on == "damage":
                if not w.gated:
                    raise ValueError(f"layer {l}: the damage filter needs a gated FFN")
                down = cpu_quant.dequantize(L.w_down_t) if w.quantized else L.w_down_t.float().t()   # [d, D]
                rp.seq_w[l] = neuron_out_norm(down, L.post_ffn).contiguous()
        fast = _threshold_fast(w, l, p, plan)
        if fast is not None:
            rp.thr_ffn[l] = fast
    for l, p in plan.attn.items():
        if not keeps_all(p, dims.n_heads):
            rp.heads[l] = _on(p, w.device, w.dtype)
            if w.quantized:       # the active heads' rows of W_oᵀ (kernels.cpu_quant.head_sparse_out)
                _layout(w.layers[l], "o_t", None, w.layers[l].w_o_t)


def _threshold_fast(w: ModelWeights, l: int, p, plan):
    """(threshold, score bias) when layer ``l``'s predictor is a gate threshold (|act(W1 h)| > t, W1 the FFN's
    own first projection): the FFN then runs the first projection dense once and reads up/down rows of the kept
    neurons only. None: the predictor runs as any other."""
    if not isinstance(p, GateThreshold) or p.input_kind != "ffn_in":
        return None
    if plan.mlp_mode == "sequential" or p.act != w.act or w.act not in ACTS:
        return None
    L = w.layers[l]
    w1 = L.w_gate if w.gated else L.w_up
    pw = p.w_first
    if tuple(pw.shape) != tuple(w1.shape):
        return None
    w1 = cpu_quant.dequantize(w1) if isinstance(w1, QuantWeight) else w1     # GGUF blocks: their exact values
    if not torch.equal(pw.to(w1.device, w1.dtype), w1):
        return None
    b = p.b_first
    if b is not None:
        if w.gated:
            return None
        b = b.to(device=w.device, dtype=w.dtype).contiguous()
    return float(p.threshold), b


def _inputs(rp: RuntimePlan, plan, w: ModelWeights) -> None:
    """Per layer, the thresholds of each fused group (QKV share h, gate|up share the FFN input) in the layout the
    kernels take, and the Wᵀ copies they read."""
    from workers.sparsity.input_sparse import check_plan_parts

    if not plan.inputs:
        return
    check_plan_parts(plan)
    wina = plan.input_score == "wina"
    known = {"q", "k", "v", "o", "up", "down"} | ({"gate"} if w.gated else set())
    dims, dev = w.dims, w.device
    for l, per in plan.inputs.items():
        l = int(l)
        if not 0 <= l < len(w.layers):
            raise ValueError(f"input thresholds for layer {l}, model has {len(w.layers)}")
        bad = set(per) - known
        if bad:
            raise ValueError(f"layer {l}: input sparsity on {sorted(bad)}: not projections of this model "
                             f"({sorted(known)})")
        per = {p: float(t) for p, t in per.items() if float(t) >= 0}     # t < 0 keeps every input
        if not per:
            continue
        if l in rp.heads and set(per) & {"q", "k", "v", "o"}:
            raise ValueError(f"layer {l}: input sparsity on attention projections and a head predictor on "
                             "the same layer")
        rp.inputs[l] = per
        norms = _column_norms(w, l) if wina else None

        def group(names, n_in, sizes) -> InputGroup:
            """The projections ``names`` sharing one input; thresholds [len] (one each) or, WINA, [len, n_in]
            (t / ‖W[:, i]‖); a projection without one keeps every input (-1)."""
            if not wina:
                thr = torch.tensor([per.get(p, -1.0) for p in names], dtype=torch.float32, device=dev)
            else:
                rows = [per[p] / norms[p].clamp_min(1e-30) if p in per else torch.full((n_in,), -1.0, device=dev)
                        for p in names]
                thr = torch.stack(rows).to(torch.float32).contiguous()
            return InputGroup.of(thr, sizes, names)

        _add_groups(rp, w, l, per, group)


def _add_groups(rp: RuntimePlan, w: ModelWeights, l: int, per: dict, group) -> None:
    """Layer ``l``'s input-sparse groups for the projections in ``per`` (QKV, O, gate|up or fc1, down), each made
    by ``group(names, n_in, sizes)``, and the Wᵀ layouts they read."""
    L = w.layers[l]

    def add(names):
        return group(names, _in_features(w.dims, names[0]), _out_sizes(w.dims, names))

    ent = {}
    if set(per) & {"q", "k", "v"}:
        _qkv_t(L)
        ent["qkv"] = add(("q", "k", "v"))
    if "o" in per:
        if w.quantized:
            _layout(L, "o_t", None, L.w_o_t)
        ent["o"] = add(("o",))
    if ent:
        rp.in_attn[l] = ent
    ent = {}
    if w.gated and set(per) & {"gate", "up"}:
        _gu_t(L)
        ent["gu"] = add(("gate", "up"))
    elif not w.gated and "up" in per:
        _layout(L, "up_t", lambda: L.w_up.t().contiguous(), L.w_up)
        ent["up"] = add(("up",))
    if "down" in per:
        if w.quantized:
            _layout(L, "down_t", None, L.w_down_t)
        ent["down"] = add(("down",))
    if ent:
        rp.in_ffn[l] = ent


def _in_features(dims, p: str) -> int:
    """Projection ``p``'s input size (PROJ's names)."""
    return {"o": dims.n_heads * dims.head_dim, "down": dims.D}.get(p, dims.d)


def _out_sizes(dims, names) -> tuple[int, ...]:
    """The output size of each projection of ``names`` (PROJ's names): a fused product's segments."""
    out = {"q": dims.n_heads * dims.head_dim, "k": dims.n_kv_heads * dims.head_dim,
           "v": dims.n_kv_heads * dims.head_dim, "o": dims.d, "down": dims.d}
    return tuple(out.get(p, dims.D) for p in names)


class LowRankTerm(NamedTuple):
    """A rank-sparse projection's term on the inputs its threshold drops: y[:, lo:hi] += ((x ⊙ dropped) aᵀ) bᵀ;
    ``j`` its row of the group's thresholds."""
    j: int
    lo: int
    hi: int
    a: torch.Tensor                 # Σ_r V_rᵀ [r, in]
    b: torch.Tensor                 # U_r [out, r]


def _lowrank(rp: RuntimePlan, lowrank, w: ModelWeights) -> None:
    """Per layer, a rank-sparse plan's (R-Sparse, workers.sparsity.rank_sparse) input thresholds in the groups of
    :func:`_inputs` (one per projection; per input channel where a part scores |x_i|·‖W[:, i]‖) and each part's
    factors as a :class:`LowRankTerm` of its group."""
    dev = w.device
    if not w.gated:
        raise ValueError("rank-sparse plans run on gated FFNs in the decode runtime")
    fdt = torch.float32 if w.quantized else w.dtype
    for l, per in lowrank.parts.items():
        l = int(l)
        if not 0 <= l < len(w.layers):
            raise ValueError(f"rank-sparse plan for layer {l}, model has {len(w.layers)}")
        bad = set(per) - set(PROJ)
        if bad:
            raise ValueError(f"layer {l}: rank-sparse parts on {sorted(bad)}: not projections of this model")
        per = {p: part for p, part in per.items() if part.threshold >= 0}
        if not per:
            continue
        if l in rp.heads or l in rp.mlp or l in rp.in_attn or l in rp.in_ffn:
            raise ValueError(f"layer {l}: a rank-sparse plan carries no other sparse part on the same layer")
        norms = _column_norms(w, l) if any(pt.score == "wina" for pt in per.values()) else None
        rp.inputs[l] = {p: float(part.threshold) for p, part in per.items()}
        rp.extra_numel += sum(part.numel() for part in per.values())

        def group(names, n_in, sizes) -> InputGroup:
            wina = any(p in per and per[p].score == "wina" for p in names)
            rows, terms, lo = [], [], 0
            for j, (p, size) in enumerate(zip(names, sizes)):
                part = per.get(p)
                t = -1.0 if part is None else float(part.threshold)
                if wina:
                    rows.append(torch.full((n_in,), t, device=dev) if part is None or part.score == "abs"
                                else t / norms[p].clamp_min(1e-30))
                else:
                    rows.append(torch.tensor(t, device=dev))
                if part is not None and part.a is not None:
                    if tuple(part.a.shape[1:]) != (n_in,) or part.b.shape[0] != size:
                        raise ValueError(f"layer {l} {p}: factors {tuple(part.b.shape)} @ {tuple(part.a.shape)} "
                                         f"do not fit a [{size}, {n_in}] weight")
                    b = part.b * w.q_fold if p == "q" else part.b     # the query rows hold the attention scale
                    terms.append(LowRankTerm(j, lo, lo + size, part.a.to(dev, fdt).contiguous(),
                                             b.to(dev, fdt).contiguous()))
                lo += size
            thr = torch.stack(rows).to(torch.float32).contiguous()
            return InputGroup.of(thr, sizes, names).with_lowrank(terms)

        _add_groups(rp, w, l, per, group)


class TopK(NamedTuple):
    """A rotated plan's group: each token keeps its ``k`` largest |x_j| (``scale`` None) or |x_j|·scale_j;
    ``sizes`` the output segment of each of its projections in the fused product (as InputGroup's)."""
    k: int
    scale: torch.Tensor | None
    sizes: tuple[int, ...]


def _rotated(rp: RuntimePlan, rotated, w: ModelWeights) -> None:
    """Per layer, the top-k of each sparse group of a rotated plan (LaRoSA) over the rotated weights ``w``; the
    WINA score's ‖W'[:, j]‖ over the group's consumers stacked (workers.sparsity.rotated)."""
    dims = w.dims
    for l, per in rotated.sparsity.items():
        l = int(l)
        if not 0 <= l < len(w.layers):
            raise ValueError(f"rotated plan for layer {l}, model has {len(w.layers)}")
        norms = _column_norms(w, l) if rotated.score == "wina" else None
        ent = {}
        for g, s in per.items():
            names = GROUP_PROJECTIONS[g]
            n = _in_features(dims, names[0])
            if s <= 0 or keep_count(s, n) >= n:
                continue
            scale = None          # ‖W'[:, j]‖ over the group's consumers stacked
            if norms is not None:
                scale = torch.stack([norms[p] for p in names]).pow(2).sum(0).sqrt()
            ent[g] = TopK(keep_count(s, n), None if scale is None else scale.to(w.device, w.dtype),
                          _out_sizes(dims, names))
            for p in names:
                rp.inputs.setdefault(l, {})[p] = ent[g].k
            if g == "attn_in":
                _qkv_t(w.layers[l])
            elif g == "ffn_in":
                _gu_t(w.layers[l])
        if ent:
            rp.rot[l] = ent
    rp.extra_numel += sum(t.numel() for L in w.layers for t in (L.adapt_attn, L.adapt_ffn, L.rot_attn, L.rot_ffn)
                          if t is not None)


def _layout(L, key: str, make, *weights) -> None:
    """Layer ``L``'s Wᵀ layout ``key`` (input sparsity; over GGUF blocks output sparsity's O / down too), made
    once: ``make()`` over float weights; over GGUF blocks (quantized ``weights``: W [out, in] each) their exact
    transposed blocks, part by part (kernels.cpu_quant.TransposedParts; O and down too, whose slots hold W itself
    then)."""
    if key not in L.layouts:
        quant = isinstance(weights[0], QuantWeight)
        L.layouts[key] = cpu_quant.TransposedParts.of(*weights) if quant else make()


def _qkv_t(L) -> None:
    """QKV's Wᵀ (one copy for q, k and v, which read one input)."""
    _layout(L, "qkv_t", lambda: L.w_qkv.t().contiguous(), L.w_qkv)


def _gu_t(L) -> None:
    """gate|up's Wᵀ (one copy for both, which read one input)."""
    _layout(L, "gu_t", lambda: torch.cat([L.w_gate, L.w_up], 0).t().contiguous(), L.w_gate, L.w_up)


def _column_norms(w: ModelWeights, l: int) -> dict[str, torch.Tensor]:
    """‖W[:, i]‖₂ of layer ``l``'s projections (the WINA scores' weights; weights.column_norms)."""
    d = w.dims
    return column_norms(w.layers[l], w.q_fold, d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim)


def _drop_unused_layouts(rp: RuntimePlan, w: ModelWeights) -> None:
    for l, L in enumerate(w.layers):
        attn, ffn = rp.in_attn.get(l, {}), rp.in_ffn.get(l, {})
        out_sparse = w.quantized      # output sparsity over GGUF blocks reads W_oᵀ / W_downᵀ rows of the active set
        rot = rp.rot.get(l, {})
        used = {"qkv_t": "qkv" in attn or "attn_in" in rot, "gu_t": "gu" in ffn or "ffn_in" in rot,
                "up_t": "up" in ffn,
                "o_t": "o" in attn or (out_sparse and l in rp.heads),
                "down_t": "down" in ffn or (out_sparse and l in rp.mlp)}
        for key, keep in used.items():
            if not keep:
                L.layouts.pop(key, None)


def _on(pred: nn.Module, device, dtype) -> nn.Module:
    """A copy of ``pred`` on ``device`` (and in ``dtype`` on CUDA), in eval mode, its parameters frozen (so its
    GEMVs take the inference path under autograd too: ``predictors.base.linear``)."""
    p = copy.deepcopy(pred).to(device=device).requires_grad_(False)
    if torch.device(device).type == "cuda":
        p = p.to(dtype=dtype)
    for k, v in list(vars(p).items()):          # plain tensor attributes (GateThreshold keeps its weight so)
        if isinstance(v, torch.Tensor):
            setattr(p, k, v.to(device))
    return p.eval()
