"""Next-token distributions of a model and their KL to the dense model's: what the end-to-end allocations
(:mod:`workers.sparsity.allocation` for the FFN, :mod:`workers.sparsity.input_allocation` for input sparsity)
measure a setting by. Imports nothing of the sparsity package, so either can sit below the method fits."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_logp(model, ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [batch, positions, vocab] of the next token, in float32."""
    return F.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)


def token_kl(logp: torch.Tensor, dense_logp: torch.Tensor) -> torch.Tensor:
    """KL(dense || sparse) of each position's next-token distribution, from log-probabilities [..., vocab]."""
    return F.kl_div(logp, dense_logp, log_target=True, reduction="none").sum(-1)
