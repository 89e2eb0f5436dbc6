"""The lm-eval model we score with (``ScoringLM``, in ``workers.evals.scoring_lm``): lm-eval's ``HFLM`` with two
changes to how it runs log-likelihood requests, none to what they mean. This module holds the helpers it runs (NumPy
at import; torch and lm-eval on first use).

- *Batches sized in tokens* (``batch_tokens``, ``token_batches``): on an accelerator a forward of 32 short
  sequences (HellaSwag's windows average 78 tokens) is a few thousand tokens, far too few to fill an H200, so the
  windows (sorted longest first) go into batches of at most ``batch_tokens`` padded tokens each: many short
  windows per forward, few long ones. A function of the windows' lengths only, so a run's batches (and numbers)
  do not depend on what else shares the device.
- *One device round trip per batch* (``ScoringLM._loglikelihood_tokens``). lm-eval's loop scores each request with
  its own small tensor ops and two host syncs (``float(sum)``, ``bool(all)``), and takes the log-softmax of every
  position of the batch. Here the decoder's hidden states are gathered at the positions that predict a
  continuation token, and only those go through the output head, in slices of ``HEAD_BYTES`` of logits (Gemma-3's
  262k-entry vocabulary: a few hundred positions a slice), each slice's log-softmax, gather and argmax on the
  device, and one copy brings the batch's values to the host. Models whose logits are not the head of the
  decoder's output (checked on a short input when the scorer is made, ``_split_head``) take the whole forward's
  logits instead. Same requests, same order (lm-eval's ``Collator``: longest first, one forward per group of
  requests that share context + continuation[:-1]), same sums; the values equal lm-eval's loop to rounding
  (``tests/workers/evals/test_scoring.py`` checks both against lm-eval's own loop).
- *Requests given as tokens in their scoring order* (``score_request_set``): the requests of a packaged task as
  ``workers.evals.request_cache`` keeps them (templated, tokenized and put in the order above once per task and
  tokenizer) are scored by the same batches and the same forward as lm-eval's requests would be, without lm-eval's
  per-request objects.
- *A shard of them* (``score_request_shard``): the same batches, cut into contiguous runs of about equal padded
  tokens (``shard_of_batches``), one run per shard. Each request is scored by the very batch and forward of the
  unsharded pass, so the shards' values put together are that pass's, bit for bit (slicing the items instead
  would change the batches, and with them the summation order of every sum).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

BATCHED_FOR = ("0.4.13",)   # lm-eval versions whose HFLM internals (Collator, batch schedule) the batched scorer
                            # was checked against; any other runs lm-eval's own per-request loop
# seconds this process spent in scoring forwards, from the batch's upload to its values' download (the forward, the
# log-softmax of the scored positions, the gather; on a GPU the download waits for the device): what the host waits
# for, as opposed to what it does (``benchmarks.scoring``)
device_clock = {"seconds": 0.0, "forwards": 0}
GENERATION_LOOPS = ("rounds", "lm_eval")   # ScoringLM's greedy generation: refilled batches, or lm-eval's loop
# the generation kwargs the refilled loop honours (after lm-eval's normalize_gen_kwargs); any other (beams, a
# repetition penalty, ...) goes to lm-eval's loop, which hands them to HF generate
GREEDY_KWARGS = frozenset({"until", "max_gen_toks", "do_sample", "temperature"})
LOGIT_BYTES = 12        # per (position, vocabulary entry) of the output head: the logits, an fp32 copy and
                        # its log-softmax
HEAD_BYTES = 1 << 30    # the output head runs on slices of the scored positions of about this many logit bytes


def head_slice(vocab: int) -> int:
    """Scored positions per slice of the output head (``HEAD_BYTES`` of logits over ``vocab`` entries)."""
    return max(1, HEAD_BYTES // (max(1, vocab) * LOGIT_BYTES))


def token_batches(lengths: Sequence[int], batch_tokens: int) -> list[int]:
    """Sizes of consecutive batches of windows of ``lengths`` (tokens each) so that each batch's padded tokens
    (windows x its longest window) stay within ``batch_tokens``; a window longer than that is a batch of its own.
    Greedy in order: the scoring order sorts windows longest first, so each batch is as full as it can be."""
    if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
        raise ValueError(f"batch_tokens must be a positive int, not {batch_tokens!r}")
    sizes, i, n = [], 0, len(lengths)
    while i < n:
        j, longest = i + 1, max(1, int(lengths[i]))
        while j < n and (j - i + 1) * max(longest, int(lengths[j])) <= batch_tokens:
            longest = max(longest, int(lengths[j]))
            j += 1
        sizes.append(j - i)
        i = j
    return sizes


def _cut(items: Sequence, sizes: Sequence[int]) -> list[list]:
    """``items`` in consecutive lists of ``sizes``."""
    out, at = [], 0
    for k in sizes:
        out.append(list(items[at:at + k]))
        at += k
    return out


def _sort_key(request):
    """lm-eval's scoring order (``HFLM._loglikelihood_tokens``): longest context + continuation first, then by
    tokens."""
    _, ctx, cont = request
    return -len(ctx + cont), tuple(ctx + cont)


def _group_key(request):
    """Requests with equal context + continuation[:-1] are answered by one window (lm-eval's ``logits_cache``)."""
    _, ctx, cont = request
    return ctx + cont[:-1]


def scoring_order(requests: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """The windows lm-eval scores for ``requests`` ((strings, context tokens, continuation tokens) each), in the
    order it runs them (its ``Collator`` as ``ScoringLM._loglikelihood_tokens`` uses it), as (``row_off``,
    ``members``): window ``p`` answers the requests ``members[row_off[p]:row_off[p + 1]]`` (indices into
    ``requests``), in the order lm-eval hands them out; they share context + continuation[:-1], so any of them
    gives the window's tokens."""
    import torch
    from lm_eval.models.utils import Collator

    collator = Collator(list(requests), sort_fn=_sort_key, group_by="contexts", group_fn=_group_key)
    reps = [r for chunk in collator.get_batched(n=0) for r in chunk]
    placeholder = torch.empty(1, 1, 0)
    counts = []
    for req_str, ctx, cont in reps:
        counts.append(sum(1 for _ in collator.get_cache(req_str=req_str, cxt_toks=ctx, cont_toks=cont,
                                                        logits=placeholder)))
    members = np.asarray(collator._reorder_indices, dtype=np.int64)     # in get_cache's order (lm-eval 0.4.13)
    if sorted(members.tolist()) != list(range(len(requests))):
        raise RuntimeError("lm-eval's Collator did not hand out every request once")
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]), members


def window_length(rs, p: int, max_length: int) -> int:
    """Tokens of scoring window ``p`` of a request set (its context and continuation, truncated as scored)."""
    first = int(rs.members[rs.row_off[p]])
    n = (rs.ctx_off[rs.req_ctx[first] + 1] - rs.ctx_off[rs.req_ctx[first]]) + \
        (rs.cont_off[first + 1] - rs.cont_off[first])
    return int(min(n - 1, max_length))


def shard_of_batches(rs, batches: Sequence[Sequence[int]], n_shards: int, max_length: int | None = None) -> list[int]:
    """The shard (0 .. n_shards - 1) of each batch: contiguous runs of batches in scoring order, cut where the padded
    tokens (windows x the batch's longest window; the first, sorted longest first) reach k / n_shards of the total,
    a batch going to the shard that holds its midpoint. A function of the request set and the batches only, so every
    shard of one task computes the same cut."""
    if not isinstance(n_shards, int) or n_shards < 1:
        raise ValueError(f"n_shards must be a positive int, not {n_shards!r}")
    cap = max_length if max_length is not None else 1 << 62
    cost = [len(b) * max(window_length(rs, b[0], cap), 1) for b in batches]
    total = sum(cost)
    out, before = [], 0
    for c in cost:
        out.append(min(n_shards - 1, (2 * before + c) * n_shards // (2 * total)) if total else 0)
        before += c
    return out


def _check(ctx, cont, max_length: int) -> None:
    if not len(ctx) or not len(cont) or len(cont) > max_length:
        raise ValueError(f"cannot score a request of {len(ctx)} context and {len(cont)} continuation tokens (at "
                         f"most {max_length})")


def _split_head(model):
    """(decoder, output head, final-logit soft cap) of an HF causal LM whose logits are its output head applied to
    its decoder's last hidden state (soft-capped where the config says so, as Gemma's are), else None. Checked on a
    short input against the model's own forward, so a family that scales or post-processes its logits another way
    is scored from its whole forward instead."""
    import torch

    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or head is None or decoder is model:
        return None
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    vocab = head.weight.shape[0]
    ids = (torch.arange(1, 9, device=head.weight.device) * 7919 % vocab)[None]
    with torch.no_grad():
        try:
            want = model(ids, use_cache=False).logits[0]
            got = _capped(head(decoder(input_ids=ids, use_cache=False).last_hidden_state[0]), cap)
        except (AttributeError, TypeError):
            return None
    scale = max(1.0, float(want.abs().max()))
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-3, atol=1e-3 * scale):
        return None
    return decoder, head, cap


def _capped(logits, cap):
    import torch

    return logits if cap is None else torch.tanh(logits / cap) * cap
