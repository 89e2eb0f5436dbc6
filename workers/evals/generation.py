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
     row is finished): finished rows leave, waiting prompts take their places, and the rows still going carry
     their tokens into the next round's prefill.
A finished row's later steps in its round are computed and dropped. The re-prefill of the rows still going is the
cost of refilling without rewriting the KV cache's layout; at half a batch per round it is a few prompt lengths per
sequence, against the steps it saves. Out of device memory (the device shared with other units' processes: twelve
GSM8K units at 128 rows each did not fit on an H200), the round stops there and the batch is halved, the tokens
so far kept.

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
                     stats: dict | None = None) -> list[list[int]]:
    """The greedy continuation of each of ``prompts`` (token lists, run in the order given), at most ``max_new``
    tokens, ending with the token that finished it (an ``eos_ids`` token, or the last of a stop string: ``stop``
    is asked after every token with the continuation so far). ``rows`` sequences at a time, refilled as they finish
    (see the module doc). Out of device memory (a device shared with other processes), a round is cut short and
    the batch halved, down to one row. ``stats``: counts added there (``steps``, ``row_steps``,
    ``useful_row_steps``, ``rounds``, ``prefill_tokens``, ``backoffs``)."""
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
    for k in ("steps", "row_steps", "useful_row_steps", "rounds", "prefill_tokens", "backoffs"):
        st.setdefault(k, 0)
    waiting = list(range(len(prompts)))[::-1]          # popped from the end: the order given
    going: list[int] = []                              # prompts whose rows carry over to the next round
    with GRAD_MODE():
        while going or waiting:
            while len(going) > rows:                   # after a back-off: the rows past the new size wait again
                waiting.append(going.pop())
            batch = going + [waiting.pop() for _ in range(min(rows - len(going), len(waiting)))]
            live = [True] * len(batch)
            short = False
            try:
                _round(model, prompts, out, batch, live, rows, max_new, stop, eos, pad_id, device, bool(waiting), st)
            except torch.OutOfMemoryError:
                if rows == 1:
                    raise
                short = True
            if short:
                # the device is shared (other units' processes): fewer rows and go on. The tokens generated so far
                # are each row's own greedy ones, kept; the rows still going are prefilled again. (Out of the
                # except block: the traceback no longer holds the round's cache when the memory is handed back.)
                rows = max(1, rows // 2)
                st["backoffs"] += 1
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            going = [i for r, i in enumerate(batch) if live[r]]
    return out


def _round(model, prompts, out, batch, live, rows, max_new, stop, eos, pad_id, device, refill, st) -> None:
    """One round (see the module doc) over the prompts ``batch``: tokens appended to ``out``, ``live`` cleared for
    the rows that finish; ends when every row is finished, or (``refill``: prompts wait) when no more than
    ``REFILL_AT`` of ``rows`` are unfinished."""
    seqs = [list(prompts[i]) + out[i] for i in batch]
    ids, mask, pos = _prefill_inputs(seqs, pad_id, device)
    st["rounds"] += 1
    st["prefill_tokens"] += int(ids.numel())
    res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    cache = res.past_key_values
    last = pos[:, -1:]
    while True:
        nxt = res.logits[:, -1].argmax(dim=-1)
        toks = nxt.tolist()
        st["steps"] += 1
        st["row_steps"] += len(batch)
        for r, i in enumerate(batch):
            if not live[r]:
                continue
            st["useful_row_steps"] += 1
            out[i].append(int(toks[r]))
            if toks[r] in eos or len(out[i]) >= max_new or stop(out[i]):
                live[r] = False
        n_live = sum(live)
        if n_live == 0 or (refill and n_live <= REFILL_AT * rows):
            return
        mask = torch.cat([mask, mask.new_ones((len(batch), 1))], dim=1)
        last = last + 1
        res = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
