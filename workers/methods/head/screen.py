"""The head's screens: a rank-r map h -> z = P h [r] and a score table S [V, r] whose product S z estimates the
logits W h of every vocabulary row. Both are fitted from final hidden states H [N, d] (the head's input) and the
head's weight W [V, d].

  ``hidden``  P the top r principal directions of the hidden states (uncentred: the second moment C = HᵀH / N),
              S = W Pᵀ: the head applied to the projected state
  ``logits``  the rank-r approximation of the logits themselves: with C^{1/2} the second moment's square root,
              M = W C^{1/2} and V_r its top r right singular vectors, P = V_rᵀ C^{-1/2}, S = M V_r; then
              S P h = W C^{1/2} V_r V_rᵀ C^{-1/2} h minimizes the mean squared logit error over the calibration
              states (the whitened SVD of the SVD predictors, over the head)

The candidates are the K largest screen scores; the head's full distribution is the exact logits on them and the
screen's estimates elsewhere, calibrated (:func:`fit_tail`): a·(S z) + b, with (a, b) minimizing the mean KL
divergence from the dense head's distribution to the deployed one on calibration states (:func:`deployed_logits`).
The raw estimates are noisy, and a softmax over noisy logits puts too much mass on the tail (exp is convex): on
SmolLM2 the raw estimates gave a held-out perplexity 7 % above dense at r = 64, K = 2,048.
"""
from __future__ import annotations

import torch

SCREENS = ("hidden", "logits")
DAMP = 1e-6          # added to the second moment's eigenvalues (times their mean) before C^{-1/2}


def second_moment(h: torch.Tensor) -> torch.Tensor:
    """C = HᵀH / N in float64, H [N, d]."""
    h = h.double()
    return h.t() @ h / max(h.shape[0], 1)


def fit_screen(h: torch.Tensor, w: torch.Tensor, rank: int,
               screen: str = "hidden") -> tuple[torch.Tensor, torch.Tensor]:
    """(P [r, d], S [V, r]) float32 of ``screen`` fitted on hidden states ``h`` [N, d] for the head ``w`` [V, d]."""
    if screen not in SCREENS:
        raise ValueError(f"head screen must be one of {SCREENS}, got {screen!r}")
    d = w.shape[1]
    if not 0 < rank <= d or h.shape[-1] != d:
        raise ValueError(f"head screen rank must be in 1..{d} and the states [N, {d}], got rank {rank}, "
                         f"states {tuple(h.shape)}")
    c = second_moment(h)
    wd = w.double()
    if screen == "hidden":
        ev, vec = torch.linalg.eigh(c)
        p = vec.flip(-1)[:, :rank].t()                       # [r, d], orthonormal rows
        return p.float().contiguous(), (wd @ p.t()).float().contiguous()
    ev, q = torch.linalg.eigh(c)
    ev = ev.clamp_min(0) + DAMP * ev.clamp_min(0).mean()
    root, inv_root = (q * ev.sqrt()) @ q.t(), (q * ev.rsqrt()) @ q.t()
    m = wd @ root                                            # [V, d]
    _, vr = torch.linalg.eigh(m.t() @ m)
    vr = vr.flip(-1)[:, :rank]                               # [d, r]
    return (vr.t() @ inv_root).float().contiguous(), (m @ vr).float().contiguous()


def screen_scores(h: torch.Tensor, p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[..., V]: the screen's logit estimates S (P h)."""
    return (h.to(p.dtype) @ p.t()) @ s.t()


def candidates(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [..., k]: the indices of the k largest screen scores of each row (unsorted)."""
    return scores.topk(k, dim=-1, sorted=False).indices


def deployed_logits(est: torch.Tensor, cand: torch.Tensor, idx: torch.Tensor,
                    tail: tuple[float, float] = (1.0, 0.0)) -> torch.Tensor:
    """The deployed head's logits [..., V]: the candidates' exact logits ``cand`` [..., K] at ``idx`` [..., K],
    elsewhere the calibrated screen estimates a·est + b (``tail`` = (a, b)) kept below the best candidate's, so
    that the distribution's argmax is the runtime's next token (the best candidate) whatever the estimates."""
    a, b = tail
    top = cand.max(-1, keepdim=True).values
    rest = torch.minimum(est * a + b, torch.nextafter(top, torch.full_like(top, -torch.inf)))
    return rest.scatter(-1, idx, cand)


TAIL_POSITIONS = 256      # calibration states the tail is fitted on (evenly spaced)


def tail_sample(h: torch.Tensor, positions: int = TAIL_POSITIONS) -> torch.Tensor:
    """Up to ``positions`` of the states ``h``, evenly spaced, float32."""
    return h[torch.linspace(0, h.shape[0] - 1, min(positions, h.shape[0])).long()].float()


def fit_tail(exact: torch.Tensor, est: torch.Tensor, idx: torch.Tensor, iters: int = 25) -> tuple[float, float]:
    """(a, b) of the non-candidates' logits a·est + b minimizing the mean KL(dense ‖ deployed) over the positions
    of ``exact`` [N, V] (the dense logits), ``est`` [N, V] (the screen's) and the candidates ``idx`` [N, K]."""
    cand = torch.zeros_like(exact, dtype=torch.bool).scatter_(-1, idx, True)
    logp = torch.log_softmax(exact, -1)
    prob = logp.exp()
    ab = torch.tensor([1.0, 0.0], requires_grad=True)
    opt = torch.optim.LBFGS([ab], max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        q = torch.where(cand, exact, est * ab[0] + ab[1])
        loss = (prob * (logp - torch.log_softmax(q, -1))).sum(-1).mean()
        loss.backward()
        return loss
    with torch.enable_grad():
        opt.step(closure)
    a, b = (float(x) for x in ab.detach())
    return a, b


def head_quality(exact: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position (argmax kept, dense mass inside the candidates): whether the candidates ``idx`` [N, K] hold
    the dense argmax of ``exact`` [N, V], and the dense softmax's mass on them (the normalizer in float32 over the
    logits as they are, the candidates' terms in float64: no float64 copy of [N, V])."""
    kept = (idx == exact.argmax(-1, keepdim=True)).any(-1)
    lse = torch.logsumexp(exact.float(), -1, keepdim=True).double()
    mass = (exact.gather(-1, idx).double() - lse).exp().sum(-1)
    return kept, mass
