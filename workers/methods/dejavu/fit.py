"""Deja Vu predictors, their fit (Liu et al., ICML 2023; reference code FMInference/DejaVu, ``sparse_predictor/``).

MLP predictor, per layer: ``Linear(d, r, bias=False) -> Linear(r, D, bias=False)`` with no nonlinearity in
between, i.e. a rank-r linear map from the predictor input to one logit per FFN neuron. Deja Vu used r = 1000
on OPT (d = 2048..12288); our default is r = min(256, d). At inference the layer keeps the top-k logits per
token (rule ``topk``), k = round((1 - s) * D), never a threshold.

Labels (what "the neuron is needed" means):
  ``active``  ReLU models (OPT; ReGLU too): the neuron's activation is non-zero, ``inter != 0``, which for a
              plain ReLU FFN is Deja Vu's ``act > 0``. The label does not depend on the target sparsity.
  ``topk``    gated SiLU / GeLU models (Llama, Qwen, Gemma, SmolLM2): nothing is exactly zero, so the label is
              "the neuron is in the oracle top set at the target sparsity": the k = round((1 - s) * D)
              neurons with the largest |act(gate) * up| for that token (the ``inter`` component). Then
              the label set and the kept set have the same size and recall equals precision.
  ``damage``  gated models, what a damage-aware Deja Vu learns: the label set is the top k by the damage of
              dropping the neuron where the FFN output reaches the residual stream
              (:func:`~workers.sparsity.predictors.base.output_damage`: |act(gate)·up|·‖W_down[:, i]‖, after the
              post-FFN norm's gain and per-token scale on Gemma-3), each positive's BCE weight is its damage
              relative to the mean damage of the token's label set (missing a high-damage neuron costs more),
              the regression start fits the per-token normalized damage itself (not a 0/1 label), and the
              best checkpoint is the one that keeps the largest share of squared damage on validation tokens.
  ``auto``    (default) ``active`` when the model's FFN activation is ReLU, else ``damage``.

Training, as in their ``trainer_mlp.py``: BCE on sigmoid(logits) with per-batch class weights -- positives
weigh 1, negatives weigh w = (positive rate of the batch) + 0.005 (see :func:`class_weights`); AdamW with
weight decay 0.01, batch 1024, at most 20 epochs, lr 1e-3 (their run script; the argparse default is 1e-4).
The validation recall is measured before training and after every epoch; the checkpoint with the best recall
is kept (strictly better replaces; so the initial weights are kept if no epoch beats them); training stops
after 5 epochs without improvement or once recall exceeds 0.99. We compute BCE from logits
(``binary_cross_entropy_with_logits``: the same loss, without their clamp of log(0) to -100).

Deliberate differences from their code:
  * Recall is that of the rule we deploy -- the top-k set -- against the label set, not of ``sigmoid >= 0.5``.
  * Validation is the *last* ``val_frac`` (default 10 %) of the calibration tokens (whole windows of
    contiguous text at the end), theirs the last 5 %.
  * ``init="svd"`` (default) starts from the reduced-rank ridge regression of the labels on the inputs: the
    rank-r truncation (in the metric of the fitted values) of the least-squares map (:func:`svd_init`).
    ``init="random"`` is the nn.Linear default init, as in their code. Both are seeded from
    ``FitContext.seed`` and the layer. Why: with ~15k calibration tokens an epoch is ~15 optimizer steps; on
    SmolLM2 layer 15 at s = 0.5 a random start reached recall 0.683 after 20 epochs (still rising) while the
    regression start is at 0.697 before any step -- and BCE epochs from there did not improve top-k recall
    (the best-recall rule then keeps the start). Their 400k tokens per layer may behave differently.

Inputs (``input_kind``, see :mod:`workers.sparsity.predictors.base`): Deja Vu's MLP predictor reads the block input
before attention and its norm -- ``residual`` (default, what their inference code does: ``prepare_fc_weights``
on the block's residual). ``lookahead`` predicts layer l's set from layer l-1's residual, so it can run one
layer ahead on a side stream (the paper's Section 4.3). ``ffn_in`` is the same layer's normed FFN input
(the most accurate, nothing to overlap with).

Attention-head predictor: the same shape with one logit per head (``Linear(d, r) -> Linear(r, H)``). Label:
the head is among the top ``attn_label_frac`` (30 %) of heads by output norm for that token, ceil(0.3 H) heads
(their ``trainer_att.py`` floors int(0.3 H); with our 9-head models that would be 2 of 9 = 22 %, so we round up).
Class weights without the +0.005 (as in ``trainer_att.py``: w = positive rate). Input (``attn_input_kind``):
``lookahead`` by default -- their head predictor for layer l reads layer l-1's block input (``att_x_{l-1}``,
``previous_emb`` in their inference code). Inference keeps the top k = round((1 - s_attn) H) heads (at least
1). Learning rate ``attn_lr`` defaults to 1e-3 like the MLP: their run script uses 1e-4 with 400k tokens; on
our ~15k tokens 1e-4 needs all 20 epochs to reach (or not reach) what 1e-3 reaches in ~5. Layers
``dense_layers_attn`` keep all heads: Deja Vu keeps the first 5 of OPT-175B's 96 layers dense; our default keeps
layers 0..min(4, L // 6) dense -- the same 5 layers on SmolLM2 (30 layers), 4 of Gemma-3's 18, 1 of a 2-layer
test model. That is a larger share of a small model's depth, chosen because the first layers change the
residual stream most (the paper's Fig. 5) and lookahead there reads a very different input; it is not tuned.

Measured (``python -m benchmarks.experiments.dejavu``; SmolLM2-135M, 16,384 LAMBADA calibration tokens,
last 10 % held out, r = 256, defaults): mean held-out recall of the oracle top-k set, all 30 layers at s = 0.5:
ffn_in 0.709, residual 0.707, lookahead 0.702 (chance 0.5); every 3rd layer at s = 0.3 / 0.7: about 0.79 / 0.63
for all three inputs (chance 0.7 / 0.3), lookahead lowest by < 0.01. No BCE epoch beat the regression start on
any layer; a random start (their recipe) reached 0.685 after all 20 epochs (vs 0.700 on the same layers).
Heads (layers 5..29, lookahead input): recall of the top-30 % label 0.98 / 0.91 and of the true top-k heads
0.86 / 0.83 at s_attn = 0.3 / 0.5 (chance 0.67 / 0.44). Fitting takes ~12-30 s per layer on 2 shared CPU cores.
"""
from __future__ import annotations

import logging
import math
import time

import torch
import torch.nn.functional as F

from workers.methods.dejavu.predictor import DejaVuHeadPredictor, DejaVuMLPPredictor, LowRank
from workers.sparsity.predictors.base import INPUT_KINDS, FitContext, SparsityPlan, k_for, output_damage, register

log = logging.getLogger(__name__)

MLP_NEG_OFFSET = 0.005   # trainer_mlp.py: weight = y.sum() / y.numel() + 0.005
HEAD_NEG_OFFSET = 0.0    # trainer_att.py: weight = y.sum() / y.numel()
LABELS = ("auto", "active", "topk", "damage")
ATTN_INPUT_KINDS = ("lookahead", "residual")   # known before the layer's attention runs
INITS = ("svd", "random")

DEFAULTS: dict = {
    "input_kind": "residual",
    "epochs": 20,
    "lr": 1e-3,
    "batch_size": 1024,
    "weight_decay": 0.01,
    "max_tokens": None,
    "val_frac": 0.1,
    "patience": 5,
    "init": "svd",
    "label": "auto",
    "attn_sparsity": None,
    "dense_layers_attn": None,
    "attn_input_kind": "lookahead",
    "attn_lr": 1e-3,
    "attn_label_frac": 0.3,
}


def default_rank(d: int) -> int:
    return min(256, d)


def default_dense_attn_layers(n_layers: int) -> list[int]:
    """Layers 0..min(4, L // 6): the first layers keep every head."""
    return list(range(min(4, n_layers // 6) + 1))


# ---------------------------------------------------------------------------------------------
# labels, loss, recall
def topk_labels(values: torch.Tensor, k: int) -> torch.Tensor:
    """bool [N, n]: the k largest ``|values|`` of each row."""
    m = torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    if k:
        m.scatter_(1, values.float().abs().topk(k, dim=1).indices, True)
    return m


def active_labels(inter: torch.Tensor) -> torch.Tensor:
    """bool [N, D]: the neuron's activation is non-zero (ReLU: act > 0; ReGLU: relu(gate) > 0)."""
    return inter != 0


def damage_targets(dmg: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels: the top k by damage per token, damage normalized by the mean damage of each token's label set)."""
    y = topk_labels(dmg, k)
    scale = (dmg * y).sum(1, keepdim=True) / y.sum(1, keepdim=True).clamp_min(1)
    return y, dmg / scale.clamp_min(torch.finfo(dmg.dtype).tiny)


def class_weights(y: torch.Tensor, neg_offset: float) -> torch.Tensor:
    """Deja Vu's per-batch BCE weights: 1 for positives, (positive rate of the batch + neg_offset) for negatives.

    ``neg_offset`` is 0.005 for the MLP predictor (trainer_mlp.py) and 0 for the head predictor (trainer_att.py).
    """
    w = y.float().mean() + neg_offset
    return y * (1 - w) + w


def dejavu_loss(logits: torch.Tensor, y: torch.Tensor, neg_offset: float,
                dmg: torch.Tensor | None = None) -> torch.Tensor:
    """Deja Vu's class-weighted BCE; with ``dmg`` (normalized damage, ``label="damage"``) each positive weighs its
    normalized damage instead of 1."""
    y = y.float()
    w = class_weights(y, neg_offset)
    if dmg is not None:
        w = torch.where(y > 0, dmg.float(), w)
    return F.binary_cross_entropy_with_logits(logits, y, weight=w)


@torch.no_grad()
def recall(predictor, x: torch.Tensor, labels: torch.Tensor, dmg: torch.Tensor | None = None) -> float:
    """Share of the label set that the predictor's mask keeps (over all tokens: hits / positives); with ``dmg``
    the share of the squared damage it keeps."""
    m = predictor.mask(x)
    if dmg is not None:
        d2 = dmg.to(m.device).float().square()
        tot = float(d2.sum())
        return float((d2 * m).sum()) / tot if tot else 1.0
    pos = int(labels.sum())
    return float((m & labels.to(m.device)).sum()) / pos if pos else 1.0


# ---------------------------------------------------------------------------------------------
# initialization and training
@torch.no_grad()
def svd_init(module: LowRank, x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-3) -> None:
    """Reduced-rank ridge regression of the labels on the inputs, written into ``fc1``/``fc2``.

    W = (XᵀX + λI)⁻¹ XᵀY (λ = ridge · mean diagonal of XᵀX). The best rank-r map in the metric of the fitted
    values is W V_r V_rᵀ, V_r the top right singular vectors of XW: fc2 = V_r, fc1 = (W V_r)ᵀ (the two factors
    rescaled to equal norms, product unchanged). V_r comes from the d x d problem: with LLᵀ = XᵀX + λI and
    Z = LᵀW, the eigenvectors U of ZZᵀ give V = ZᵀU / σ (cheap when D >> d).
    Components beyond min(r, d, n_out) (e.g. r = 256 > H heads) keep their seeded random init scaled by 1e-2
    per factor: small enough not to perturb the regression, non-zero so AdamW can still grow them.
    """
    x = x.float()
    G = (x.T @ x).double()                             # the big products in float32, the small solves in float64
    lam = ridge * float(G.diagonal().mean()) + 1e-12
    G = G + lam * torch.eye(G.shape[0], dtype=G.dtype, device=G.device)
    W = torch.cholesky_solve((x.T @ y.float()).double(), L := torch.linalg.cholesky(G))  # [d, n_out]
    Z = L.T @ W                                                                         # [d, n_out]
    evals, U = torch.linalg.eigh(Z @ Z.T)
    order = evals.argsort(descending=True)
    n = min(module.rank, W.shape[0], W.shape[1])
    sigma = evals[order[:n]].clamp_min(0).sqrt()
    n = int((sigma > sigma[0] * 1e-6).sum()) if n else 0                                # drop null directions
    V = (Z.T @ U[:, order[:n]]) / sigma[:n]                                             # [n_out, n], orthonormal
    A = (W @ V).T                                                                       # [n, d]
    s = A.norm(dim=1).clamp_min(1e-12).sqrt()
    module.fc1.weight[:n] = (A / s[:, None]).float()
    module.fc2.weight[:, :n] = (V * s[None, :]).float()
    module.fc1.weight[n:] *= 1e-2
    module.fc2.weight[:, n:] *= 1e-2


def _train(model, x_tr, y_tr, x_val, y_val, *, epochs: int, lr: float, batch_size: int, weight_decay: float,
           neg_offset: float, patience: int, generator: torch.Generator, device: str,
           stop_recall: float = 0.99, d_tr: torch.Tensor | None = None, d_val: torch.Tensor | None = None) -> dict:
    """Deja Vu's loop (trainer_mlp.py / trainer_att.py): keep the best validation recall, early stopping.
    With damage (``d_tr`` / ``d_val``): damage-weighted BCE, and the recall is the share of squared damage kept.
    The training set moves to ``device`` once and its batches are gathered there: an epoch's steps queue without
    a host round trip (on a GPU that other processes keep busy, a copy per step waited for their kernels each
    time); the batches are the same rows in the same order, so the fit is the same."""
    model.to(device)
    x_tr, y_tr, x_val, y_val = (t.to(device) for t in (x_tr, y_tr, x_val, y_val))
    d_tr = None if d_tr is None else d_tr.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.eval()
    best = recall(model, x_val, y_val, d_val)
    history = [best]
    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    best_epoch, no_improve, n = 0, 0, x_tr.shape[0]
    for epoch in range(1, epochs + 1):
        if best > stop_recall:
            break
        model.train()
        perm = torch.randperm(n, generator=generator).to(device)
        for i in range(0, n, batch_size):
            idx = perm[i:i + batch_size]
            loss = dejavu_loss(model.scores(x_tr[idx]), y_tr[idx], neg_offset, None if d_tr is None else d_tr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        model.eval()
        r = recall(model, x_val, y_val, d_val)
        history.append(r)
        if r > best:
            best, best_epoch, no_improve = r, epoch, 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            no_improve += 1
            if no_improve >= patience:
                break
    model.load_state_dict(best_state)
    model.cpu()
    return {"best_val_recall": best, "best_epoch": best_epoch, "epochs_run": len(history) - 1,
            "val_recall_history": history}


def _split(n: int, val_frac: float) -> int:
    n_val = max(1, int(round(val_frac * n)))
    if n - n_val < 1:
        raise ValueError(f"need at least 2 calibration tokens, got {n}")
    return n - n_val


def _layer_seed(seed: int, layer: int, part: int) -> int:
    return (int(seed) * 1_000_003 + layer * 17 + part) % (2 ** 63)


# ---------------------------------------------------------------------------------------------
def _check_options(opts: dict) -> None:
    if opts["input_kind"] not in INPUT_KINDS:
        raise ValueError(f"dejavu: input_kind must be one of {INPUT_KINDS}, got {opts['input_kind']!r}")
    if opts["attn_input_kind"] not in ATTN_INPUT_KINDS:
        raise ValueError(f"dejavu: attn_input_kind must be one of {ATTN_INPUT_KINDS} (a layer's FFN input is "
                         f"computed from its attention output, too late to choose its heads)")
    for name in ("epochs", "batch_size"):
        if not isinstance(opts[name], int) or opts[name] < 1:
            raise ValueError(f"dejavu: {name} must be a positive int, got {opts[name]!r}")
    if not isinstance(opts["patience"], int) or opts["patience"] < 1:
        raise ValueError("dejavu: patience must be a positive int")
    for name in ("lr", "attn_lr"):
        if not opts[name] > 0:
            raise ValueError(f"dejavu: {name} must be > 0")
    if opts["weight_decay"] < 0:
        raise ValueError("dejavu: weight_decay must be >= 0")
    if opts["max_tokens"] is not None and (not isinstance(opts["max_tokens"], int) or opts["max_tokens"] < 2):
        raise ValueError("dejavu: max_tokens must be None or an int >= 2")
    if not 0 < opts["val_frac"] < 1:
        raise ValueError("dejavu: val_frac must be in (0, 1)")
    if opts["init"] not in INITS:
        raise ValueError(f"dejavu: init must be one of {INITS}")
    if opts["label"] not in LABELS:
        raise ValueError(f"dejavu: label must be one of {LABELS}")
    if not 0 < opts["attn_label_frac"] <= 1:
        raise ValueError("dejavu: attn_label_frac must be in (0, 1]")
    a = opts["attn_sparsity"]
    vals = a.values() if isinstance(a, dict) else ([] if a is None else [a])
    for v in vals:
        if not 0.0 <= float(v) < 1.0:
            raise ValueError(f"dejavu: attn_sparsity must be in [0, 1), got {v}")


def _load_input(ctx: FitContext, layer: int, kind: str, max_tokens: int | None) -> tuple[torch.Tensor, int]:
    """(predictor input [N, d] float32, the layer whose component it is)."""
    src = layer - 1 if kind == "lookahead" and layer > 0 else layer
    cached = getattr(ctx.cache, "layers", None)
    if cached is not None and src not in cached:
        raise ValueError(f"dejavu: input_kind {kind!r} for layer {layer} needs layer {src} in the activation "
                         f"cache (it has {cached})")
    return ctx.inputs(layer, kind, max_tokens=max_tokens).float(), src


def _fit_mlp_layer(ctx: FitContext, layer: int, s: float, rank: int, opts: dict, label_kind: str):
    """The layer's labels, regression start and training on ``ctx.device``."""
    t0 = time.perf_counter()
    x, src = _load_input(ctx, layer, opts["input_kind"], opts["max_tokens"])
    x = x.to(ctx.device)
    inter = ctx.cache.load(layer, "inter", max_tokens=opts["max_tokens"]).to(ctx.device)
    if inter.shape[0] != x.shape[0]:
        raise ValueError(f"dejavu: layer {layer}: {x.shape[0]} input tokens but {inter.shape[0]} labels")
    D = inter.shape[1]
    k = k_for(s, D)
    dmg = None
    if label_kind == "damage":
        y, dmg = damage_targets(output_damage(inter, ctx.ffn_weights(layer, ctx.device)["down"],
                                              ctx.ffn_out_gain(layer)), k)
    else:
        y = active_labels(inter) if label_kind == "active" else topk_labels(inter, k)
    del inter
    n_tr = _split(x.shape[0], opts["val_frac"])
    gen = torch.Generator().manual_seed(_layer_seed(ctx.seed, layer, 0))
    pred = DejaVuMLPPredictor(x.shape[1], rank, D, k, opts["input_kind"], label_kind)
    pred.reset_random(gen)
    pred.to(ctx.device)
    if opts["init"] == "svd":
        svd_init(pred, x[:n_tr], (y if dmg is None else dmg)[:n_tr])
    res = _train(pred, x[:n_tr], y[:n_tr], x[n_tr:], y[n_tr:], epochs=opts["epochs"], lr=opts["lr"],
                 batch_size=opts["batch_size"], weight_decay=opts["weight_decay"], neg_offset=MLP_NEG_OFFSET,
                 patience=opts["patience"], generator=gen, device=ctx.device,
                 d_tr=None if dmg is None else dmg[:n_tr], d_val=None if dmg is None else dmg[n_tr:])
    info = {"target_sparsity": s, "k": k, "rank": rank, "input_kind": opts["input_kind"], "input_layer": src,
            "label": label_kind, "init": opts["init"], "n_train": n_tr, "n_val": x.shape[0] - n_tr,
            "label_rate": float(y.float().mean()), **res, "fit_s": round(time.perf_counter() - t0, 3)}
    return pred, info


def _fit_head_layer(ctx: FitContext, layer: int, s_attn: float, rank: int, opts: dict):
    """The layer's labels, regression start and training on ``ctx.device``."""
    t0 = time.perf_counter()
    kind = opts["attn_input_kind"]
    x, src = _load_input(ctx, layer, kind, opts["max_tokens"])
    x = x.to(ctx.device)
    hn = ctx.cache.load(layer, "head_norm", max_tokens=opts["max_tokens"]).float().to(ctx.device)
    H = hn.shape[1]
    k = k_for(s_attn, H)
    label_k = min(H, max(1, math.ceil(opts["attn_label_frac"] * H - 1e-9)))
    y = topk_labels(hn, label_k)
    n_tr = _split(x.shape[0], opts["val_frac"])
    gen = torch.Generator().manual_seed(_layer_seed(ctx.seed, layer, 1))
    pred = DejaVuHeadPredictor(x.shape[1], rank, H, k, kind, label_k)
    pred.reset_random(gen)
    pred.to(ctx.device)
    if opts["init"] == "svd":
        svd_init(pred, x[:n_tr], y[:n_tr])
    res = _train(pred, x[:n_tr], y[:n_tr], x[n_tr:], y[n_tr:], epochs=opts["epochs"], lr=opts["attn_lr"],
                 batch_size=opts["batch_size"], weight_decay=opts["weight_decay"], neg_offset=HEAD_NEG_OFFSET,
                 patience=opts["patience"], generator=gen, device=ctx.device)
    # the deployed question: of the true top-k heads (k = inference k), how many does the predictor keep?
    true_topk = topk_labels(hn[n_tr:], k)
    info = {"target_sparsity": s_attn, "k": k, "label_k": label_k, "rank": rank, "input_kind": kind,
            "input_layer": src, "init": opts["init"], **res,
            "val_recall_topk": recall(pred, x[n_tr:].cpu(), true_topk), "fit_s": round(time.perf_counter() - t0, 3)}
    return pred, info


@register("dejavu", options=DEFAULTS, fit_cost=2)
def fit_dejavu(ctx: FitContext, sparsity: dict[int, float], rank: int | None = None, **options) -> SparsityPlan:
    """Fit Deja Vu MLP predictors for the layers of ``sparsity`` and, with ``attn_sparsity``, head predictors.

    Options (all optional): ``input_kind`` (residual | lookahead | ffn_in), ``epochs`` (20), ``lr`` (1e-3),
    ``batch_size`` (1024), ``weight_decay`` (0.01), ``max_tokens`` (all), ``val_frac`` (0.1), ``patience`` (5),
    ``init`` (svd | random), ``label`` (auto | active | topk | damage), ``attn_sparsity`` (None = no head predictor; a
    float for every layer of ``ctx.layers`` outside ``dense_layers_attn``, or {layer: s}),
    ``dense_layers_attn`` (default 0..min(4, L // 6)), ``attn_input_kind`` (lookahead | residual), ``attn_lr`` (1e-3),
    ``attn_label_frac`` (0.3). A layer with sparsity 0 (k = D) stays dense: no predictor.
    ``plan.info[layer]`` holds the MLP fit facts and, under ``"attn"``, the head predictor's.
    """
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"dejavu: unknown options {unknown}; known: {sorted(DEFAULTS)}")
    opts = {**DEFAULTS, **options}
    _check_options(opts)
    d = ctx.lm.dims.d
    if rank is None:
        rank = default_rank(d)
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"dejavu: rank must be a positive int, got {rank!r}")
    label_kind = opts["label"]
    if label_kind == "auto":
        label_kind = "active" if ctx.act_name() == "relu" else "damage"

    plan = SparsityPlan(info={})
    t_all = time.perf_counter()
    for layer in sorted(sparsity):
        s = float(sparsity[layer])
        if k_for(s, ctx.lm.dims.D) >= ctx.lm.dims.D:
            plan.info[layer] = {"target_sparsity": s, "k": ctx.lm.dims.D, "dense": True}
            continue
        pred, info = _fit_mlp_layer(ctx, layer, s, rank, opts, label_kind)
        plan.mlp[layer] = pred
        plan.info[layer] = info
        log.info("dejavu mlp layer %d: s=%.2f recall %.4f (epoch %d of %d) %.1fs", layer, s,
                 info["best_val_recall"], info["best_epoch"], info["epochs_run"], info["fit_s"])

    a = opts["attn_sparsity"]
    if a is not None:
        if isinstance(a, dict):
            attn = {int(l): float(v) for l, v in a.items()}
        else:
            dense = opts["dense_layers_attn"]
            dense = set(default_dense_attn_layers(ctx.lm.dims.n_layers) if dense is None else dense)
            attn = {l: float(a) for l in ctx.layers if l not in dense}
            for l in ctx.layers:
                if l in dense:
                    plan.info.setdefault(l, {})["attn"] = {"dense": True}
        for layer in sorted(attn):
            pred, info = _fit_head_layer(ctx, layer, attn[layer], rank, opts)
            plan.attn[layer] = pred
            plan.info.setdefault(layer, {})["attn"] = info
            log.info("dejavu heads layer %d: s=%.2f recall %.4f / top-k %.4f %.1fs", layer, attn[layer],
                     info["best_val_recall"], info["val_recall_topk"], info["fit_s"])
    log.info("dejavu: fitted %d MLP and %d head predictors in %.1fs", len(plan.mlp), len(plan.attn),
             time.perf_counter() - t_all)
    return plan
