"""The predicted head on the decode runtime: the screen z = P h, its scores S z over the vocabulary, the top K,
and the candidates' exact logits from the head's own rows (the GGUF's blocks in their format, or the float
weights) through the same row kernels as the dense head, so a candidate's logit is the dense head's to the bit.

On the CPU the score table runs as int8 codes with a scale per vocabulary row, in tiles of 16 rows
(kernels.cpu.head_screen: about one byte per element, as the Q8_0 heads of the packaged models; the fit stores S
at exactly those values, so the accuracy rows select from the same scores), and the top K is a selection in C
(kernels.cpu.topk_index); elsewhere (CUDA) S is a matrix in the weights' dtype and the top K ``torch.topk``. The
next token is the candidate with the largest exact logit; the full logits (asked for by ``keep_logits``) are the
deployed head's distribution (the calibrated screen estimates outside the candidates,
workers.methods.head.screen)."""
from __future__ import annotations

import torch

from kernels import cpu as cpu_kernels, cpu_quant
from kernels.quant import QuantWeight
from kernels.reference import HS_TILE, HeadScreen
from workers.decode.plan import PartRuntime
from workers.methods.head.screen import deployed_logits


class RuntimeHead:
    """The head of a runtime's weights ``w`` with the part's screen; ``read_bytes`` a token's head bytes."""

    def __init__(self, part, w):
        self.k, self.tail = part.candidates, part.tail
        self.vocab, d = part.vocab, part.p.shape[1]
        self.w = w
        self.p = part.p.to(w.device, torch.float32).contiguous()
        quant = isinstance(w.lm_head, QuantWeight)
        if w.device.type == "cpu" and self.vocab % HS_TILE == 0:
            self.s = HeadScreen.of(part.s)
            s_bytes = self.s.nbytes
        else:
            self.s = part.s.to(w.device, torch.float32 if quant else w.dtype).contiguous()
            s_bytes = self.s.numel() * self.s.element_size()
        row_bytes = w.lm_head.nbytes / w.lm_head.rows if quant else d * w.lm_head.element_size()
        self.read_bytes = int(self.p.numel() * 4 + s_bytes + self.k * row_bytes)

    def rows(self, blocks, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """[B, K]: each row's exact logits on its candidates ``idx`` [B, K], through the dense head's own kernel
        where it is a row kernel (the GGUF's blocks; the CPU row kernels of ``cpu_rows``): its values to the bit;
        else a product over the gathered rows (its values to rounding)."""
        head = self.w.lm_head
        rows_dot = (cpu_quant.rows_dot if isinstance(head, QuantWeight) else
                    cpu_kernels.rows_dot if blocks.rows(h) else None)
        if rows_dot is None:
            return torch.einsum("bkd,bd->bk", head[idx], h.to(head.dtype))
        return torch.cat([rows_dot(h[b:b + 1], head, idx[b], self.k) for b in range(h.shape[0])])

    def screen(self, blocks, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the head's input, the screen's estimates [B, V], the candidates [B, K]) of the final states ``h``."""
        if self.w.proj_out is not None:
            h = h @ self.w.proj_out.t()
        z = h.float() @ self.p.t()
        if isinstance(self.s, HeadScreen):
            est = cpu_kernels.head_screen(z, self.s)
            return h, est, cpu_kernels.topk_index(est, self.k)
        est = z.to(self.s.dtype) @ self.s.t()
        return h, est, est.topk(self.k, dim=-1, sorted=False).indices

    def __call__(self, blocks, h: torch.Tensor, keep_logits: bool):
        """(next tokens [B], the deployed logits [B, V] or None) of the final states ``h`` [B, d]."""
        w = self.w
        h, est, idx = self.screen(blocks, h)
        exact = self.rows(blocks, h, idx).to(est.dtype)
        tok = idx.gather(1, exact.argmax(-1, keepdim=True))[:, 0]
        if not keep_logits:
            return tok, None
        z = deployed_logits(est, exact, idx, self.tail)
        return tok, z if w.softcap is None else torch.tanh(z.float() / w.softcap) * w.softcap


def compile_head(part, w) -> PartRuntime:
    """The part's runtime form: the head callable (``PartRuntime.head``); no decoder layer changes."""
    if part.p.shape[1] != w.lm_head.shape[1] or part.vocab != w.lm_head.shape[0]:
        raise ValueError(f"head screen for a [{part.vocab}, {part.p.shape[1]}] head, the runtime's is "
                         f"{list(w.lm_head.shape)}")
    return PartRuntime(head=RuntimeHead(part, w) if part.candidates < part.vocab else None)
