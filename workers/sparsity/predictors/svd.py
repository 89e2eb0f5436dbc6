"""SVDP: whitened low-rank SVD predictors with greedy per-neuron bias calibration (arXiv 2603.14110).

Per layer, from the calibration tokens X (the predictor input, ``ffn_in`` by default), split deterministically into
a first half X1 (builds the factors) and a second half X2 (calibrates the biases):

1. **Whitened truncated SVD.** ``S = cholesky(X1ᵀX1)`` in float64 (when the Gram is numerically not positive
   definite -- Cholesky fails or a pivot is below ``d·eps_machine`` of the largest diagonal entry -- ``εI`` is
   added, ε = 1e-6·trace/d and ×10 until it works; ``info['chol_eps']`` records it). ``U Σ Vᵀ = svd(W S)``,
   ``A = (Vᵀ S⁻¹)[:r]`` (a triangular solve, no explicit inverse), ``B = U[:, :r] diag(Σ[:r])``. ``B A`` is the
   rank-r W that minimises ‖(W − BA) X1ᵀ‖ (plain SVD minimises ‖W − BA‖ instead), and ``B A = W`` at r = d.
   W is ``W_gate`` (gated MLPs) or ``W_fc1`` (non-gated). For an input other than ``ffn_in`` (``residual``,
   ``lookahead``) W is not defined on that input, so W is the least-squares map from the input to the gate
   pre-activation on X1 (``C G⁻¹``, with ``C = Y1ᵀ Z1``); whitening then makes BA its best rank-r reduced-rank
   regression. For ``ffn_in`` the least-squares map *is* ``W_gate``, and the weights are used directly.

2. **What the predictor scores** (``target``):
   ``gate``     proxy p = B A x (the predicted gate pre-activation), the paper's predictor;
   ``product``  proxy p = |act(ĝ)·û| with ĝ = B A x and û = B_up A_up x, a second whitened SVD of ``W_up`` with
                the same S (rank ``rank_up``, default r). Gated only. A gate-only predictor has a hard ceiling on
                SiLU/GeLU models: a neuron with a large gate but a small up contributes nothing, and the reverse.
   The score is ``p + bias`` and a neuron runs iff score > 0 (rule ``positive``); for ``product`` the bias is
   −t_i, i.e. keep iff |act(ĝ_i)·û_i| > t_i. Default: ``product`` for gated MLPs, ``gate`` otherwise.
   Measured on SmolLM2 (8,192 LAMBADA calibration tokens; 2,044 held-out tokens; every layer at s = 0.5; dense
   ppl 43.6, true top-|act·up| oracle 44.7), perplexity gate / product: r=32 102 / 139, r=64 91 / 85,
   r=128 75 / 62, r=256 71 / 49; recall of the per-token oracle set (mean of 30 layers) gate / product:
   0.55 / 0.58, 0.56 / 0.61, 0.58 / 0.66, 0.60 / 0.74. So ``product`` wins from r = 64 up, but it costs two
   factor pairs: at equal predictor bytes (gate at 2r) it wins only from r = 128 (62 vs gate-256's 71).

3. **What "inactive" means** (``damage``): the damage of switching neuron i off for token t is
   ``gate``     |act(gate)|,
   ``gate_up``  |act(gate)·up|  (= the FFN intermediate),
   ``full``     |act(gate)·up|·‖W_down[:, i]‖  (default: the size of the neuron's contribution to the output);
   non-gated: |act(fc1)| for ``gate`` and ``gate_up``, |act(fc1)|·‖W_down[:, i]‖ for ``full``.
   Where a norm sits on the FFN's output (Gemma-3), ``full`` is measured after it: the down column scaled by the
   norm's gain and divided by the token's rms(y) (:func:`~workers.sparsity.predictors.base.output_damage`).
   Without that, on Gemma-3-270M at s = 0.5 the predictor with the best recall had the worst perplexity.

4. **Greedy bias calibration on X2.** Per neuron, tokens are sorted by the proxy (ascending); switching off the k
   lowest-scored tokens costs the sum of their squared damages (a prefix constraint: a bias can only switch off
   a prefix). Each neuron's order is quantized to Q = 256 steps (step q = the first round(q·N/Q) tokens off).
   Each neuron starts at its free prefix (the most steps with zero damage: for ReLU, the natural zeros; for
   SiLU/GeLU usually none), then the greedy repeatedly gives one more step to the neuron whose next step costs
   least, until the fraction of (neuron, token) pairs off on X2 reaches the layer's target. The bias puts the
   threshold halfway between the last-off and first-on proxy values, so ``score > 0`` reproduces the chosen
   off set on X2 (ties of equal proxy values aside); a neuron never switched off gets bias +inf (always on), one
   switched off on every calibration token −inf.

**Target sparsity.** In the paper's code the target is relative to the layer's natural ReLU sparsity. Our models
are SiLU/GeLU-gated and have no natural zeros, so here ``sparsity`` is absolute: the fraction of (neuron, token)
pairs predicted off on X2. Where free zeros alone exceed the target (a ReLU layer asked for less than its natural
sparsity) all free zeros are still switched off -- they cost nothing -- and ``calib_offfrac`` says so.

**Greedy implementation.** :func:`greedy_allocate` is the generic exact greedy over prefix-constrained units
(reused across layers for a model-wide budget). Two exact implementations give identical allocations (ties go to
the lowest unit index, as with ``argmin``): ``heap`` (a binary heap, O(log U) per step) and ``sort`` (default).
``sort`` rests on this fact: the greedy takes steps in non-decreasing order of their *prefix-max marginal*
e_i(k) = max(m_i(start..k)) -- a step with a marginal below the current level is taken right after its
predecessor -- and, within equal e, by (unit, step). So one stable argsort of e plus a cumulative sum of step
sizes reproduces the whole greedy. On one SmolLM2 layer (1,536 neurons × 256 steps, 196,608 steps taken) the
sort takes ~0.02-0.03 s, the heap ~0.2-0.3 s (its per-step interpreter cost dominates) and the paper code's
O(U)-argmin-per-step loop (``_greedy_reference``, kept for tests and the benchmark) ~0.4-0.8 s: see
``python -m benchmarks.svd``.

**Sequential mode** (``mode="sequential"``): gate runs on the predicted rows, rows with |act(gate)| <= f are
dropped before up/down. f (``plan.seq_filter[layer]``) is calibrated on X2: the largest f whose extra damage (sum
of squared damages of predicted-on pairs with |act(gate)| <= f) is at most ``seq_tol`` of the squared damage the
predictor keeps. Default 1e-4: on SmolLM2 (every layer at s = 0.5, product, r = 64; parallel ppl 85.3, up/down
sparsity 0.50) seq_tol 1e-4 / 1e-3 / 1e-2 gave ppl 85.0 / 93.8 / 101.7 at up/down sparsity 0.53 / 0.58 / 0.66:
per-layer "1 %" compounds over 30 layers, so only 1e-4 is negligible.
"""
from __future__ import annotations

import contextlib
import heapq
import math
import time

import numpy as np
import torch

from workers.loading.adapters import activation_fn
from workers.sparsity.predictors.base import (
    INPUT_KINDS, SEQ_FILTERS, FitContext, MLPPredictor, SparsityPlan, linear, neuron_out_norm, output_damage,
    register,
)

Q_STEPS = 256
DAMAGES = ("gate", "gate_up", "full")
TARGETS = ("gate", "product")
GREEDY_IMPLS = ("sort", "heap")
# Default rank as a fraction of min(d, D) (see fit_svd).
DEFAULT_RANK_FRAC = 0.125


# ============================================================================================================
# generic greedy over prefix-constrained units
def _normalize_greedy_args(costs, start, sizes):
    """-> (list of 1-D float64 cost arrays, start int64 [U], list of 1-D float64 size arrays)."""
    if isinstance(costs, np.ndarray) and costs.ndim == 2:
        cl = [np.asarray(r, dtype=np.float64) for r in costs]
    elif isinstance(costs, torch.Tensor) and costs.ndim == 2:
        cl = [r for r in costs.detach().cpu().double().numpy()]
    else:
        cl = [np.asarray(c.detach().cpu().double().numpy() if isinstance(c, torch.Tensor) else c,
                         dtype=np.float64).reshape(-1) for c in costs]
    U = len(cl)
    for i, c in enumerate(cl):
        if c.size < 1:
            raise ValueError(f"unit {i}: a cost array needs at least the entry for 0 steps")
        if not np.isfinite(c).all():
            raise ValueError(f"unit {i}: costs must be finite")
    st = np.zeros(U, dtype=np.int64) if start is None else np.asarray(start, dtype=np.int64).reshape(-1)
    if st.shape != (U,):
        raise ValueError(f"start must have one entry per unit ({U})")
    lens = np.array([c.size - 1 for c in cl], dtype=np.int64)
    if (st < 0).any() or (st > lens).any():
        raise ValueError("start must lie in 0..(steps of the unit)")
    if sizes is None:
        sl = None
    else:
        if isinstance(sizes, torch.Tensor):
            sizes = sizes.detach().cpu().numpy()
        if isinstance(sizes, np.ndarray) and sizes.ndim == 1:
            shared = sizes.astype(np.float64)
            sl = [shared] * U
        else:
            sl = [np.asarray(s, dtype=np.float64).reshape(-1) for s in sizes]
        if len(sl) != U or any(s.size < n for s, n in zip(sl, lens)):
            raise ValueError("sizes must give each unit one size per step")
        if any((s[:n] < 0).any() for s, n in zip(sl, lens)):
            raise ValueError("step sizes must be >= 0")
    return cl, st, lens, sl


def greedy_allocate(costs, budget: float, start=None, sizes=None, impl: str = "sort") -> np.ndarray:
    """Exact greedy allocation of steps to prefix-constrained units.

    ``costs``: one 1-D array per unit (a list, or a 2-D array [U, n+1]): ``costs[i][k]`` is the cost of unit i
    having taken k steps (k = 0..n_i; lengths may differ). The marginal cost of unit i's step k+1 is
    ``costs[i][k+1] - costs[i][k]``; steps of a unit can only be taken in order. ``start``: steps already taken
    (default 0), e.g. each unit's free prefix. ``sizes``: optional size of each step (a 1-D array shared by all
    units, or one array per unit); ``budget`` counts steps, or total size when ``sizes`` is given.

    The greedy repeatedly takes the available step with the smallest marginal cost (ties: lowest unit index)
    until the steps taken beyond ``start`` reach ``budget`` (the last step may overshoot it by less than its
    size) or no step is left. With non-decreasing marginals per unit (convex costs) this is optimal for the
    knapsack "fixed total size, least total cost" (the SVDP paper, Thm A.15); otherwise it is the paper's greedy.

    Returns the steps per unit (int64 [U], ``start`` included). ``impl``: ``sort`` (default; vectorized) or
    ``heap``; both return exactly what the O(U)-per-step argmin loop returns.
    """
    if impl not in GREEDY_IMPLS:
        raise ValueError(f"impl must be one of {GREEDY_IMPLS}")
    cl, st, lens, sl = _normalize_greedy_args(costs, start, sizes)
    if impl == "heap":
        return _greedy_heap(cl, st, sl, budget)
    return _greedy_sort(cl, st, lens, sl, budget)


def _greedy_heap(cl, st, sl, budget) -> np.ndarray:
    cost = [c.tolist() for c in cl]
    size = None if sl is None else [s.tolist() for s in sl]
    steps = st.tolist()
    heap = [(c[k + 1] - c[k], i) for i, (c, k) in enumerate(zip(cost, steps)) if k < len(c) - 1]
    heapq.heapify(heap)
    taken = 0.0
    while taken < budget and heap:
        i = heap[0][1]
        k = steps[i]
        taken += 1.0 if size is None else size[i][k]
        k += 1
        steps[i] = k
        c = cost[i]
        if k < len(c) - 1:
            heapq.heapreplace(heap, (c[k + 1] - c[k], i))
        else:
            heapq.heappop(heap)
    return np.asarray(steps, dtype=np.int64)


def _greedy_sort(cl, st, lens, sl, budget) -> np.ndarray:
    U = len(cl)
    if U == 0 or budget <= 0:
        return st.copy()
    L = int(lens.max())
    if L == 0:
        return st.copy()
    C = np.zeros((U, L + 1))
    for i, c in enumerate(cl):
        C[i, :c.size] = c
    marg = np.diff(C, axis=1)                                       # [U, L], exact same floats as c[k+1]-c[k]
    k = np.arange(L)[None, :]
    cand = (k >= st[:, None]) & (k < lens[:, None])
    marg[k < st[:, None]] = -np.inf                                 # taken already: the prefix max starts at start
    level = np.maximum.accumulate(marg, axis=1)                     # e_i(k): the greedy's order key
    unit, _ = np.nonzero(cand)                                      # unit-major, step-minor
    e = level[cand]
    order = np.argsort(e, kind="stable")                            # ties: (unit, step), as argmin would
    if sl is None:
        take = min(int(math.ceil(budget)), order.size)
    else:
        S = np.zeros((U, L))
        for i, s in enumerate(sl):
            S[i, :lens[i]] = s[:lens[i]]
        cs = np.cumsum(S[cand][order])
        take = min(int(np.searchsorted(cs, budget, side="left")) + 1, order.size)
    return st + np.bincount(unit[order[:take]], minlength=U).astype(np.int64)


def _greedy_reference(costs, budget: float, start=None, sizes=None) -> np.ndarray:
    """The paper code's greedy: one O(U) argmin over the units' next marginal costs per step (slow; tests/bench)."""
    cl, st, lens, sl = _normalize_greedy_args(costs, start, sizes)
    steps = st.copy()
    marg = np.full(len(cl), np.inf)
    for i, c in enumerate(cl):
        if steps[i] < lens[i]:
            marg[i] = c[steps[i] + 1] - c[steps[i]]
    taken = 0.0
    while taken < budget:
        i = int(np.argmin(marg))
        if marg[i] == np.inf:
            break
        k = steps[i]
        taken += 1.0 if sl is None else sl[i][k]
        steps[i] = k + 1
        marg[i] = cl[i][k + 2] - cl[i][k + 1] if k + 1 < lens[i] else np.inf
    return steps


# ============================================================================================================
# whitened low-rank factors
@contextlib.contextmanager
def _one_thread():
    """Run small LAPACK factorizations on one thread. On a busy 2-core box a 2-thread float64 SVD of a
    [1536, 576] matrix spin-waits: ~20 s wall / 4 s CPU instead of ~0.2 s CPU on one thread."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def whitening_factor(X1: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Lower Cholesky factor S of X1ᵀX1 (float64) and the ε that had to be added (0.0 if none)."""
    X = X1.double()
    G = X.T @ X
    d = G.shape[0]
    diag = torch.diagonal(G)
    scale = float(diag.max()) if d else 0.0
    tiny = d * torch.finfo(torch.float64).eps * max(scale, 1e-300)
    eps, base = 0.0, 1e-6 * float(diag.sum()) / max(d, 1)
    if not base > 0:
        base = 1e-6
    eye = torch.eye(d, dtype=torch.float64)
    for _ in range(40):
        with _one_thread():
            L, info = torch.linalg.cholesky_ex(G + eps * eye if eps else G)
        if int(info) == 0 and bool(torch.isfinite(L).all()) and float(torch.diagonal(L).min()) ** 2 > tiny:
            return L, eps
        eps = base if eps == 0.0 else eps * 10.0
    raise np.linalg.LinAlgError("cannot make the calibration Gram positive definite")


def whitened_lowrank(WS: torch.Tensor, S: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From ``W S`` ([D, d], float64) and lower-triangular S: ``A = (Vᵀ S⁻¹)[:r]`` [r, d], ``B = U_r Σ_r`` [D, r]."""
    with _one_thread():
        U, sig, Vh = torch.linalg.svd(WS, full_matrices=False)
        Vr = Vh[:rank]                                               # [r, d]
        A = torch.linalg.solve_triangular(S.T, Vr.T, upper=True).T # Vr S⁻¹ (S⁻ᵀ Vrᵀ = solve(Sᵀ, Vrᵀ))
    B = U[:, :rank] * sig[:rank]
    return A, B


def plain_lowrank(W: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unwhitened truncated SVD of W (the naive predictor, for comparison): ``A = Vᵀ[:r]``, ``B = U_r Σ_r``."""
    with _one_thread():
        U, sig, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    return Vh[:rank], U[:, :rank] * sig[:rank]


# ============================================================================================================
# the predictor
class SVDPredictor(MLPPredictor):
    """score(x) = proxy(x) + bias; a neuron runs iff score > 0.

    ``target="gate"``: proxy = (x Aᵀ) Bᵀ.  ``target="product"``: proxy = |act((x Aᵀ) Bᵀ) · (x A_upᵀ) B_upᵀ|
    (bias = −t: keep iff |act(ĝ)·û| > t). B A is never formed: two skinny matmuls per factor pair.
    """

    method = "svd"

    def __init__(self, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor, input_kind: str = "ffn_in",
                 target: str = "gate", act: str | None = None, A_up: torch.Tensor | None = None,
                 B_up: torch.Tensor | None = None):
        D = B.shape[0]
        super().__init__(input_kind=input_kind, rule="positive", k=None, n_neurons=D)
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}")
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1] or bias.shape != (D,):
            raise ValueError(f"shapes: A [r, d], B [D, r], bias [D]; got {tuple(A.shape)}, {tuple(B.shape)}, "
                             f"{tuple(bias.shape)}")
        if target == "product":
            if A_up is None or B_up is None or act is None:
                raise ValueError("target 'product' needs A_up, B_up and act")
            if A_up.shape[1] != A.shape[1] or B_up.shape[0] != D or A_up.shape[0] != B_up.shape[1]:
                raise ValueError("A_up [r_up, d], B_up [D, r_up] must match A and B")
            activation_fn(act)  # validates the name
        self.target, self.act = target, act
        self.register_buffer("A", A.detach().float().contiguous())
        self.register_buffer("B", B.detach().float().contiguous())
        self.register_buffer("bias", bias.detach().float().contiguous())
        if target == "product":
            self.register_buffer("A_up", A_up.detach().float().contiguous())
            self.register_buffer("B_up", B_up.detach().float().contiguous())
        self._act_fn = activation_fn(act) if act is not None else None

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    @torch.no_grad()
    def proxy(self, x: torch.Tensor) -> torch.Tensor:
        """[T, d] -> [T, D]: the score before the bias (what the calibration sorts tokens by)."""
        x = x.to(self.A.dtype)
        g = linear(linear(x, self.A), self.B)
        if self.target == "gate":
            return g
        u = linear(linear(x, self.A_up), self.B_up)
        return (self._act_fn(g) * u).abs_()

    @torch.no_grad()
    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.proxy(x) + self.bias

    def config(self) -> dict:
        cfg = super().config()
        cfg.update({"target": self.target, "act": self.act, "rank": self.rank,
                    "rank_up": self.A_up.shape[0] if self.target == "product" else None})
        return cfg

    @classmethod
    def from_parts(cls, config: dict, tensors: dict[str, torch.Tensor], weights: dict[str, torch.Tensor] | None = None):
        if config.get("method") != cls.method:
            raise ValueError(f"not an {cls.method!r} predictor config: {config.get('method')!r}")
        return cls(tensors["A"], tensors["B"], tensors["bias"], input_kind=config["input_kind"],
                   target=config.get("target", "gate"), act=config.get("act"),
                   A_up=tensors.get("A_up"), B_up=tensors.get("B_up"))


# ============================================================================================================
# calibration
def quantile_bounds(n_tokens: int, q_steps: int = Q_STEPS) -> np.ndarray:
    """Token counts off at each quantile step: n_q = round(q·N/Q), q = 0..Q (Q capped at N)."""
    Q = max(1, min(q_steps, n_tokens))
    return np.floor(np.arange(Q + 1) * n_tokens / Q + 0.5).astype(np.int64)


def calibration_costs(P: torch.Tensor, damage: torch.Tensor, q_steps: int = Q_STEPS,
                      chunk_elems: int = 1 << 24) -> dict:
    """The per-neuron cost arrays of the bias calibration.

    ``P`` [N, D]: proxy scores; ``damage`` [N, D] >= 0. Per neuron, tokens are sorted by P (ascending, stable);
    ``costs[i, q]`` is the summed squared damage of the first ``nq[q]`` tokens (q = 0..Q). Also returns ``nq``,
    the step ``sizes`` (tokens), ``free`` (each neuron's zero-cost prefix, in steps), ``p_lo`` / ``p_hi`` [D, Q+1]
    (the proxy value of the last token off / first token on at each step, ∓inf past the ends) and ``total`` (the
    summed squared damage of all pairs). Neurons are processed in blocks of about ``chunk_elems`` pairs, so the
    float64 work arrays stay bounded for large D.
    """
    N, D = P.shape
    if damage.shape != P.shape:
        raise ValueError("P and damage must have the same shape")
    nq = quantile_bounds(N, q_steps)
    nq_t = torch.from_numpy(nq)
    at_lo, at_hi = (nq_t - 1).clamp(min=0), nq_t.clamp(max=N - 1)
    costs = np.empty((D, nq.size))
    p_lo = torch.empty(D, nq.size, dtype=torch.float64)
    p_hi = torch.empty(D, nq.size, dtype=torch.float64)
    total = 0.0
    step = max(1, chunk_elems // max(N, 1))
    for a in range(0, D, step):
        b = min(D, a + step)
        sp, order = torch.sort(P[:, a:b].T.contiguous().float(), dim=1, stable=True)   # [n, N] ascending
        d2 = damage[:, a:b].T.contiguous().double().gather(1, order).square_()
        del order
        cum = torch.zeros(b - a, N + 1, dtype=torch.float64)
        torch.cumsum(d2, dim=1, out=cum[:, 1:])
        del d2
        costs[a:b] = cum[:, nq_t].numpy()
        total += float(cum[:, -1].sum())
        p_lo[a:b] = sp[:, at_lo].double()
        p_hi[a:b] = sp[:, at_hi].double()
    p_lo[:, nq == 0] = -math.inf
    p_hi[:, nq == N] = math.inf
    free = (costs == 0.0).sum(axis=1) - 1                                         # costs are non-decreasing
    return {"costs": costs, "nq": nq, "sizes": np.diff(nq).astype(np.float64), "free": free,
            "p_lo": p_lo, "p_hi": p_hi, "total": total}


def calibrate_bias(P: torch.Tensor, damage: torch.Tensor, sparsity: float, q_steps: int = Q_STEPS,
                   impl: str = "sort") -> dict:
    """Greedy per-neuron bias calibration (see the module docstring).

    ``P`` [N, D]: proxy scores on the calibration tokens; ``damage`` [N, D] >= 0. Returns ``bias`` [D] (float64
    tensor, score = P + bias > 0 keeps), ``steps`` [D] (quantile steps off per neuron), ``n_off`` [D] (tokens off),
    ``free_steps`` [D], ``offfrac`` (tokens off / (N·D)), ``free_offfrac``, ``damage_off`` (fraction of the total
    squared damage that the off set drops). ``impl``: ``sort``, ``heap`` or ``reference`` (the argmin loop).
    """
    N, D = P.shape
    c = calibration_costs(P, damage, q_steps)
    costs, nq, free = c["costs"], c["nq"], c["free"]
    already = int(nq[free].sum())
    budget = sparsity * N * D - already                                           # tokens still to switch off
    if impl == "reference":
        steps = _greedy_reference(costs, budget, start=free, sizes=c["sizes"])
    else:
        steps = greedy_allocate(costs, budget, start=free, sizes=c["sizes"], impl=impl)
    n_off = torch.from_numpy(nq[steps])
    rows, st = torch.arange(D), torch.from_numpy(steps)
    lo, hi = c["p_lo"][rows, st], c["p_hi"][rows, st]
    # halfway between the last-off and the first-on proxy value; ±inf where a neuron is never / always off
    thr = torch.where(torch.isinf(lo) | torch.isinf(hi), torch.where(torch.isinf(lo), lo, hi), 0.5 * (lo + hi))
    dropped = float(costs[np.arange(D), steps].sum())
    return {"bias": -thr, "steps": torch.from_numpy(steps), "n_off": n_off, "free_steps": torch.from_numpy(free),
            "offfrac": float(n_off.sum()) / (N * D), "free_offfrac": already / (N * D),
            "damage_off": dropped / c["total"] if c["total"] > 0 else 0.0}


def seq_filter_threshold(act_gate_abs: torch.Tensor, damage: torch.Tensor, keep: torch.Tensor,
                         tol: float = 1e-4) -> tuple[float, float]:
    """Largest f such that dropping the kept pairs with |act(gate)| <= f loses at most ``tol`` of the kept squared
    damage. Returns (f, fraction of all pairs the filter additionally drops)."""
    a = act_gate_abs[keep].double()
    d2 = damage[keep].double().square()
    total = float(d2.sum())
    if a.numel() == 0:
        return 0.0, 0.0
    a_sorted, idx = torch.sort(a)
    cum = torch.cumsum(d2[idx], 0)
    # j = how many of the lowest pairs may go; then back off so that no pair equal to the threshold stays on
    j = int(torch.searchsorted(cum, torch.tensor([tol * total], dtype=torch.float64), right=True))
    if j <= 0:
        f = 0.0
    else:
        f_val = a_sorted[j - 1]
        if j < a_sorted.numel() and a_sorted[j] == f_val:
            first = int(torch.searchsorted(a_sorted, f_val.reshape(1), right=False))
            f_val = a_sorted[first - 1] if first > 0 else torch.tensor(0.0, dtype=torch.float64)
        f = max(float(f_val), 0.0)
    dropped = int((a <= f).sum())
    return f, dropped / keep.numel()


def superset_filter_threshold(score: torch.Tensor, keep: torch.Tensor, target: float) -> tuple[float, float]:
    """The filter f for the exact gate on a predicted superset: among the kept pairs, those with score <= f
    (|act(gate)|, or the damage |act(gate)·up|·c_i) are dropped so that the fraction of all pairs off reaches
    ``target``. Returns (f, fraction the filter drops)."""
    a = score[keep].double()
    n_drop = int(round(target * keep.numel())) - int((~keep).sum())
    if n_drop <= 0 or a.numel() == 0:
        return 0.0, 0.0
    n_drop = min(n_drop, a.numel())
    f = float(torch.kthvalue(a, n_drop).values)
    return f, int((a <= f).sum()) / keep.numel()


# ============================================================================================================
# fit
def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x @ w.T
    return y + b if b is not None else y


def default_rank(d: int, D: int) -> int:
    """min(d, D)/8 rounded to a multiple of 8 (SmolLM2: 72, Gemma-3-270M: 80), at least 8 and at most min(d, D)."""
    return min(min(d, D), max(8, 8 * int(round(DEFAULT_RANK_FRAC * min(d, D) / 8))))


_KNOWN = ("damage", "target", "input_kind", "max_tokens", "mode", "rank_up", "q_steps", "seq_tol", "greedy", "superset",
          "superset_filter")


@register("svd")
def fit_svd(ctx: FitContext, sparsity: dict[int, float], rank: int | None = None, damage: str = "full",
            target: str | None = None, input_kind: str = "ffn_in", max_tokens: int | None = None,
            mode: str = "parallel", rank_up: int | None = None, q_steps: int = Q_STEPS, seq_tol: float = 1e-4,
            greedy: str = "sort", superset: float | None = None, superset_filter: str = "gate",
            **unknown) -> SparsityPlan:
    """Fit SVDP predictors for the layers in ``sparsity`` (layer -> absolute target off-fraction).

    ``rank``: r (default ``default_rank(d, D)``). ``damage``: one of ``DAMAGES``. ``target``: ``gate`` or
    ``product`` (default: ``product`` for gated MLPs, ``gate`` for non-gated). ``input_kind``: predictor input.
    ``max_tokens``: cap on calibration tokens (split in halves). ``mode``: ``parallel`` or ``sequential`` (also
    calibrates ``plan.seq_filter``). ``rank_up``: rank of the W_up factors (product; default r). ``q_steps``: Q.
    ``seq_tol``: the sequential filter's damage budget. ``greedy``: ``sort`` / ``heap`` / ``reference``.
    ``superset``: exact gate on a predicted superset (implies ``mode="sequential"``): the predictor is calibrated
    to switch off only this fraction (< the layer's target), the exact gate runs on the rows it keeps, and the
    filter |act(gate)| > f, with f set on X2 so that up and down skip the layer's target fraction, picks the
    survivors. Bytes read: the predictor, gate rows (1 − superset), up and down rows (1 − target).
    ``superset_filter``: what picks the survivors of the superset: ``gate`` (|act(gate)|, above) or ``damage``
    (gate and up both run on the superset, and the filter reads each neuron's damage |act(gate)·up|·c_i,
    c_i = ‖g ⊙ W_down[:, i]‖: the oracle's own criterion within the superset, at the price of up's rows on the
    whole superset). Bytes read then: the predictor, gate and up rows (1 − superset), down rows (1 − target).
    """
    if unknown:
        raise ValueError(f"svd: unknown option(s) {sorted(unknown)}; known: rank, {', '.join(_KNOWN)}")
    if damage not in DAMAGES:
        raise ValueError(f"svd: damage must be one of {DAMAGES}, got {damage!r}")
    if input_kind not in INPUT_KINDS:
        raise ValueError(f"svd: input_kind must be one of {INPUT_KINDS}, got {input_kind!r}")
    if mode not in ("parallel", "sequential"):
        raise ValueError(f"svd: mode must be 'parallel' or 'sequential', got {mode!r}")
    if greedy not in GREEDY_IMPLS + ("reference",):
        raise ValueError(f"svd: greedy must be one of {GREEDY_IMPLS + ('reference',)}")
    if not (isinstance(q_steps, int) and q_steps >= 1):
        raise ValueError("svd: q_steps must be a positive int")
    if not 0.0 <= seq_tol < 1.0:
        raise ValueError("svd: seq_tol must be in [0, 1)")
    gated = bool(ctx.lm.adapter.ffn.gated)
    if superset is not None:
        if not gated:
            raise ValueError("svd: superset needs a gated MLP (the exact gate decides the survivors)")
        if not 0.0 <= float(superset) < 1.0:
            raise ValueError(f"svd: superset must be in [0, 1), got {superset!r}")
        mode = "sequential"
    if superset_filter not in SEQ_FILTERS:
        raise ValueError(f"svd: superset_filter must be one of {SEQ_FILTERS}, got {superset_filter!r}")
    if superset_filter != "gate" and superset is None:
        raise ValueError("svd: superset_filter needs superset (the fraction the predictor may switch off)")
    if target is None:
        target = "product" if gated else "gate"
    if target not in TARGETS:
        raise ValueError(f"svd: target must be one of {TARGETS}, got {target!r}")
    if target == "product" and not gated:
        raise ValueError("svd: target 'product' needs a gated MLP (this model's FFN has no up/gate pair)")
    act_name = ctx.act_name()
    act = activation_fn(act_name)

    plan = SparsityPlan(mlp_mode=mode, seq_filter_on=superset_filter)
    for layer in sorted(sparsity):
        t0 = time.perf_counter()
        s = float(sparsity[layer])
        if not 0.0 <= s < 1.0:
            raise ValueError(f"svd: sparsity must be in [0, 1), got {s} for layer {layer}")
        W = ctx.ffn_weights(layer)
        Wg = W["gate"] if gated else W["up"]
        bg = W.get("b_gate") if gated else W.get("b_up")                       # gated families: no biases
        D = Wg.shape[0]
        X = ctx.inputs(layer, input_kind, max_tokens=max_tokens)
        Xf = X if input_kind == "ffn_in" else ctx.inputs(layer, "ffn_in", max_tokens=max_tokens)
        N = X.shape[0]
        if Xf.shape[0] != N:
            raise ValueError(f"layer {layer}: input and ffn_in token counts differ ({N} vs {Xf.shape[0]})")
        if N < 4:
            raise ValueError(f"layer {layer}: need at least 4 calibration tokens, got {N}")
        d = X.shape[1]
        r = default_rank(d, D) if rank is None else int(rank)
        r_up = r if rank_up is None else int(rank_up)
        if not 1 <= r <= min(d, D) or (target == "product" and not 1 <= r_up <= min(d, D)):
            raise ValueError(f"svd: rank must be in 1..{min(d, D)} (got rank={r}, rank_up={r_up})")
        n1 = N // 2
        X1, X2 = X[:n1], X[n1:]
        Xf1, Xf2 = Xf[:n1], Xf[n1:]

        S, eps = whitening_factor(X1)

        def ws_of(Wm: torch.Tensor) -> torch.Tensor:
            if input_kind == "ffn_in":
                return Wm.double() @ S                                            # W S
            # least-squares map Z -> Y = Xf Wᵀ on X1: W_eff = C G⁻¹, C = Yᵀ Z; W_eff S = C S⁻ᵀ
            Y1 = Xf1.double() @ Wm.double().T
            C = Y1.T @ X1.double()
            with _one_thread():
                return torch.linalg.solve_triangular(S, C.T, upper=False).T

        A, B = whitened_lowrank(ws_of(Wg), S, r)
        A_up = B_up = None
        if target == "product":
            A_up, B_up = whitened_lowrank(ws_of(W["up"]), S, r_up)
        pred = SVDPredictor(A, B, torch.zeros(D), input_kind=input_kind, target=target,
                            act=act_name if target == "product" else None, A_up=A_up, B_up=B_up)

        # what switching a neuron off costs, on X2
        with torch.no_grad():
            g2 = act(_linear(Xf2, Wg, bg))                                        # act(gate) or act(fc1)
            # act(gate)·up (the FFN intermediate) where the damage or the superset's filter reads it
            need_up = gated and (damage != "gate" or superset_filter == "damage")
            inter = g2 * _linear(Xf2, W["up"], W.get("b_up")) if need_up else g2
            if damage == "full":       # measured where the output reaches the residual stream (post-FFN norm)
                dmg = output_damage(inter, W["down"], ctx.ffn_out_gain(layer))
            elif damage == "gate" or not gated:
                dmg = g2.abs()
            else:
                dmg = inter.abs()
            P = pred.proxy(X2)
        if superset is not None and float(superset) > s:
            raise ValueError(f"svd: superset {superset} must not exceed the layer's target {s} (layer {layer})")
        cal = calibrate_bias(P, dmg, s if superset is None else float(superset), q_steps=q_steps, impl=greedy)
        pred.bias.copy_(cal["bias"].float())
        info = {"target_sparsity": s, "calib_offfrac": cal["offfrac"], "free_offfrac": cal["free_offfrac"],
                "damage_off": cal["damage_off"], "rank": r, "rank_up": r_up if target == "product" else None,
                "chol_eps": eps, "chol_fallback": eps > 0.0, "n_fit": n1, "n_calib": N - n1,
                "target": target, "damage": damage, "input_kind": input_kind, "act": act_name,
                "q_steps": int(min(q_steps, N - n1))}
        if mode == "sequential":
            with torch.no_grad():
                keep = pred.scores(X2) > 0
            if superset is None:
                f, extra = seq_filter_threshold(g2.abs(), dmg, keep, tol=seq_tol)
            else:
                if superset_filter == "damage":
                    score = inter.abs() * neuron_out_norm(W["down"], ctx.ffn_out_gain(layer))
                else:
                    score = g2.abs()
                f, extra = superset_filter_threshold(score, keep, s)
                info["superset_filter"] = superset_filter
            plan.seq_filter[layer] = f
            info.update({"seq_filter": f, "seq_tol": seq_tol, "seq_extra_offfrac": extra,
                         "pred_offfrac": 1.0 - float(keep.float().mean())})
        del inter
        plan.mlp[layer] = pred
        info["fit_s"] = round(time.perf_counter() - t0, 4)
        plan.info[layer] = info
    return plan
