"""Sparse execution on a Hugging Face model: ``apply_sparsity(model, plan)`` and its ``revert``.

Modules are swapped, never ``forward`` patched:
  * the FFN module of each planned layer (``mlp``; for OPT, whose FFN is inline in the layer, ``fc1`` and the
    activation become identities and ``fc2`` becomes the sparse FFN) -> :class:`SparseFFN`, which asks the
    layer's predictor for each token's neuron set and computes only those rows
    (:func:`kernels.token_sparse.token_sparse_ffn`: sampled products, no dense product masked afterwards);
  * the attention output projection of each layer with a head predictor -> :class:`TokenSparseHeadOut`, which
    projects only each token's active heads.
``mode="masked"`` computes the same functions as dense products with the unselected entries zeroed (same
selection and statistics, equal up to summation order). For evaluation forwards (many tokens, a different set per
token) it is the faster path on every device measured: on a CPU the token-sparse products cost more than dense,
and on an H200 they cost 1.3-1.4x the masked product over a suite, up to 2x in generation (SDDMM and CSR products
at 50 % density do not beat a dense GEMM, and their ``nonzero`` syncs with the host every layer; BENCHMARKS.md).
``apply_sparsity``'s default ``"auto"`` is therefore ``masked`` everywhere; ``kernel`` stays for checking that the
skipped work really is skippable (tests compare the two), and ``AppliedSparsity.mode`` records which path produced
the numbers. Decode latency, where the work is really skipped, is the decode runtime's (``workers.decode``).
Predictor inputs other than the FFN's own input (``residual``, ``lookahead``) come from forward pre-hooks on
the decoder layers that keep the last hidden state entering each layer (removed again by ``revert``).

Attention heads skipped for a token: their query/output are not used, but **K and V are computed for every
head and every token** (the KV cache stays exact). A later token that keeps a head therefore attends to the
true keys/values of every earlier token, whether or not that earlier token used the head. This is the
semantics of Deja Vu's "keep the hidden state, compute K/V when needed" without the bookkeeping; the decode
runtime accounts for the K/V cost in its latency rows.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.token_sparse import masked_token_ffn, token_sparse_ffn, token_sparse_head_out
from workers.loading.adapters import adapter_for, get_path, linear_weight
from workers.sparsity.input_sparse import (
    InputStats, apply_input_sparsity, check_plan_parts, decoder_weight_skipped, model_projection_numel,
)
from workers.sparsity.predictors.base import HeadPredictor, MLPPredictor, SparsityPlan, layer_out_norms
from workers.sparsity.swaps import ModuleSwaps


@dataclass
class LayerStats:
    """Counts of one layer. ``add_ffn`` / ``add_heads`` take the pair counts as numbers or as tensors on the
    model's device; tensors are summed there and read back when a count is first read (one copy per layer then,
    not one host sync per forward)."""
    tokens: int = 0
    head_tokens: int = 0
    _first: "int | torch.Tensor" = 0    # (token, neuron) pairs computed in the first projection (gate / fc1)
    _kept: "int | torch.Tensor" = 0     # pairs computed in down (and in up, but with the damage filter)
    _heads: "int | torch.Tensor" = 0    # (token, head) pairs kept

    def add_ffn(self, tokens: int, first: "int | torch.Tensor", kept: "int | torch.Tensor") -> None:
        self.tokens += tokens
        self._first = self._first + first
        self._kept = self._kept + kept

    def add_heads(self, tokens: int, kept: "int | torch.Tensor") -> None:
        self.head_tokens += tokens
        self._heads = self._heads + kept

    @property
    def first_pairs(self) -> int:
        self._first = int(self._first)    # a device tensor is read back here, once
        return self._first

    @property
    def kept_pairs(self) -> int:
        self._kept = int(self._kept)    # a device tensor is read back here, once
        return self._kept

    @property
    def heads_kept(self) -> int:
        self._heads = int(self._heads)    # a device tensor is read back here, once
        return self._heads


@dataclass
class SparseStats:
    n_neurons: int
    n_heads: int
    dense_first: bool                       # the method runs the gate projection dense (threshold, oracle)
    up_on_first: bool = False               # up runs on the first projection's pairs (the damage filter)
    layers: dict[int, LayerStats] = field(default_factory=dict)
    inputs: InputStats = field(default_factory=InputStats)   # input-sparse projections (TEAL, WINA)
    predictor_numel: int = 0                # weights of the plan's own predictors, read for every token
    extra_numel: int = 0                    # other weights every token reads: rotations, low-rank factors
    # parts' own measurement rows (the predicted head's argmax kept, mass, reads): callables -> [row dicts]
    reporters: list = field(default_factory=list)

    def predictor_frac_ffn(self) -> float:
        """The predictors' weights as a fraction of the FFN weights of the layers that have an FFN predictor."""
        ffn = sum(n for (l, p), n in self.inputs.numel.items() if p in ("gate", "up", "down") and l in self.layers)
        return self.predictor_numel / ffn if ffn else 0.0

    def reset(self) -> None:
        self.layers.clear()
        self.inputs.reset()

    @property
    def counting(self) -> bool:
        """Whether the swapped modules count what they keep (``InputStats.counting``; one switch for every part)."""
        return self.inputs.counting

    @counting.setter
    def counting(self, on: bool) -> None:
        self.inputs.counting = bool(on)

    def input_sparsity(self, proj: str | None = None) -> float:
        """Realized fraction of projection inputs dropped (input sparsity), over the input-sparse projections."""
        return self.inputs.sparsity(proj)

    def weight_skipped(self) -> float:
        """Fraction of the decoder's projection weights not read per token (every kind of plan part), net of the
        predictors' own weights (counted as read: a predictor that reads more than it saves is negative)."""
        return decoder_weight_skipped(self)

    def all_weight_skipped(self, model: nn.Module) -> float:
        """Fraction of every weight a token reads (the decoder's projections and the output head) not read: the
        decoder's ``weight_skipped`` and a predicted head's reads (its ``read``: screen and candidate rows)."""
        total = self.inputs.total_numel()
        head = model.get_output_embeddings()
        full = head.weight.numel()
        read = getattr(head, "read", full)
        return (self.weight_skipped() * total + full - read) / (total + full)

    def mlp_sparsity(self, layer: int | None = None) -> float:
        """Realized FFN sparsity: fraction of (token, neuron) pairs not computed in up/down."""
        ls = [self.layers[layer]] if layer is not None else [v for v in self.layers.values() if v.tokens]
        tot = sum(v.tokens for v in ls) * self.n_neurons
        return 1.0 - sum(v.kept_pairs for v in ls) / tot if tot else 0.0

    def gate_sparsity(self) -> float:
        if self.dense_first:
            return 0.0
        ls = [v for v in self.layers.values() if v.tokens]
        tot = sum(v.tokens for v in ls) * self.n_neurons
        return 1.0 - sum(v.first_pairs for v in ls) / tot if tot else 0.0

    def head_sparsity(self) -> float:
        ls = [v for v in self.layers.values() if v.head_tokens]
        tot = sum(v.head_tokens for v in ls) * self.n_heads
        return 1.0 - sum(v.heads_kept for v in ls) / tot if tot else 0.0


class _Taps:
    """Last hidden state entering each decoder layer, kept by forward pre-hooks."""

    def __init__(self):
        self.inputs: dict[int, torch.Tensor] = {}

    def hook(self, layer: int):
        def pre(module, args, kwargs):
            self.inputs[layer] = args[0] if args else kwargs["hidden_states"]
        return pre

    def get(self, layer: int, input_kind: str) -> torch.Tensor:
        if input_kind not in ("residual", "lookahead"):
            raise ValueError(f"no tapped input for input kind {input_kind!r}")
        return self.inputs[layer if input_kind == "residual" else max(layer - 1, 0)]


EXEC_MODES = ("kernel", "masked")


class SparseFFN(nn.Module):
    def __init__(self, layer: int, weights: dict[str, torch.Tensor], act: str, predictor: MLPPredictor,
                 filter_threshold: float | None, taps: _Taps, stats: SparseStats, mode: str = "kernel",
                 filter_weight: torch.Tensor | None = None):
        super().__init__()
        self.mode = mode
        self.layer, self.act, self.predictor = layer, act, predictor
        self.filter_threshold, self.filter_weight = filter_threshold, filter_weight
        self._taps, self._stats = taps, stats
        self.w_gate = weights.get("gate")
        self.w_up = weights["up"]
        self.register_buffer("w_down_t", weights["down"].t().contiguous(), persistent=False)
        self.b_up, self.b_down = weights.get("b_up"), weights.get("b_down")
        # masked, a predictor whose scores are this FFN's own activations selects from them (computed anyway)
        self._from_ffn = (mode == "masked" and predictor.input_kind == "ffn_in" and predictor.reads_ffn
                          and predictor.same_ffn(weights))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        pred = self.predictor
        kind = pred.input_kind
        if self._from_ffn and pred.reads_ffn:       # (reads_ffn again: a benchmark may switch it off for a run)
            mask = lambda a, h: pred.select(pred.scores_from_ffn(a, h))     # from the FFN's own activations
        else:
            pin = x2 if kind == "ffn_in" else self._taps.get(self.layer, kind).reshape(-1, shape[-1])
            mask = pred.mask(pin)
        count = self._stats.counting
        ffn = functools.partial(masked_token_ffn, count=count) if self.mode == "masked" else token_sparse_ffn
        y, n_first, n_kept = ffn(x2, self.w_up, self.w_down_t, mask, self.act, w_gate=self.w_gate,
                                 b_up=self.b_up, b_down=self.b_down, filter_threshold=self.filter_threshold,
                                 filter_weight=self.filter_weight)
        if count:
            self._stats.layers.setdefault(self.layer, LayerStats()).add_ffn(x2.shape[0], n_first, n_kept)
        return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)


class TokenSparseHeadOut(nn.Module):
    def __init__(self, layer: int, orig: nn.Module, predictor: HeadPredictor, head_dim: int, taps: _Taps,
                 stats: SparseStats, mode: str = "kernel"):
        super().__init__()
        self.mode = mode
        self.layer, self.predictor, self.head_dim = layer, predictor, head_dim
        self.orig = orig                      # kept so revert and state_dict see the same parameters
        self._taps, self._stats = taps, stats

    def forward(self, attn: torch.Tensor) -> torch.Tensor:
        shape = attn.shape
        a2 = attn.reshape(-1, shape[-1])
        kind = self.predictor.input_kind
        if kind == "head_out":
            pin = a2
        else:
            res = self._taps.get(self.layer, kind)
            pin = res.reshape(-1, res.shape[-1])
        mask = self.predictor.mask(pin)
        if self.mode == "masked":
            y = self.orig(a2 * mask.repeat_interleave(self.head_dim, dim=1).to(a2.dtype))
        else:
            y = token_sparse_head_out(a2, linear_weight(self.orig), mask, self.head_dim,
                                      getattr(self.orig, "bias", None))
        if self._stats.counting:
            self._stats.layers.setdefault(self.layer, LayerStats()).add_heads(a2.shape[0], mask.sum())
        return y.reshape(*shape[:-1], y.shape[-1]).to(attn.dtype)


@dataclass
class AppliedSparsity(ModuleSwaps):
    """The modules and hooks :func:`apply_sparsity` put on a model (``revert()`` or ``with`` restores it) and the
    counters they add to."""
    model: nn.Module
    stats: SparseStats
    mode: str = "kernel"                            # how the FFN / head parts ran: "kernel" or "masked"

    def __post_init__(self):
        ModuleSwaps.__init__(self)


def check_alone(plan: SparsityPlan) -> None:
    """A part that runs alone (LaRoSA's, R-Sparse's) has no predictors, input thresholds or other decoder part
    beside it; a part that changes no decoder layer (the predicted head) runs beside any."""
    decoder_parts = [p for p in plan.parts if p.decoder]
    for part in decoder_parts:
        if part.alone and (plan.mlp or plan.attn or plan.inputs or len(decoder_parts) > 1):
            raise ValueError(f"a {part.label} plan carries no other decoder part (predictors, input thresholds, "
                             "other parts) beside it")


def apply_sparsity(model: nn.Module, plan: SparsityPlan, input_mode: str = "masked",
                   mode: str = "auto") -> AppliedSparsity:
    """Swap in sparse modules for every layer in ``plan``; ``.revert()`` (or ``with``) restores the model.

    ``mode`` for the FFN and head parts: ``kernel`` (only the selected entries computed, kernels.token_sparse),
    ``masked`` (dense products, unselected entries zeroed: same numbers up to summation order) or ``auto``
    (masked: the faster of the two for evaluation on every device measured, see the module's docstring); the
    result's ``mode`` says which ran.

    ``plan.inputs`` (input sparsity) swaps projections for ``input_sparse.InputSparseLinear`` in ``input_mode``
    (``masked`` for accuracy runs, ``kernel`` to skip the work). ``plan.parts`` (workers.sparsity.parts: LaRoSA's
    rotations, R-Sparse's low-rank factors) run their masked form whatever the modes, what they read beside the
    projections counted in ``stats.extra_numel``."""
    check_plan_parts(plan)
    check_alone(plan)
    ad = adapter_for(model)
    dims = ad.dims(model.config)
    act = ad.act_name(model.config)
    layers = ad.decoder_layers(model)
    damage_filter = plan.mlp_mode == "sequential" and plan.seq_filter_on == "damage"
    if damage_filter and plan.mlp and not ad.ffn.gated:
        raise ValueError("the damage filter (seq_filter_on='damage') needs a gated FFN: this model's has no gate")
    stats = SparseStats(dims.D, dims.n_heads, plan.dense_gate, inputs=InputStats(model_projection_numel(model)),
                        up_on_first=damage_filter)
    if mode == "auto":
        mode = "masked"
    if mode not in EXEC_MODES:
        raise ValueError(f"mode must be 'auto' or one of {EXEC_MODES}, got {mode!r}")
    stats.predictor_numel = sum(t.numel() for p in [*plan.mlp.values(), *plan.attn.values()]
                                for t in p.to_tensors().values())
    applied = AppliedSparsity(model, stats, mode)
    taps = _Taps()
    need_taps = {p.input_kind for p in [*plan.mlp.values(), *plan.attn.values()]} & {"residual", "lookahead"}
    try:
        if need_taps:
            for i, layer in enumerate(layers):
                applied.hook(layer.register_forward_pre_hook(taps.hook(i), with_kwargs=True))
        for l, pred in plan.mlp.items():
            layer = layers[l]
            weights = ad.ffn_weights(layer)
            thr = plan.seq_filter.get(l) if plan.mlp_mode == "sequential" else None
            fw = layer_out_norms(ad, layer) if damage_filter else None
            sparse = SparseFFN(l, weights, act, pred, thr, taps, stats, mode, fw)
            if ad.ffn.module:
                applied.swap(layer, ad.ffn.module, sparse)
            else:  # FFN inline in the layer (OPT): fc1 and act become identities, fc2 the whole sparse FFN
                applied.swap(layer, ad.ffn.up, nn.Identity())
                applied.swap(layer, ad.ffn.inline_act, nn.Identity())
                applied.swap(layer, ad.ffn.down, sparse)
        for l, pred in plan.attn.items():
            attn = ad.attn_module(layers[l])
            orig = get_path(attn, ad.attn.o)
            applied.swap(attn, ad.attn.o, TokenSparseHeadOut(l, orig, pred, dims.head_dim, taps, stats, mode))
        if plan.inputs:
            apply_input_sparsity(model, plan.inputs, plan.input_score, input_mode, stats.inputs, swaps=applied)
        for part in plan.parts:
            stats.extra_numel += part.apply_masked(model, stats.inputs, applied)
    except Exception:
        applied.revert()
        raise
    return applied

