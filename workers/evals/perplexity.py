"""Model quality: perplexity on held-out token windows."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.loading.data import TokenSet


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float          # mean negative log-likelihood per predicted token (nats)
    n_tokens: int       # tokens predicted
    stderr_nll: float | None   # standard error of the mean NLL over windows; None for a single window


@torch.inference_mode()
def perplexity(model: torch.nn.Module, tokens: TokenSet, batch_windows: int = 4) -> Perplexity:
    """Non-overlapping windows; every document token that has a token before it in its window is predicted."""
    device = next(model.parameters()).device
    per_window: list[tuple[float, int]] = []
    for start in range(0, tokens.windows.shape[0], batch_windows):
        ids = tokens.windows[start:start + batch_windows].to(device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        target = ids[:, 1:]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        nll = nll.view(target.shape)[:, max(tokens.prefix_len - 1, 0):]
        for row in nll:
            per_window.append((row.sum().item(), row.numel()))
    total = sum(s for s, _ in per_window)
    count = sum(n for _, n in per_window)
    mean = total / count
    means = torch.tensor([s / n for s, n in per_window], dtype=torch.float64)
    se = (means.std(unbiased=True) / math.sqrt(len(means))).item() if len(means) > 1 else None   # needs 2 windows
    return Perplexity(ppl=math.exp(mean), nll=mean, n_tokens=count, stderr_nll=se)
