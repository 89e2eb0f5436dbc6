"""The predicted head's masked form on a Hugging Face model: the output head swapped for one that returns the
deployed head's logits (exact on the candidates, the screen's estimates elsewhere), computed from the dense
logits (the same numbers as the candidates' own rows up to summation order), and counts how often the candidates
hold the dense argmax and how much of the dense probability they hold."""
from __future__ import annotations

import torch
from torch import nn

from workers.methods.head.screen import candidates, deployed_logits, head_quality, screen_scores


class CandidateHead(nn.Module):
    """In place of the model's output head (``orig``, kept as ``dense``): logits of the deployed head. Counts
    positions, argmax kept and dense mass on the candidates (``rows``: the eval's measurement rows) while
    ``stats`` counts (a sparse_exec.SparseStats: the perplexity unit's forwards; never a task's scoring)."""

    def __init__(self, orig: nn.Module, part, stats=None):
        super().__init__()
        self.dense = orig
        self.weight = orig.weight                  # scoring reads the vocabulary size from it
        self.register_buffer("p", part.p.to(orig.weight.device), persistent=False)
        self.register_buffer("s", part.s.to(orig.weight.device), persistent=False)
        self.k, self.d, self.tail = part.candidates, orig.weight.shape[1], part.tail
        self.read = part.read_numel(self.d)
        self.positions, self._kept, self._mass = 0, 0, 0.0
        self.stats = stats

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        exact = self.dense(h)
        if self.k >= exact.shape[-1]:
            return exact
        est = screen_scores(h.float(), self.p, self.s).to(exact.dtype)
        idx = candidates(est, self.k)
        if self.stats is None or self.stats.counting:
            kept, mass = head_quality(exact.detach().reshape(-1, exact.shape[-1]), idx.reshape(-1, self.k))
            self.positions += kept.numel()
            self._kept = self._kept + kept.sum()
            self._mass = self._mass + mass.sum()
        return deployed_logits(est, exact.gather(-1, idx), idx, self.tail)

    def rows(self) -> list[dict]:
        """The eval's head rows: argmax kept and dense mass (means over the positions scored), and the fraction
        of the head's weights a token reads."""
        n = max(self.positions, 1)
        return [{"metric": "head_argmax_kept", "higher_is_better": True, "value": float(self._kept) / n},
                {"metric": "head_mass", "higher_is_better": True, "value": float(self._mass) / n},
                {"metric": "head_read", "higher_is_better": False, "value": self.read / self.weight.numel()}]


def head_path(model: nn.Module) -> str:
    """The module path of the model's output head."""
    head = model.get_output_embeddings()
    for name, m in model.named_modules():
        if m is head and name:
            return name
    raise ValueError(f"{type(model).__name__}: no output head module found")


def apply_head(model: nn.Module, part, swaps) -> CandidateHead:
    """Swap the model's output head for the part's :class:`CandidateHead` (recorded in ``swaps``; its rows are
    reported with the swaps' stats where they have them)."""
    path = head_path(model)
    orig = model.get_output_embeddings()
    if orig.weight.shape[0] != part.vocab or orig.weight.shape[1] != part.p.shape[1]:
        raise ValueError(f"head screen is for a [{part.vocab}, {part.p.shape[1]}] head, the model's is "
                         f"{list(orig.weight.shape)}")
    stats = getattr(swaps, "stats", None)
    new = CandidateHead(orig, part, stats)
    swaps.swap(model, path, new)
    if stats is not None:
        stats.reporters.append(new.rows)
    return new
