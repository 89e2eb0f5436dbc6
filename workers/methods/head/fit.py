"""The predicted head's fit: the screen (workers.methods.head.screen) from the final hidden states of the
calibration cache (the activation cache's ``final`` component: the head's input, after the last norm) and the
model's output head, in float32 on the CPU.

Knobs (a sweep's ``head`` key, docs/methods.md): ``rank`` (the screen's rank r), ``candidates`` (K, the rows
given exact logits; a deploy can change it without a refit) and ``screen`` (``hidden`` or ``logits``).
"""
from __future__ import annotations

import time

import torch

from kernels.reference import HS_TILE, HeadScreen
from workers.methods.head.part import PredictedHead
from workers.methods.head.screen import candidates as top_candidates, fit_screen, fit_tail, screen_scores, tail_sample

def head_weight(lm) -> torch.Tensor:
    """The model's output head [V, d], float32 on the CPU: what it applies to the decoder's output."""
    return lm.model.get_output_embeddings().weight.detach().to("cpu", torch.float32)


def fit_head(ctx, rank: int, candidates: int, screen: str = "hidden") -> tuple[PredictedHead, dict]:
    """(the part, its fit facts) for the model of ``ctx`` from its calibration cache's final states."""
    t0 = time.time()
    h = ctx.cache.load_final()
    w = head_weight(ctx.lm)
    p, s = fit_screen(h, w, rank, screen)
    if s.shape[0] % HS_TILE == 0:        # at the int8 values the CPU runtime's screen kernel reads
        s = HeadScreen.of(s).dequantize()
    hs = tail_sample(h)
    est = screen_scores(hs, p, s)
    tail = fit_tail(hs @ w.t(), est, top_candidates(est, min(candidates, w.shape[0])))
    part = PredictedHead(p=p, s=s, candidates=candidates, screen=screen, tail=tail)
    return part, {"head_fit_s": round(time.time() - t0, 2), "head_calib_tokens": int(h.shape[0]),
                  "head_tail": [round(x, 4) for x in tail]}
