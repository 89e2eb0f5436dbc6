"""What every sparsity predictor is, and the registry a sweep names methods from.

A method fits, per decoder layer, an :class:`MLPPredictor` (which FFN neurons a token needs) and optionally a
:class:`HeadPredictor` (which attention heads a token needs), from calibration activations
(:class:`workers.sparsity.capture.ActivationCache`). The result is a :class:`SparsityPlan`, which
:func:`workers.sparsity.sparse_exec.apply_sparsity` puts on a model and which a bundle stores (tensors in safetensors,
config in JSON: every predictor round-trips through ``to_tensors`` / ``config`` / ``from_parts``).

Predictor inputs (``input_kind``), all recorded by activation capture:
  ``ffn_in``    the FFN input of the same layer (after attention and the norm)           -- same-layer
  ``residual``  the residual stream entering the same layer (before attention)             -- Deja Vu's MLP input
  ``lookahead`` the residual stream entering the *previous* layer (layer l's set from l-1) -- overlappable

Selection rules (``rule``):
  ``topk``      keep the ``k`` highest scores per token (Deja Vu; oracle; static)
  ``positive``  keep neurons whose score is > 0 (SVDP: score = B A x + b with a calibrated bias b;
                threshold methods: score = |a| - t)
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu as cpu_kernels

INPUT_KINDS = ("ffn_in", "residual", "lookahead")
# head predictors run before their layer's attention, so the FFN input (computed after it) cannot feed them;
# the attention oracle ranks heads by their true output norms: its input is every head's output ([T, H*hd])
HEAD_INPUT_KINDS = ("residual", "lookahead", "head_out")
RULES = ("topk", "positive")


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ wᵀ, a predictor's GEMV. For a few fp32 CPU tokens outside autograd (the decode step) this is the CPU
    row kernel, which reads the weights about twice as fast as MKL's GEMV (a rank-256 SmolLM2 predictor, every
    layer its own weights, one thread: 160 vs 303 µs per layer); everywhere else ``F.linear``."""
    if x.dim() == 2 and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return cpu_kernels.linear(x, w)       # itself F.linear where its kernel does not run
    return F.linear(x, w)


def same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Both None, or views of the same memory with the same layout and dtype (the same values, without comparing
    them)."""
    if a is None or b is None:
        return a is None and b is None
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


def topk_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """bool [T, n]: each row's ``k`` largest values (unsorted top-k: the set is all a mask needs). Float32 scores
    on a Triton device (CUDA) take one pass (:mod:`kernels.topk_mask_triton`): the same set wherever a row's k-th
    largest value is unique, the lowest columns of a tie (``torch.topk`` names none)."""
    from kernels.ops import backend_name

    if k and values.dim() == 2 and values.dtype == torch.float32 and backend_name(values) == "triton":
        from kernels.topk_mask_triton import MAX_N, topk_mask as one_pass

        if values.shape[1] <= MAX_N:
            return one_pass(values, k)
    return torch_topk_mask(values, k)


def torch_topk_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """``topk_mask`` in eager PyTorch: an unsorted ``torch.topk`` and a scatter of its indices into a zeroed mask."""
    m = torch.zeros_like(values, dtype=torch.bool)
    if k:
        m.scatter_(1, values.topk(k, dim=1, sorted=False).indices, True)
    return m


class MLPPredictor(nn.Module):
    """Scores FFN neurons per token; ``mask(x)`` is the selected set. Subclasses define ``scores``."""

    method: str = "base"

    def __init__(self, input_kind: str = "ffn_in", rule: str = "topk", k: int | None = None, n_neurons: int = 0):
        super().__init__()
        if input_kind not in INPUT_KINDS:
            raise ValueError(f"input_kind must be one of {INPUT_KINDS}")
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}")
        if rule == "topk" and (k is None or not 0 <= k <= n_neurons):
            raise ValueError(f"topk needs 0 <= k <= {n_neurons}, got {k}")
        self.input_kind, self.rule, self.k, self.n_neurons = input_kind, rule, k, n_neurons

    def scores(self, x: torch.Tensor) -> torch.Tensor:  # [T, d] -> [T, D]
        raise NotImplementedError

    # whether ``scores_from_ffn`` can give the scores from the layer's own FFN activations (the oracle, the
    # threshold): a masked FFN that computes those activations anyway then selects from them instead of computing
    # them again, where ``same_ffn`` says the predictor reads that very FFN's weights
    reads_ffn: bool = False

    def scores_from_ffn(self, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The scores from the FFN's activations of the same tokens: ``a`` = act(first projection), ``h`` = what
        down reads (a · up, gated; a, not gated); the same values ``scores`` computes from the FFN input."""
        raise NotImplementedError(f"{self.method}'s scores are not the FFN's own activations")

    def same_ffn(self, weights: dict[str, torch.Tensor]) -> bool:
        """Whether ``scores`` computes its activations from exactly these FFN weights (``ffn_weights`` layout:
        the same tensors, bias included), so that ``scores_from_ffn`` gives the same values."""
        return False

    def gate_threshold(self):
        """(W1, b1, act, t) where the score is |act(x W1ᵀ + b1)| − t over the FFN input (a gate threshold: the decode
        runtime then runs the first projection once and reads the kept neurons' rows only), else None."""
        return None

    @torch.no_grad()
    def mask(self, x: torch.Tensor) -> torch.Tensor:
        """[T, d] -> bool [T, D]: the neurons each token computes."""
        return self.select(self.scores(x))

    @torch.no_grad()
    def select(self, s: torch.Tensor) -> torch.Tensor:
        """The rule applied to scores [T, D]: bool [T, D]."""
        return s > 0 if self.rule == "positive" else topk_mask(s, self.k)

    # ---- serialization (bundles): tensors + JSON config, never pickle ----
    def config(self) -> dict:
        return {"method": self.method, "input_kind": self.input_kind, "rule": self.rule, "k": self.k,
                "n_neurons": self.n_neurons}

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}

    @classmethod
    def from_parts(cls, config: dict, tensors: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]):
        """Rebuild from a bundle. ``weights`` are the layer's own FFN weights (for methods that use them)."""
        raise NotImplementedError


class HeadPredictor(nn.Module):
    """Scores attention heads per token; keeps the top ``k`` heads. Subclasses define ``scores``."""

    method: str = "base"

    def __init__(self, input_kind: str, k: int, n_heads: int):
        super().__init__()
        if input_kind not in HEAD_INPUT_KINDS:
            raise ValueError(f"input_kind must be one of {HEAD_INPUT_KINDS}")
        if not 0 <= k <= n_heads:
            raise ValueError(f"need 0 <= k <= {n_heads}")
        self.input_kind, self.k, self.n_heads = input_kind, k, n_heads

    def scores(self, x: torch.Tensor) -> torch.Tensor:  # [T, d] -> [T, H]
        raise NotImplementedError

    @torch.no_grad()
    def mask(self, x: torch.Tensor) -> torch.Tensor:
        return topk_mask(self.scores(x), self.k)

    def config(self) -> dict:
        return {"method": self.method, "input_kind": self.input_kind, "k": self.k, "n_heads": self.n_heads}

    @classmethod
    def from_parts(cls, config: dict, tensors: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]):
        """Rebuild from a bundle (see MLPPredictor.from_parts)."""
        raise NotImplementedError

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}


SEQ_FILTERS = ("gate", "damage")     # what the sequential pipeline's filter reads (SparsityPlan.seq_filter_on)


@dataclass
class SparsityPlan:
    """Per-layer predictors plus how the sparse FFN runs, and per-projection input thresholds.

    ``mlp_mode``: ``parallel`` computes gate, up and down on the predicted set; ``sequential`` filters the
    predicted set with ``seq_filter[layer]`` = f, on the score ``seq_filter_on`` names:
      * ``gate``: gate on the predicted set, then the rows with |act(gate)| <= f dropped before up and down;
      * ``damage``: gate and up on the predicted set, then the rows whose damage |act(gate)·up|·c_i <= f dropped
        before down, c_i = ‖g ⊙ W_down[:, i]‖ (:func:`neuron_out_norm`: what neuron i adds to the residual stream
        per unit of its value).
    """
    mlp: dict[int, MLPPredictor] = field(default_factory=dict)
    attn: dict[int, HeadPredictor] = field(default_factory=dict)
    mlp_mode: str = "parallel"
    seq_filter: dict[int, float] = field(default_factory=dict)
    seq_filter_on: str = "gate"
    info: dict = field(default_factory=dict)     # per-layer facts for the store: targets, thresholds, fit time
    dense_gate: bool = False                     # the method runs the gate projection dense (threshold, oracle)
    # input sparsity (TEAL, WINA): {layer: {projection: t}}; a projection keeps input i iff score_i > t, with
    # score |x_i| (``input_score="abs"``) or |x_i|·‖W[:, i]‖₂ ("wina"); see workers.sparsity.input_sparse
    inputs: dict[int, dict[str, float]] = field(default_factory=dict)
    input_score: str = "abs"
    # whole methods' shares (workers.sparsity.parts.PlanPart: LaRoSA's rotations, R-Sparse's low-rank factors),
    # at most one of each kind; each carries its bundle, masked and runtime forms
    parts: list = field(default_factory=list)

    def part(self, kind: str):
        """The plan's part of ``kind`` (a registered part type's name), or None."""
        return next((p for p in self.parts if p.kind == kind), None)

    def __post_init__(self):
        self.parts = list(self.parts)
        kinds = [p.kind for p in self.parts]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"one part of each kind, got {kinds}")
        if self.mlp_mode not in ("parallel", "sequential"):
            raise ValueError("mlp_mode must be 'parallel' or 'sequential'")
        if self.seq_filter_on not in SEQ_FILTERS:
            raise ValueError(f"seq_filter_on must be one of {SEQ_FILTERS}, got {self.seq_filter_on!r}")
        if self.input_score not in ("abs", "wina"):
            raise ValueError("input_score must be 'abs' or 'wina'")


@dataclass
class FitContext:
    """What a method fits from: the model (weights, adapter, dims) and the calibration activations.

    Fitting computes on the CPU, where the activation cache is read (the weights are copied there whatever the
    model's device); ``device`` is where iterative training runs (Deja Vu's predictors: a GPU actor computes a
    layer's labels, regression start and training on its GPU), its results coming back to the CPU."""
    lm: object                    # workers.loading.models.LoadedModel
    cache: object                 # workers.sparsity.capture.ActivationCache
    layers: list[int]
    seed: int = 0
    device: str = "cpu"

    def ffn_weights(self, layer: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """``gate`` (absent for non-gated), ``up`` [D, d], ``down`` [d, D] as float32 nn.Linear-layout tensors
        on ``device`` (the CPU, where fitting computes; code that runs a predictor inside the model asks for the
        model's), plus ``b_up`` / ``b_down`` where the projections have biases (OPT, GPT-2)."""
        ad = self.lm.adapter
        layer_module = ad.decoder_layers(self.lm.model)[layer]
        return {k: v.detach().to(device, torch.float32) for k, v in ad.ffn_weights(layer_module).items()}

    def act_name(self) -> str:
        return self.lm.adapter.act_name(self.lm.model.config)

    def ffn_out_gain(self, layer: int) -> torch.Tensor | None:
        """The gain of the norm on the FFN's output (Gemma-3), None where the output goes straight to the residual."""
        ad = self.lm.adapter
        g = ad.ffn_out_gain(ad.decoder_layers(self.lm.model)[layer])
        return None if g is None else g.detach().to("cpu", torch.float32)

    def inputs(self, layer: int, input_kind: str, max_tokens: int | None = None) -> torch.Tensor:
        """The predictor input for ``layer`` from the calibration cache, [N, d] float32."""
        return predictor_inputs(self.cache, layer, input_kind, max_tokens)


def predictor_inputs(cache, layer: int, input_kind: str, max_tokens: int | None = None) -> torch.Tensor:
    """A predictor's input for ``layer`` from an activation cache, [N, d] float32 (see INPUT_KINDS)."""
    if input_kind == "ffn_in":
        return cache.load(layer, "ffn_in", max_tokens=max_tokens)
    if input_kind == "residual":
        return cache.load(layer, "residual", max_tokens=max_tokens)
    if input_kind == "lookahead":
        return cache.load(max(layer - 1, 0), "residual", max_tokens=max_tokens)
    raise ValueError(f"input_kind must be one of {INPUT_KINDS}")


def neuron_out_norm(down: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
    """c_i = ‖g ⊙ W_down[:, i]‖ (‖W_down[:, i]‖ without a norm on the FFN's output), [D]: the size of what neuron i
    adds to the residual stream per unit of its intermediate value. ``down`` [d, D], ``gain`` [d] or None (on any
    device: it is moved to ``down``'s)."""
    return (down if gain is None else gain[:, None].to(down.device, down.dtype) * down).norm(dim=0)


def layer_out_norms(adapter, layer: nn.Module) -> torch.Tensor:
    """:func:`neuron_out_norm` of a model's decoder layer, from its own down weights and post-FFN norm gain (in the
    weights' dtype, on their device)."""
    return neuron_out_norm(adapter.ffn_weights(layer)["down"].detach(), adapter.ffn_out_gain(layer))


def output_damage(inter: torch.Tensor, down: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
    """What dropping neuron i costs token t, measured where the FFN output enters the residual stream, [N, D].

    ``inter`` [N, D]: the (signed) FFN intermediate act(gate)·up; ``down`` [d, D]. Without a norm on the FFN's
    output (Llama, Qwen, OPT): |inter_ti|·‖W_down[:, i]‖, the size of the neuron's contribution. With one
    (Gemma-3: y -> g ⊙ y / rms(y)), to first order the contribution becomes inter_ti·(g ⊙ W_down[:, i]) / rms(y_t):
    the gain g re-weights the output channels (on Gemma-3-270M it spans 0.9 to 150 in layer 0 and the rank
    correlation of ‖g ⊙ W_down[:, i]‖ with ‖W_down[:, i]‖ is 0.14-0.92 by layer), and the division by the
    token's rms(y_t) makes a token whose FFN output is small as sensitive as one whose output is large.
    """
    cols = neuron_out_norm(down, gain)
    if gain is None:
        return inter.abs() * cols
    y = inter @ down.T
    rms = y.square().mean(1, keepdim=True).sqrt_().clamp_min_(torch.finfo(y.dtype).tiny)
    return inter.abs() * cols / rms


FitFn = Callable[..., SparsityPlan]
REGISTRY: dict[str, FitFn] = {}


OPTIONS: dict[str, frozenset] = {}
CAPTURES: dict[str, tuple] = {}    # the optional activation-cache components a method fits from (capture.OPTIONAL)
# how long a method's fit runs, as a rank: 0 statistics of the captured activations (seconds), 1 a decomposition or
# a search per layer (minutes on a busy GPU), 2 training per layer (the longest); orchestrator.plan.fit_priority
FIT_COST: dict[str, int] = {}
FIT_COSTS = (0, 1, 2)
_NOT_OPTIONS = ("ctx", "sparsity", "rank")        # fit arguments that are grid fields, not method options


def register(name: str, options=None, captures: tuple = (), fit_cost: int = 0):
    """Register a fit function under ``name``. Its option names are its keyword parameters (besides ctx, sparsity,
    rank), or ``options`` where it takes them as ``**kwargs`` (a spec is checked against them at submit);
    ``captures``: the optional cache components it needs (collected only for sweeps that have the method);
    ``fit_cost``: how long its fit runs, a rank in ``FIT_COSTS`` (see ``FIT_COST``)."""
    if fit_cost not in FIT_COSTS:
        raise ValueError(f"fit_cost of {name!r} must be one of {FIT_COSTS}, not {fit_cost!r}")

    def deco(fn: FitFn) -> FitFn:
        if name in REGISTRY:
            raise ValueError(f"method {name!r} registered twice")
        REGISTRY[name] = fn
        CAPTURES[name] = tuple(captures)
        FIT_COST[name] = fit_cost
        params = inspect.signature(fn).parameters.values()
        OPTIONS[name] = frozenset(options if options is not None else
                                  (p.name for p in params if p.kind is not p.VAR_KEYWORD and p.name not in _NOT_OPTIONS))
        return fn
    return deco


def check_option_names(name: str, options) -> None:
    """Unknown option names for method ``name`` fail here, with the known ones (values are checked by the fit)."""
    get_method(name)                                  # an unknown method fails here, naming the registered ones
    unknown = sorted(set(options) - OPTIONS[name])
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; known: {sorted(OPTIONS[name])}")


def get_method(name: str) -> FitFn:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; registered: {sorted(REGISTRY)}") from None


def fit_method(name: str, ctx: FitContext, sparsity: float | dict[int, float], rank: int | None = None,
               **options) -> SparsityPlan:
    """Fit ``name`` for every layer of ``ctx``. ``sparsity`` is one MLP sparsity for all layers or per layer."""
    per_layer = sparsity if isinstance(sparsity, dict) else {l: float(sparsity) for l in ctx.layers}
    for l, s in per_layer.items():
        if not 0.0 <= s < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {s} for layer {l}")
    return get_method(name)(ctx, per_layer, rank=rank, **options)


def k_for(sparsity: float, n: int) -> int:
    """Neurons kept at a sparsity: round((1 - s) * n), at least 1."""
    return max(1, min(n, int(round((1.0 - sparsity) * n))))
