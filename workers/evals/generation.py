"""Greedy generation that refills its batch: ``refilling_greedy`` (what ``ScoringLM.generate_until`` runs).

lm-eval's loop (``HFLM.generate_until``) generates a batch of prompts until *every* sequence of it has emitted a
stop string, or ``max_gen_toks`` tokens: each sequence is computed for as many steps as the slowest of its batch.
On GSM8K (8-shot chain of thought) that is 2.5x the steps the answers need (``benchmarks.generation_waste``): the
median answer is 63 tokens, but most batches hold a sequence that never stops and runs to 256.

Here a batch of ``rows`` sequences runs in rounds:
  1. prefill: each row's prompt, plus what it has generated in earlier rounds, left-padded into one batch (the
     padding masked out, positions counted from each row's first real token, as ``generate`` does);
  2. greedy steps on the KV cache, each row appending its own argmax, until a row is finished by an end-of-text
     token, by ``stop(tokens)`` (a stop string) or by ``max_new`` tokens;
  3. the round ends when no more than half the rows are unfinished and prompts are still waiting (or when every
     row is finished): finished rows leave, waiting prompts take their places. The rows still going keep their
     KV cache: the next round prefills only the new prompts, left-pads both to one width (the padding masked out)
     and stacks them. A sliding window's layers (Gemma-3's) keep each row's last ``W - 1`` columns, which left
     padding keeps aligned. Another kind of cache (static, quantized) is prefilled again with the rows' tokens.
A finished row's later steps in its round are computed and dropped. Out of device memory (the device shared with
other units' processes: twelve GSM8K units at 128 rows each did not fit on an H200), the round stops there and the
batch is halved, the tokens so far kept.

Every sequence's tokens are its greedy continuation: the same tokens ``generate`` gives it in any batch, up to the
summation order of the batch it shares (padding and batch shape move fp32 logits by about 1e-6, which can flip a
near-tie, as lm-eval's own batch size can). Each row stops only after its own stop, so the text lm-eval keeps
(everything before the first stop string) is the same. ``tests/workers/evals/test_generation.py`` checks the texts
against lm-eval's loop.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

# a round ends once no more than this fraction of its rows is unfinished (and prompts wait for the rows)
REFILL_AT = 0.5
# the loop runs without autograd's per-op bookkeeping: about 1.03x a CPU decode loop against torch.no_grad, near
# the noise (benchmarks.generation_grad_mode, BENCHMARKS.md)
GRAD_MODE = torch.inference_mode


def _prefill_inputs(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """(input ids, attention mask, position ids) of ``seqs`` left-padded into one batch."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        if len(s):
            ids[r, width - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
            mask[r, width - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), pos.to(device)


def refilling_greedy(model, prompts: Sequence[Sequence[int]], rows: int, max_new: int,
                     stop: Callable[[list[int]], bool], eos_ids: Sequence[int], pad_id: int,
                     stats: dict | None = None, keep_cache: bool = True) -> list[list[int]]:
    """The greedy continuation of each of ``prompts`` (token lists, run in the order given), at most ``max_new``
    tokens, ending with the token that finished it (an ``eos_ids`` token, or the last of a stop string: ``stop``
    is asked after every token with the continuation so far). ``rows`` sequences at a time, refilled as they finish
    (see the module doc). Out of device memory (a device shared with other processes), a round is cut short and
    the batch halved, down to one row. ``stats``: counts added there (``steps``, ``row_steps``,
    ``useful_row_steps``, ``rounds``, ``prefill_tokens``, ``kept_rounds``, ``backoffs``). ``keep_cache=False``:
    every round prefills all its rows again (what ran before the cache was kept; ``benchmarks.generation_waste``
    times both)."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive int, not {rows!r}")
    if not isinstance(max_new, int) or max_new < 0:
        raise ValueError(f"max_new must be a non-negative int, not {max_new!r}")
    if any(not len(p) for p in prompts):
        raise ValueError("a prompt of no tokens has nothing to continue")
    out: list[list[int]] = [[] for _ in prompts]
    if max_new == 0:
        return out
    eos = set(int(t) for t in eos_ids)
    device = next(model.parameters()).device
    st = stats if stats is not None else {}
    for k in ("steps", "row_steps", "useful_row_steps", "rounds", "prefill_tokens", "kept_rounds", "backoffs"):
        st.setdefault(k, 0)
    waiting = list(range(len(prompts)))[::-1]          # popped from the end: the order given
    going: list[int] = []                              # prompts whose rows carry over to the next round
    kept: _Rows | None = None                          # their cache, when the next round can keep it
    with GRAD_MODE():
        while going or waiting:
            while len(going) > rows:                   # after a back-off: the rows past the new size wait again
                waiting.append(going.pop())
                kept = None
            new = [waiting.pop() for _ in range(min(rows - len(going), len(waiting)))]
            batch = going + new
            live = [True] * len(batch)
            short = False
            try:
                kept = _round(model, prompts, out, going, new, kept, live, rows, max_new, stop, eos, pad_id, device,
                              bool(waiting), st)
            except torch.OutOfMemoryError:
                if rows == 1:
                    raise
                short = True
            if short:
                # the device is shared (other units' processes): fewer rows and go on. The tokens generated so far
                # are each row's own greedy ones, kept; the rows still going are prefilled again. (Out of the
                # except block: the traceback no longer holds the round's cache when the memory is handed back.)
                kept = None
                rows = max(1, rows // 2)
                st["backoffs"] += 1
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            going = [i for r, i in enumerate(batch) if live[r]]
            if kept is not None:
                kept = kept.select([r for r in range(len(batch)) if live[r]]) if keep_cache else None
    return out


class _Rows:
    """A batch's KV cache (a ``DynamicCache``), attention mask, each row's last position and its next token (the
    argmax of its last forward, on the device: generated, not yet fed; the cache holds every token before it): the
    state a round hands to the next, so that the rows still going are not prefilled again. Every row's real tokens
    are the right end of the mask (left padding only), so a sliding window's last ``W - 1`` cache columns are each
    row's last real tokens, padding masked."""

    def __init__(self, cache, mask: torch.Tensor, last: torch.Tensor, pending: torch.Tensor):
        self.cache, self.mask, self.last, self.pending = cache, mask, last, pending

    @staticmethod
    def keepable(cache) -> bool:
        """Whether rows can be taken out of and stacked into ``cache``: its layers plain ``DynamicLayer`` or
        ``DynamicSlidingWindowLayer`` (not recording a past for rollback), all filled."""
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        layers = getattr(cache, "layers", None)
        return bool(layers) and all(
            layer.is_initialized and (type(layer) is DynamicLayer or
                                      (type(layer) is DynamicSlidingWindowLayer and not layer.record_past))
            for layer in layers)

    def _set_width(self, width: int) -> None:
        for layer in self.cache.layers:
            if hasattr(layer, "cumulative_length"):          # a sliding window's: the tokens the batch has seen
                layer.cumulative_length = width

    def select(self, rows: list[int]) -> _Rows | None:
        """The rows ``rows`` only, the leading columns no row uses dropped; None for no rows."""
        if not rows:
            return None
        idx = torch.as_tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        width = mask.shape[1] - int(mask.any(0).nonzero()[0])
        for layer in self.cache.layers:             # a full layer's width is the mask's; a window's at most that
            keep = min(layer.keys.shape[2], width)
            layer.keys = layer.keys.index_select(0, idx)[:, :, layer.keys.shape[2] - keep:]
            layer.values = layer.values.index_select(0, idx)[:, :, layer.values.shape[2] - keep:]
        out = _Rows(self.cache, mask[:, mask.shape[1] - width:], self.last.index_select(0, idx),
                    self.pending.index_select(0, idx))
        out._set_width(width)
        return out

    def stack(self, other: _Rows) -> _Rows:
        """These rows, then ``other``'s, left-padded to one width (the padding masked out)."""

        def pad(t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
            n = width - t.shape[dim]
            if not n:
                return t
            shape = list(t.shape)
            shape[dim] = n
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for a, b in zip(self.cache.layers, other.cache.layers):
            w = max(a.keys.shape[2], b.keys.shape[2])
            a.keys = torch.cat([pad(a.keys, 2, w), pad(b.keys, 2, w)], dim=0)
            a.values = torch.cat([pad(a.values, 2, w), pad(b.values, 2, w)], dim=0)
        width = max(self.mask.shape[1], other.mask.shape[1])
        out = _Rows(self.cache, torch.cat([pad(self.mask, 1, width), pad(other.mask, 1, width)]),
                    torch.cat([self.last, other.last]), torch.cat([self.pending, other.pending]))
        out._set_width(width)
        return out


def _take(res, out, batch, live, max_new, stop, eos, st, offset=0) -> torch.Tensor:
    """The argmax of forward ``res``'s last position for each of ``batch`` (one forward more in ``st``), returned on
    the device; each live row's appended to its continuation, and rows that it finishes cleared in ``live``."""
    nxt = res.logits[:, -1].argmax(dim=-1)
    toks = nxt.tolist()
    st["steps"] += 1
    st["row_steps"] += len(batch)
    for r, i in enumerate(batch):
        if not live[offset + r]:
            continue
        st["useful_row_steps"] += 1
        out[i].append(int(toks[r]))
        if toks[r] in eos or len(out[i]) >= max_new or stop(out[i]):
            live[offset + r] = False
    return nxt


def _round(model, prompts, out, going, new, kept, live, rows, max_new, stop, eos, pad_id, device, refill,
           st) -> _Rows | None:
    """One round (see the module doc) over the prompts ``going + new``: tokens appended to ``out``, ``live``
    cleared for the rows that finish; ends when every row is finished, or (``refill``: prompts wait) when no more
    than ``REFILL_AT`` of ``rows`` are unfinished. ``kept``: the cache of the ``going`` rows from the last round
    (then only ``new`` is prefilled), else None (every row is). Returns the state to keep for the next round, or
    None where the cache cannot be kept."""
    batch = going + new
    st["rounds"] += 1
    if kept is None:
        prefill = batch
    else:
        prefill = new
        st["kept_rounds"] += 1
    state = None
    if prefill:
        seqs = [list(prompts[i]) + out[i] for i in prefill]
        ids, mask, pos = _prefill_inputs(seqs, pad_id, device)
        st["prefill_tokens"] += int(ids.numel())
        res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        nxt = _take(res, out, prefill, live, max_new, stop, eos, st, offset=len(batch) - len(prefill))
        state = _Rows(res.past_key_values, mask, pos[:, -1:], nxt)
    if kept is not None:
        # the kept rows' last tokens and the new rows' first are fed together
        state = kept if state is None else kept.stack(state)
    _continue(model, out, batch, live, state, rows, max_new, stop, eos, refill, st)
    return state if _Rows.keepable(state.cache) else None


def _continue(model, out, batch, live, state: _Rows, rows, max_new, stop, eos, refill, st) -> None:
    """Greedy steps on ``state`` (each row's pending token fed) until the round ends (see ``_round``)."""
    while True:
        n_live = sum(live)
        if n_live == 0 or (refill and n_live <= REFILL_AT * rows):
            return
        state.mask = torch.cat([state.mask, state.mask.new_ones((len(batch), 1))], dim=1)
        state.last = state.last + 1
        res = model(input_ids=state.pending[:, None], attention_mask=state.mask, position_ids=state.last,
                    past_key_values=state.cache, use_cache=True, logits_to_keep=1)
        state.pending = _take(res, out, batch, live, max_new, stop, eos, st)
