"""Input sparsity on a Hugging Face model: each projection drops the small entries of its *input*.

``apply_input_sparsity(model, thresholds, score)`` swaps every planned projection (q, k, v, o, gate, up, down;
``qkv`` for GPT-2's fused c_attn) for an :class:`InputSparseLinear`; ``.revert()`` puts the originals back.
For a token x entering projection W ([out, in]), input i is kept iff

    score_i > t      with score_i = |x_i|                 (TEAL)
                          score_i = |x_i| · ‖W[:, i]‖₂     (WINA)

and the product uses only the kept columns of W: one decode step reads (1 - s) of the projection's weights.
Modes:
  ``masked``  zero the dropped inputs, then the original module (``F.linear``): the same numbers as the
              kernel up to summation order; what accuracy runs use (fast on any device at any batch).
  ``kernel``  ``kernels.ops.input_sparse_linear(x, Wᵀ, t)`` on a contiguous Wᵀ (each input's column of W
              is one contiguous row): the path that skips the work. WINA's per-column score is folded in
              exactly: x' = x ⊙ n, W'ᵀ = diag(1/n) Wᵀ, so |x'_i| > t is the WINA rule and x' W'ᵀ = x Wᵀ.
              The kernel is a decode kernel (at most ``kernels.common.MAX_BATCH`` tokens, whose union of kept
              inputs it reads); a call with more tokens (prefill, an evaluation window, where every token keeps
              its own inputs and the union covers nearly all of W) runs the masked product instead.
The realized input sparsity of every projection is counted in :class:`InputStats`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.common import MAX_BATCH
from workers.loading.adapters import adapter_for, get_path, linear_weight
from workers.sparsity.swaps import ModuleSwaps

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down", "qkv")
ATTN_PROJECTIONS = ("q", "k", "v", "o", "qkv")
FFN_PROJECTIONS = ("gate", "up", "down")
SHARED_INPUT = {"k": "q", "v": "q", "up": "gate"}   # projections that read the same tensor as another
SCORES = ("abs", "wina")
MODES = ("masked", "kernel")


def projection_paths(ad) -> dict[str, str]:
    """Each projection of a decoder layer -> its attribute path from the layer (``self_attn.q_proj``)."""
    a, f = ad.attn, ad.ffn
    pa = f"{a.module}." if a.module else ""
    pf = f"{f.module}." if f.module else ""
    out = {"qkv": pa + a.qkv_fused} if a.qkv_fused else {"q": pa + a.q, "k": pa + a.k, "v": pa + a.v}
    out["o"] = pa + a.o
    if f.gated:
        out["gate"] = pf + f.gate
    out["up"] = pf + f.up
    out["down"] = pf + f.down
    return out


def projection_modules(ad, layer: nn.Module) -> dict[str, nn.Module]:
    return {p: get_path(layer, path) for p, path in projection_paths(ad).items()}


def column_norms(module: nn.Module) -> torch.Tensor:
    """‖W[:, i]‖₂ for every input i of a projection (float32, [in])."""
    return linear_weight(module).detach().float().norm(dim=0)


def input_score(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The magnitude score of each input entry: |x| (TEAL) or |x| · column norm (WINA, ``scale`` = norms)."""
    a = x.abs()
    return a if scale is None else a * scale.to(a.dtype)


@dataclass
class InputStats:
    """Per (layer, projection): weight elements, and (token, input) entries seen / kept.

    ``add`` takes the kept count as a number or as a tensor on the model's device; tensors are summed there and
    read back only when ``seen`` is read (one copy per projection then, not one host sync per forward).
    ``counting = False``: the projections count nothing (no reduction per forward), for runs whose rows do not
    report the realized sparsity (an evaluation's task units; its perplexity unit counts)."""
    numel: dict[tuple[int, str], int] = field(default_factory=dict)   # every projection of the model
    _seen: dict[tuple[int, str], list] = field(default_factory=dict)
    counting: bool = True

    @property
    def seen(self) -> dict[tuple[int, str], list[int]]:
        for v in self._seen.values():
            if isinstance(v[1], torch.Tensor):
                v[1] = int(v[1])
        return self._seen

    def reset(self) -> None:
        self._seen.clear()

    def add(self, layer: int, proj: str, n: int, kept: "int | torch.Tensor") -> None:
        if not self.counting:
            return
        s = self._seen.setdefault((layer, proj), [0, 0])
        s[0] += n
        s[1] = s[1] + kept

    def add_mask(self, layer: int, proj: str, keep: torch.Tensor) -> None:
        """``add`` of a boolean mask of the kept entries; its count is reduced only while counting."""
        if self.counting:
            self.add(layer, proj, keep.numel(), keep.sum())       # counted on the device

    def sparsity(self, proj: str | None = None, layer: int | None = None) -> float:
        """Realized fraction of (token, input) entries dropped, over the swapped projections selected."""
        rows = [v for (l, p), v in self.seen.items() if (proj is None or p == proj) and (layer is None or l == layer)]
        n = sum(v[0] for v in rows)
        return 1.0 - sum(v[1] for v in rows) / n if n else 0.0

    def per_projection(self) -> dict[str, float]:
        return {p: self.sparsity(proj=p) for p in sorted({p for _, p in self.seen})}

    def skipped_numel(self) -> float:
        """Weight elements not read per token, averaged over the tokens seen."""
        return sum((1.0 - v[1] / v[0]) * self.numel[k] for k, v in self.seen.items() if v[0])

    def total_numel(self) -> int:
        return sum(self.numel.values())


def _one_pass(x: torch.Tensor) -> bool:
    """Whether a masked input is made by one Triton pass (:mod:`kernels.input_mask_triton`, the same values bit for
    bit): float32 activations where :mod:`kernels.ops` picks Triton (CUDA, or ``CTXSPARSE_KERNELS=triton`` with
    Triton's interpreter)."""
    from kernels.ops import backend_name

    return x.dtype == torch.float32 and backend_name(x) == "triton"


class InputSparseLinear(nn.Module):
    """A projection that uses only the inputs whose score exceeds ``threshold`` (see the module doc)."""

    def __init__(self, orig: nn.Module, threshold: float, scale: torch.Tensor | None, mode: str, layer: int,
                 proj: str, stats: InputStats):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.orig = orig                       # kept so revert and state_dict see the same parameters
        self.threshold, self.mode, self.layer, self.proj = float(threshold), mode, layer, proj
        self._stats = stats
        w = linear_weight(orig).detach()
        self.register_buffer("scale", None if scale is None else scale.to(w.device, torch.float32),
                             persistent=False)
        self.register_buffer("w_t", None, persistent=False)
        if mode == "kernel":
            w_t = w.t()
            if scale is not None:   # fold WINA's column norms: (x n) (diag(1/n) Wᵀ) = x Wᵀ
                w_t = w_t / self.scale.clamp_min(1e-30).to(w.dtype)[:, None]
            self.w_t = w_t.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        masked = self.mode == "masked" or x2.shape[0] > MAX_BATCH
        if masked and not self._stats.counting and _one_pass(x):
            from kernels.input_mask_triton import masked_inputs

            return self.orig(masked_inputs(x, self.threshold, self.scale))    # abs, compare and where in one pass
        keep = input_score(x2, self.scale) > self.threshold
        self._stats.add_mask(self.layer, self.proj, keep)
        if masked:
            return self.orig(torch.where(keep.reshape(shape), x, 0))      # one kernel: no float copy of the mask
        from kernels import ops, reference

        fn = getattr(ops, "input_sparse_linear", None) or reference.input_sparse_linear
        xs = x2 if self.scale is None else x2 * self.scale.clamp_min(1e-30).to(x2.dtype)
        y = fn(xs, self.w_t, self.threshold, getattr(self.orig, "bias", None))
        return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, proj={self.proj}, threshold={self.threshold:.4g}, mode={self.mode}, " \
               f"score={'wina' if self.scale is not None else 'abs'}"


def model_projection_numel(model: nn.Module) -> dict[tuple[int, str], int]:
    ad = adapter_for(model)
    return {(l, p): linear_weight(m).numel() for l, layer in ad.iter_layers(model)
            for p, m in projection_modules(ad, layer).items()}


@dataclass
class AppliedInputSparsity(ModuleSwaps):
    """The projections :func:`apply_input_sparsity` swapped (``revert()`` or ``with`` restores them) and the
    counters they add to."""
    model: nn.Module
    stats: InputStats

    def __post_init__(self):
        ModuleSwaps.__init__(self)


def check_thresholds(model: nn.Module, thresholds: dict[int, dict[str, float]], score: str) -> None:
    ad = adapter_for(model)
    n_layers = len(ad.decoder_layers(model))
    known = set(projection_paths(ad))
    if score not in SCORES:
        raise ValueError(f"input score must be one of {SCORES}, got {score!r}")
    for l, per in thresholds.items():
        if not 0 <= int(l) < n_layers:
            raise ValueError(f"input thresholds for layer {l}, model has {n_layers}")
        bad = set(per) - known
        if bad:
            raise ValueError(f"layer {l}: projections {sorted(bad)} not in this model ({sorted(known)})")


def apply_input_sparsity(model: nn.Module, thresholds: dict[int, dict[str, float]], score: str = "abs",
                         mode: str = "masked", stats: InputStats | None = None,
                         swaps: ModuleSwaps | None = None) -> AppliedInputSparsity:
    """Swap the planned projections for :class:`InputSparseLinear`; ``.revert()`` restores the model.

    ``thresholds``: {layer: {projection: t}}. ``swaps``: record the swaps there instead (a caller that reverts
    several kinds of swap together, e.g. ``sparse_exec.apply_sparsity``); on an error they are reverted."""
    check_thresholds(model, thresholds, score)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    ad = adapter_for(model)
    layers = ad.decoder_layers(model)
    paths = projection_paths(ad)
    stats = stats if stats is not None else InputStats(model_projection_numel(model))
    applied = AppliedInputSparsity(model, stats)
    log = swaps if swaps is not None else applied
    try:
        for l, per in sorted(thresholds.items()):
            layer = layers[int(l)]
            for p, t in sorted(per.items()):
                orig = get_path(layer, paths[p])
                if not (isinstance(orig, nn.Linear) or type(orig).__name__ == "Conv1D"):
                    raise ValueError(f"layer {l} {p}: {type(orig).__name__} is not a plain projection "
                                     "(already swapped by another plan part?)")
                scale = column_norms(orig) if score == "wina" else None
                log.swap(layer, paths[p], InputSparseLinear(orig, t, scale, mode, int(l), p, stats))
    except Exception:
        log.revert()
        raise
    return applied


def decoder_weight_skipped(stats) -> float:
    """Fraction of the decoder's projection weights (q, k, v, o, gate, up, down of every layer) not read per
    token, from a ``sparse_exec.SparseStats``: input-sparse projections, the FFN rows a neuron predictor
    skipped (gate or fc1 on the first pass, up and down on the kept set; up on the first pass where
    ``stats.up_on_first``, the damage filter) and the heads skipped in o, less the
    predictors' own weights (``stats.predictor_numel``), which every token reads, and any other weights every
    token reads beside the model's (``stats.extra_numel``: rotations, adapters, low-rank factors)."""
    inp: InputStats = stats.inputs
    skipped = inp.skipped_numel()
    for l, ls in stats.layers.items():
        first = "gate" if (l, "gate") in inp.numel else "up"
        if ls.tokens:
            tot = ls.tokens * stats.n_neurons
            kept_frac = ls.kept_pairs / tot
            first_frac = 1.0 if stats.dense_first else ls.first_pairs / tot
            up_first = first == "gate" and stats.up_on_first
            on_first, rest = ((first, "up"), ("down",)) if up_first else \
                ((first,), ("up", "down") if first == "gate" else ("down",))
            skipped += (1 - first_frac) * sum(inp.numel[(l, p)] for p in on_first)
            skipped += (1 - kept_frac) * sum(inp.numel[(l, p)] for p in rest)
        if ls.head_tokens:
            skipped += (1 - ls.heads_kept / (ls.head_tokens * stats.n_heads)) * inp.numel[(l, "o")]
    skipped -= getattr(stats, "predictor_numel", 0) + getattr(stats, "extra_numel", 0)
    total = inp.total_numel()
    return skipped / total if total else 0.0


def check_plan_parts(plan) -> None:
    """A projection is either input-sparse or part of a predicted FFN / head set, never both."""
    for l, per in plan.inputs.items():
        if l in plan.mlp and set(per) & {"gate", "up", "down"}:
            raise ValueError(f"layer {l}: input sparsity on {sorted(set(per) & set(FFN_PROJECTIONS))} and a "
                             "neuron predictor on the same FFN")
        if l in plan.attn and "o" in per:
            raise ValueError(f"layer {l}: input sparsity on o and a head predictor on the same projection")
