"""A :class:`SparsityPlan` compiled for the decode runtime's weights: which layers run which sparse path.

    rp = RuntimePlan.build(plan, weights)     # plan None: dense
    rp.mlp[l], rp.heads[l]                    # predictors on the runtime's device / dtype (copies)
    rp.thr_ffn[l]                             # gate-threshold fast path: (threshold, score bias)
    rp.in_attn[l], rp.in_ffn[l]               # input sparsity: {group: InputGroup}
    rp.attn_fn[l], rp.ffn_fn[l]               # a plan part's own paths for its layers: fn(step, l, L, h)
                                              # (PartRuntime; over the weights its runtime_weights gave set_plan)
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


class InputGroup(NamedTuple):
    """Projections that read one input under input sparsity (QKV, gate|up, or one projection alone)."""
    thresholds: torch.Tensor        # [n] (one per projection) or, WINA, [n, n_in] (t / ‖W[:, i]‖ per input channel)
    sizes: tuple[int, ...]          # the output segment of each projection in the fused product
    col: int                        # the first projection's column of the input counters (PROJ); the rest follow

    @classmethod
    def of(cls, thresholds: torch.Tensor, sizes: tuple[int, ...], projections: tuple[str, ...]) -> "InputGroup":
        col = PROJ.index(projections[0])
        if PROJ[col: col + len(projections)] != projections or len(sizes) != len(projections):
            raise ValueError(f"{projections}: not consecutive counter columns of {PROJ}, or not one size each")
        return cls(thresholds, tuple(sizes), col)

    @property
    def projections(self) -> tuple[str, ...]:
        return PROJ[self.col: self.col + len(self.sizes)]

    def counts(self, row: torch.Tensor) -> torch.Tensor:
        """The group's columns of a layer's row of input counters (a view: kernels add to it)."""
        return row[self.col: self.col + len(self.sizes)]


GROUP_LAYOUTS = {"qkv": "qkv_t", "o": "o_t", "gu": "gu_t", "up": "up_t", "down": "down_t"}   # the Wᵀ each reads


@dataclass
class PartRuntime:
    """A plan part's runtime form (workers.sparsity.parts.PlanPart.runtime): per layer the callables that run its
    attention and FFN blocks in the step (``fn(step, l, L, h)`` -> the block's output, ``step`` a
    workers.decode.layer.Step), the blocks it runs as plain input sparsity (``in_attn`` / ``in_ffn``, as
    RuntimePlan's), the projections whose inputs it skips ({layer: {projection: threshold or k}}: realized
    sparsity), the Wᵀ layouts its callables read ({layer: {key}}) and the weight elements a token reads beside the
    projections, and the output head it runs in place of the dense one (``head(blocks, h, keep_logits)`` ->
    (next tokens, the logits or None))."""
    attn: dict = field(default_factory=dict)
    ffn: dict = field(default_factory=dict)
    in_attn: dict = field(default_factory=dict)
    in_ffn: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    extra_numel: int = 0
    head: object = None

    def layers(self) -> set[int]:
        return set(self.attn) | set(self.ffn) | set(self.in_attn) | set(self.in_ffn)


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
    attn_fn: dict = field(default_factory=dict)  # {layer: a plan part's attention} (PartRuntime.attn)
    ffn_fn: dict = field(default_factory=dict)   # {layer: a plan part's FFN}
    parts: dict = field(default_factory=dict)    # {kind: PartRuntime} of the plan's parts
    head: object = None                          # a part's output head (PartRuntime.head), None: the dense head
    extra_numel: int = 0                         # weight elements a token reads beside the projections
    reports: frozenset = frozenset()
    native: dict = field(default_factory=dict, repr=False)   # packed forms for the native layers (native_layer)
    paths: dict = field(default_factory=dict, repr=False)    # the step's per-layer paths (layer.step_paths)

    @property
    def dense(self) -> bool:
        return not (self.mlp or self.heads or self.in_attn or self.in_ffn or self.attn_fn or self.ffn_fn)

    @property
    def dense_gate(self) -> bool:
        return self.plan is not None and bool(self.plan.dense_gate)

    def drop_ffn(self, l: int) -> None:
        """Layer ``l``'s FFN runs dense from now on: its predictor, gate threshold and sequential filter go."""
        for part in (self.mlp, self.thr_ffn, self.seq_thr, self.seq_w):
            part.pop(l, None)
        self.native.clear()
        self.paths.clear()

    @classmethod
    def build(cls, plan, w: ModelWeights) -> "RuntimePlan":
        """``w``: the weights the plan's parts run over (each part's ``runtime_weights``: LaRoSA's rotations
        folded in)."""
        rp = cls(plan=plan)
        if plan is not None:
            part_reports = {r for part in plan.parts for r in part.reports}
            rp.reports = frozenset(k for k, on in (("mlp", plan.mlp), ("heads", plan.attn),
                                                   ("inputs", plan.inputs or "inputs" in part_reports)) if on)
            _predictors(rp, plan, w)
            _inputs(rp, plan, w)
            for part in plan.parts:
                _add_part(rp, part, part.runtime(w))
        _drop_unused_layouts(rp, w)
        return rp


def keeps_all(pred, n: int, info: dict | None = None) -> bool:
    """Whether ``pred`` keeps all ``n`` neurons / heads for every input (see the module doc)."""
    rule = getattr(pred, "rule", "topk")
    gt = getattr(pred, "gate_threshold", lambda: None)()
    if gt is not None:
        return float(gt[3]) < 0
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
    gt = p.gate_threshold() if p.input_kind == "ffn_in" else None
    if gt is None:
        return None
    pw, b, act, t = gt
    if plan.mlp_mode == "sequential" or act != w.act or w.act not in ACTS:
        return None
    L = w.layers[l]
    w1 = L.w_gate if w.gated else L.w_up
    if tuple(pw.shape) != tuple(w1.shape):
        return None
    w1 = cpu_quant.dequantize(w1) if isinstance(w1, QuantWeight) else w1     # GGUF blocks: their exact values
    if not torch.equal(pw.to(w1.device, w1.dtype), w1):
        return None
    if b is not None:
        if w.gated:
            return None
        b = b.to(device=w.device, dtype=w.dtype).contiguous()
    return float(t), b


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
        norms = layer_column_norms(w, l) if wina else None

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

        attn, ffn = input_groups(w, l, per, group)
        if attn:
            rp.in_attn[l] = attn
        if ffn:
            rp.in_ffn[l] = ffn


def input_groups(w: ModelWeights, l: int, per: dict, group) -> tuple[dict, dict]:
    """Layer ``l``'s input-sparse groups ({group: entry}, attention's and the FFN's) for the projections in ``per``
    (QKV, O, gate|up or fc1, down), each made by ``group(names, n_in, sizes)``, and the Wᵀ layouts they read."""
    L = w.layers[l]

    def add(names):
        return group(names, in_features(w.dims, names[0]), out_sizes(w.dims, names))

    attn = {}
    if set(per) & {"q", "k", "v"}:
        qkv_t(L)
        attn["qkv"] = add(("q", "k", "v"))
    if "o" in per:
        if w.quantized:
            _layout(L, "o_t", None, L.w_o_t)
        attn["o"] = add(("o",))
    ffn = {}
    if w.gated and set(per) & {"gate", "up"}:
        gu_t(L)
        ffn["gu"] = add(("gate", "up"))
    elif not w.gated and "up" in per:
        _layout(L, "up_t", lambda: L.w_up.t().contiguous(), L.w_up)
        ffn["up"] = add(("up",))
    if "down" in per:
        if w.quantized:
            _layout(L, "down_t", None, L.w_down_t)
        ffn["down"] = add(("down",))
    return attn, ffn


def _add_part(rp: RuntimePlan, part, pr: PartRuntime) -> None:
    """A part's runtime form into the plan: its layers carry no other sparse part."""
    taken = (set(rp.heads) | set(rp.mlp) | set(rp.in_attn) | set(rp.in_ffn) | set(rp.attn_fn) | set(rp.ffn_fn)
             | set(rp.inputs))
    both = sorted(pr.layers() & taken)
    if both:
        raise ValueError(f"layer {both[0]}: a {part.label} plan carries no other sparse part on the same layer")
    rp.parts[part.kind] = pr
    rp.attn_fn.update(pr.attn)
    rp.ffn_fn.update(pr.ffn)
    rp.in_attn.update(pr.in_attn)
    rp.in_ffn.update(pr.in_ffn)
    rp.inputs.update(pr.inputs)
    rp.extra_numel += pr.extra_numel
    if pr.head is not None:
        if rp.head is not None:
            raise ValueError(f"a {part.label} plan's output head beside another part's")
        rp.head = pr.head


def in_features(dims, p: str) -> int:
    """Projection ``p``'s input size (PROJ's names)."""
    return {"o": dims.n_heads * dims.head_dim, "down": dims.D}.get(p, dims.d)


def out_sizes(dims, names) -> tuple[int, ...]:
    """The output size of each projection of ``names`` (PROJ's names): a fused product's segments."""
    out = {"q": dims.n_heads * dims.head_dim, "k": dims.n_kv_heads * dims.head_dim,
           "v": dims.n_kv_heads * dims.head_dim, "o": dims.d, "down": dims.d}
    return tuple(out.get(p, dims.D) for p in names)


def _layout(L, key: str, make, *weights) -> None:
    """Layer ``L``'s Wᵀ layout ``key`` (input sparsity; over GGUF blocks output sparsity's O / down too), made
    once: ``make()`` over float weights; over GGUF blocks (quantized ``weights``: W [out, in] each) their exact
    transposed blocks, part by part (kernels.cpu_quant.TransposedParts; O and down too, whose slots hold W itself
    then)."""
    if key not in L.layouts:
        quant = isinstance(weights[0], QuantWeight)
        L.layouts[key] = cpu_quant.TransposedParts.of(*weights) if quant else make()


def qkv_t(L) -> None:
    """QKV's Wᵀ (one copy for q, k and v, which read one input)."""
    _layout(L, "qkv_t", lambda: L.w_qkv.t().contiguous(), L.w_qkv)


def gu_t(L) -> None:
    """gate|up's Wᵀ (one copy for both, which read one input)."""
    _layout(L, "gu_t", lambda: torch.cat([L.w_gate, L.w_up], 0).t().contiguous(), L.w_gate, L.w_up)


def layer_column_norms(w: ModelWeights, l: int) -> dict[str, torch.Tensor]:
    """‖W[:, i]‖₂ of layer ``l``'s projections (the WINA scores' weights; weights.column_norms)."""
    d = w.dims
    return column_norms(w.layers[l], w.q_fold, d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim)


def _drop_unused_layouts(rp: RuntimePlan, w: ModelWeights) -> None:
    for l, L in enumerate(w.layers):
        attn, ffn = rp.in_attn.get(l, {}), rp.in_ffn.get(l, {})
        out_sparse = w.quantized      # output sparsity over GGUF blocks reads W_oᵀ / W_downᵀ rows of the active set
        used = {GROUP_LAYOUTS[g] for g in (*attn, *ffn)}
        used |= {key for pr in rp.parts.values() for key in pr.layouts.get(l, ())}
        used |= {"o_t"} if out_sparse and l in rp.heads else set()
        used |= {"down_t"} if out_sparse and l in rp.mlp else set()
        for key in set(GROUP_LAYOUTS.values()) - used:
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
