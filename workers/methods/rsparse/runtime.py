"""R-Sparse's runtime form: a :class:`~workers.methods.rsparse.part.RankSparsePlan` compiled for the decode
runtime's weights (float or a GGUF's blocks): each projection's input threshold in the input-sparse groups of
workers.decode.plan (QKV, O, gate|up, down), and beside a group's input-sparse product the low-rank term of each
projection with factors, on the inputs its threshold drops.

    pr = compile_plan(plan, w)        # workers.decode.plan.PartRuntime

A block with low-rank terms runs :func:`attn` / :func:`ffn` (the layer's callables); a block without any (every
rank 0: TEAL's product) runs as plain input sparsity, so the fused and native layers take it as they take TEAL's.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from workers.decode.plan import GROUP_LAYOUTS, InputGroup, PartRuntime, input_groups, layer_column_norms
from workers.decode.weights import PROJ, ModelWeights


class LowRankTerm(NamedTuple):
    """A projection's term on the inputs its threshold drops: y[:, lo:hi] += ((x ⊙ dropped) aᵀ) bᵀ; ``j`` its row
    of the group's thresholds."""
    j: int
    lo: int
    hi: int
    a: torch.Tensor                 # Σ_r V_rᵀ [r, in]
    b: torch.Tensor                 # U_r [out, r]


class LowRankGroup(NamedTuple):
    """An input-sparse group (plan.InputGroup) and the low-rank terms of its projections with factors."""
    group: InputGroup
    terms: tuple[LowRankTerm, ...]


def compile_plan(plan, w: ModelWeights) -> PartRuntime:
    """Per layer, the input thresholds in the groups of workers.decode.plan (one per projection; per input channel
    where a part scores |x_i|·‖W[:, i]‖) and each part's factors as a :class:`LowRankTerm` of its group."""
    if not w.gated:
        raise ValueError("rank-sparse plans run on gated FFNs in the decode runtime")
    out = PartRuntime()
    for l, per in plan.parts.items():
        l = int(l)
        if not 0 <= l < len(w.layers):
            raise ValueError(f"rank-sparse plan for layer {l}, model has {len(w.layers)}")
        bad = set(per) - set(PROJ)
        if bad:
            raise ValueError(f"layer {l}: rank-sparse parts on {sorted(bad)}: not projections of this model")
        per = {p: part for p, part in per.items() if part.threshold >= 0}
        if not per:
            continue
        out.inputs[l] = {p: float(part.threshold) for p, part in per.items()}
        out.extra_numel += sum(part.numel() for part in per.values())
        attn_groups, ffn_groups = input_groups(w, l, per, _group_maker(w, l, per))
        _route(out, l, attn_groups, attn, out.attn, out.in_attn)
        _route(out, l, ffn_groups, ffn, out.ffn, out.in_ffn)
    return out


def _route(out: PartRuntime, l: int, groups: dict, fn, fns: dict, plain: dict) -> None:
    """A block with low-rank terms runs ``fn`` over its groups; one without (every rank 0) runs as TEAL's groups,
    the runtime's own input-sparse path."""
    if any(ent.terms for ent in groups.values()):
        fns[l] = functools.partial(fn, groups=groups)
        out.layouts.setdefault(l, set()).update(GROUP_LAYOUTS[g] for g in groups)
    elif groups:
        plain[l] = {g: ent.group for g, ent in groups.items()}


def _group_maker(w: ModelWeights, l: int, per: dict):
    """``group(names, n_in, sizes)`` for plan.input_groups: the projections' thresholds and low-rank terms."""
    dev = w.device
    fdt = torch.float32 if w.quantized else w.dtype
    norms = layer_column_norms(w, l) if any(pt.score == "wina" for pt in per.values()) else None

    def group(names, n_in, sizes) -> LowRankGroup:
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
        return LowRankGroup(InputGroup.of(thr, sizes, names), tuple(terms))

    return group


# ---------------------------------------------------------------- the step's paths (workers.decode.layer.Step)
def attn(step, l, L, h, groups: dict):
    """The attention with input sparsity and low-rank terms on QKV and / or O."""
    b = step.b
    qkv = _linear(step, l, h, L.w_qkv_t, groups["qkv"], L.b_qkv) if "qkv" in groups else b.linear(h, L.w_qkv, L.b_qkv)
    a = step.attend(l, L, qkv)
    if "o" in groups:
        return _linear(step, l, a, L.w_o_in, groups["o"], L.b_o)
    return b.out_dense(L, a)


def ffn(step, l, L, h, groups: dict):
    """The gated FFN with input sparsity and low-rank terms on gate|up and / or down."""
    b, w = step.b, step.b.w
    gu = _linear(step, l, h, L.w_gu_t, groups["gu"], None) if "gu" in groups else b.linear(h, L.gu())
    a = step.fns["act_mul"](gu, w.act)
    if "down" in groups:
        return _linear(step, l, a, L.w_down_in, groups["down"], L.b_down)
    return b.linear_t(a, L.w_down_t, L.b_down)


def _linear(step, l, x, w_t, ent: LowRankGroup, bias):
    y = step.b.in_linear(x, w_t, ent.group, ent.group.counts(step.c.inputs[l]), bias)
    return low_rank_terms(x, y, ent)


def low_rank_terms(x, y, ent: LowRankGroup):
    """y plus the group's terms on the inputs its thresholds drop: per projection with factors,
    y[:, lo:hi] += ((x ⊙ dropped) aᵀ) bᵀ (the kernels keep |x_i| > t_i)."""
    thr = ent.group.thresholds
    for term in ent.terms:
        t = thr[term.j]
        small = torch.where(x.abs() > t.to(x.dtype), torch.zeros((), dtype=x.dtype, device=x.device), x)
        z = small.to(term.a.dtype) @ term.a.t()
        y[:, term.lo: term.hi] += (z @ term.b.t()).to(y.dtype)
    return y
