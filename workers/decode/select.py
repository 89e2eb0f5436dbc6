"""Active sets on the device: the predictor's own ``scores`` (its GEMVs), then the selection rule.

    sel = ActiveSetSelector(impl="auto")
    idx, count = sel.select(pred, x, n)       # kernels.common's (idx, count) convention

Batch-1 top-k: a fixed-size index buffer of the k largest scores (static k; count None). ``impl`` "auto" uses
the top-k op ``kernels.ops.topk_select`` where the Triton kernels run (the radix select of
``kernels.select_triton``: indices ascending, ties to the lowest index; multi-CTA for 16-bit scores of 4,096
entries or more, else one CTA) and ``torch.topk`` elsewhere; "torch" forces ``torch.topk``, "triton" the op
(its reference on a backend without the Triton kernels); "triton-1cta" the one-CTA kernel at every size (what
the multi-CTA select is measured against; Triton backend only). The ``positive`` rule or batch > 1:
a compaction into (idx, count) (``kernels.ops.compact`` / ``union_active``).

Look-ahead (:class:`Lookahead`, one per decode step): with a side stream (CUDA, ``overlap=True``) every predictor
whose input is known before it is needed starts early -- look-ahead predictors of layer l+1 when layer l starts,
residual MLP predictors of layer l beside its attention; the main stream waits on an event only where it uses
the set. Without a side stream the sets are computed in line (what look-ahead is measured against).
"""
from __future__ import annotations

import torch

from kernels import ops

SELECT_IMPLS = ("auto", "torch", "triton", "triton-1cta")


class ActiveSetSelector:
    def __init__(self, impl: str = "auto"):
        if impl not in SELECT_IMPLS:
            raise ValueError(f"select_impl must be one of {SELECT_IMPLS}, got {impl!r}")
        self.impl = impl

    def select(self, pred, xin: torch.Tensor, n: int):
        """Active set of ``pred`` on its input ``xin`` [B, d] for the batch (the union over its rows)."""
        s = pred.scores(xin)
        if getattr(pred, "rule", "topk") == "topk":
            k = max(1, min(n, int(pred.k)))
            top = self.topk(s, k)
            if s.shape[0] == 1:
                return top.reshape(-1), None
            m = torch.zeros(s.shape, dtype=torch.bool, device=s.device).scatter_(1, top.long(), True)
            return ops.union_active(m)
        keep = s > 0
        return ops.compact(keep[0]) if s.shape[0] == 1 else ops.union_active(keep)

    def topk(self, s: torch.Tensor, k: int) -> torch.Tensor:
        """Top-k indices per row of the scores [B, n] (see the module doc for ``impl``)."""
        if self.impl.startswith("triton") or (self.impl == "auto" and ops.backend_name(s) == "triton"):
            return ops.topk_select(s, k, multi=False if self.impl == "triton-1cta" else None)
        return torch.topk(s, k, dim=-1, sorted=False).indices


class Lookahead:
    """One decode step's active sets: started early on ``side`` (a CUDA stream) or computed when asked.
    ``keep`` collects the tensors shared across streams (they must live as long as a captured graph)."""

    def __init__(self, selector: ActiveSetSelector, mlp: dict, heads: dict, n_mlp: int, n_heads: int,
                 side=None, keep: list | None = None):
        self.sel, self.side, self.keep = selector, side, keep if keep is not None else []
        self.preds = {"mlp": (mlp, n_mlp), "attn": (heads, n_heads)}
        self.pending: dict = {}      # (kind, layer) -> (event or None, (idx, count))
        self.forked = False          # whether any work went to the side stream

    def _launch(self, kind: str, l: int, xin: torch.Tensor) -> None:
        preds, n = self.preds[kind]
        pred = preds[l]
        if self.side is None:
            self.pending[(kind, l)] = (None, self.sel.select(pred, xin, n))
            return
        self.side.wait_stream(torch.cuda.current_stream())
        self.forked = True
        with torch.cuda.stream(self.side):
            sel = self.sel.select(pred, xin, n)
            ev = torch.cuda.Event()
            ev.record(self.side)
        self.keep.extend([xin, *[t for t in sel if t is not None]])
        self.pending[(kind, l)] = (ev, sel)

    def layer_start(self, l: int, n_layers: int, x: torch.Tensor) -> None:
        """Layer ``l`` starts with residual ``x``: launch what is known now (side stream only)."""
        if self.side is None:
            return
        for ll in (l, l + 1):
            if ll >= n_layers:
                continue
            for kind in ("mlp", "attn"):
                p = self.preds[kind][0].get(ll)
                if p is None or (kind, ll) in self.pending:
                    continue
                if p.input_kind == "lookahead" and (ll == l + 1 or l == 0):
                    self._launch(kind, ll, x)
                elif p.input_kind == "residual" and ll == l and kind == "mlp":
                    self._launch(kind, ll, x)

    def get(self, kind: str, l: int, xin: torch.Tensor):
        """(idx, count) of layer ``l``'s ``kind`` ("mlp" / "attn") predictor; computed now from ``xin`` unless
        it was started earlier."""
        if (kind, l) not in self.pending:
            self._launch(kind, l, xin)
        ev, sel = self.pending.pop((kind, l))
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)
        return sel

    def join(self) -> None:
        """End of the step: the main stream waits for the side stream, if anything ran there (joining a stream
        that did no work of this capture would make the CUDA graph depend on uncaptured work)."""
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.side)
