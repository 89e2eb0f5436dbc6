"""``ScoringLM``: the lm-eval model the suites score with (what it changes in lm-eval's ``HFLM`` and why:
``workers.evals.scoring``, which holds the batching, ordering and output-head helpers it runs).

This module imports lm-eval, torch and tqdm at the top, as its base class needs: lm-eval is a heavy import (seconds,
it loads transformers), so nothing imports this module at the top of its own; callers import it where they build
a scorer (``suites._scorer``), and ``workers.evals.scoring`` stays cheap to import (NumPy only). The class is
defined once, at module level, so it is an ordinary class: picklable, patchable and introspectable by name.
"""
from __future__ import annotations

import time
from typing import Sequence

import lm_eval
import numpy as np
import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import Collator
from tqdm import tqdm

from workers.evals.scoring import (
    BATCHED_FOR,
    GENERATION_LOOPS,
    GREEDY_KWARGS,
    _capped,
    _check,
    _cut,
    _group_key,
    _sort_key,
    _split_head,
    device_clock,
    head_slice,
    shard_of_batches,
    token_batches,
    window_length,
)


class ScoringLM(HFLM):
    """``HFLM`` over a given model; ``batch_tokens`` (optional): log-likelihood batches of at most that many
    padded tokens (``token_batches``) instead of ``batch_size`` sequences; ``generation``: greedy generation
    in batches refilled as sequences finish (``"rounds"``) or lm-eval's own loop (``"lm_eval"``)."""

    def __init__(self, *args, batch_tokens: int | None = None, generation: str = "rounds", **kwargs):
        super().__init__(*args, **kwargs)
        if batch_tokens is not None:
            token_batches([], batch_tokens)            # checks it
        if generation not in GENERATION_LOOPS:
            raise ValueError(f"generation must be one of {GENERATION_LOOPS}, not {generation!r}")
        self.batch_tokens = batch_tokens
        self.generation = generation
        self.generation_stats: dict[str, int] = {}    # refilling_greedy's counts, summed over calls
        self.batched = self.backend == "causal" and lm_eval.__version__ in BATCHED_FOR
        self._split = _split_head(self.model) if self.batched else None
        self._encoded: list | None = None

    def _batch_sizes(self, lengths: Sequence[int]) -> list[int]:
        """Windows per forward along windows of ``lengths`` tokens (in scoring order)."""
        if self.batch_tokens is not None:
            return token_batches(lengths, self.batch_tokens)
        if not isinstance(self.batch_size, int):
            raise RuntimeError(f"the batched scorer runs a fixed batch_size or batch_tokens, not "
                               f"batch_size={self.batch_size!r}")
        n, k = len(lengths), self.batch_size
        return [min(k, n - i) for i in range(0, n, k)]

    # ------------------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if self._encoded is not None:          # encode(): the requests as lm-eval tokenized them, no scores
            self._encoded.extend(requests)
            return [(0.0, False)] * len(requests)
        if not self.batched or (self.batch_tokens is None and not isinstance(self.batch_size, int)):
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        collator = Collator(requests, sort_fn=_sort_key, group_by="contexts" if self.logits_cache else None,
                            group_fn=_group_key)
        reps = [r for chunk in collator.get_batched(n=0) for r in chunk]     # every window, in scoring order
        keep = self.max_length + 1
        lengths = [len((ctx + cont)[-keep:]) - 1 for _, ctx, cont in reps]
        res: list[tuple[float, bool]] = []
        pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                    desc="Running loglikelihood requests")
        for chunk in _cut(reps, self._batch_sizes(lengths)):
            res += self._score_batch(collator, chunk)
            pbar.update(len(chunk))
        pbar.close()
        return collator.get_original(res)

    def _score_batch(self, collator, chunk) -> list[tuple[float, bool]]:
        """(sum of log p(continuation), greedy == continuation) for every request of one batch, in the order
        ``collator.get_cache`` hands them out (a group's members after its representative)."""
        windows, hits, strings = [], [], []    # hits: (row, continuation tokens)
        max_length = self.max_length          # a property that reads the model config on every call
        for row, (req_str, ctx, cont) in enumerate(chunk):
            _check(ctx, cont, max_length)
            windows.append((ctx + cont)[-(max_length + 1):][:-1])
            placeholder = torch.empty(1, len(cont), 0)
            for hit_str, hit_cont, _ in collator.get_cache(req_str=req_str, cxt_toks=ctx, cont_toks=cont,
                                                           logits=placeholder):
                hits.append((row, hit_cont))
                strings.append(hit_str)
        out = self._score_windows(windows, hits)
        for hit_str, answer in zip(strings, out):
            if hit_str is not None:           # rolling log-likelihood windows carry no request string
                self.cache_hook.add_partial("loglikelihood", hit_str, answer)
        return out

    def _score_windows(self, windows: list, hits: list) -> list[tuple[float, bool]]:
        """One forward over ``windows`` (token sequences, right-padded into one batch); for each hit (row,
        continuation tokens) the sum of log p(continuation) and whether greedy decoding gives it, in order. A
        continuation of c tokens is predicted by the last c positions of its row's (unpadded) window."""
        lens = np.fromiter((len(w) for w in windows), dtype=np.int64, count=len(windows))
        ids = np.zeros((len(windows), int(lens.max())), dtype=np.int64)
        for row, w in enumerate(windows):
            ids[row, :lens[row]] = w
        hit_rows = np.fromiter((row for row, _ in hits), dtype=np.int64, count=len(hits))
        n = np.fromiter((len(c) for _, c in hits), dtype=np.int64, count=len(hits))
        offsets = np.repeat(np.cumsum(n) - n, n)
        # a hit's continuation ends where its row's window ends: token j of it is predicted at end - n + j
        cols = np.repeat(lens[hit_rows] - n, n) + np.arange(int(n.sum())) - offsets
        toks = np.concatenate([np.asarray(c, dtype=np.int64) for _, c in hits])
        index = np.stack([np.repeat(hit_rows, n), cols, toks])
        t0 = time.perf_counter()
        with torch.no_grad():
            ids = torch.from_numpy(ids).to(self.device)
            index = torch.from_numpy(index).to(self.device)
            # no KV cache: a scoring forward is never continued (HF builds one by default, per layer)
            if self._split is not None:
                decoder, head, cap = self._split
                rows = decoder(input_ids=ids, use_cache=False).last_hidden_state[index[0], index[1]]
                vocab = head.weight.shape[0]
            else:
                head, cap = None, None
                rows = self.model(ids, use_cache=False).logits[index[0], index[1]]
                vocab = rows.shape[-1]
            token_lp = torch.empty(len(toks), dtype=torch.float32, device=rows.device)
            greedy = torch.empty(len(toks), dtype=torch.float32, device=rows.device)
            step = head_slice(vocab)
            for at in range(0, len(toks), step):
                sl = slice(at, at + step)
                logits = rows[sl] if head is None else _capped(head(rows[sl]), cap)
                picked = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
                target = index[2, sl]
                token_lp[sl] = picked.gather(1, target[:, None])[:, 0].float()
                greedy[sl] = (picked.argmax(dim=-1) == target).float()
                del logits, picked
            values = torch.stack([token_lp, greedy]).cpu()
            del rows
        device_clock["seconds"] += time.perf_counter() - t0
        device_clock["forwards"] += 1
        token_lp, greedy = values.tolist()
        out, at = [], 0
        for k in n.tolist():
            out.append((sum(token_lp[at:at + k]), all(greedy[at:at + k])))
            at += k
        return out

    # ------------------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """lm-eval's ``generate_until`` for greedy requests, its batches refilled as sequences finish
        (``workers.evals.generation.refilling_greedy``): the same prompts (lm-eval's order, tokenization and
        left truncation), the same stop strings and end-of-text, the same text kept. ``generation =
        "lm_eval"``, sampling, thinking tokens or another lm-eval version: lm-eval's own loop."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, \
            postprocess_generated_text
        from workers.evals.generation import refilling_greedy

        args = [r.args for r in requests]
        kwargs = [normalize_gen_kwargs(dict(g), self.max_gen_toks) for _, g in args]
        if (self.generation != "rounds" or not self.batched or not isinstance(self.batch_size, int)
                or self.think_end_token is not None
                or any(k.get("do_sample") or k.get("temperature", 0.0) or set(k) - GREEDY_KWARGS
                       for k in kwargs)):
            return super().generate_until(requests, disable_tqdm)
        collator = Collator(args, sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]), group_by="gen_kwargs",
                            group_fn=lambda r: r[1])
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        eos_ids = self.model.generation_config.eos_token_id
        eos_ids = [self.eot_token_id] if eos_ids is None else [eos_ids] if isinstance(eos_ids, int) else eos_ids
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        res = []
        for group in collator.get_batched(n=0):
            contexts = [c for c, _ in group]
            kw = normalize_gen_kwargs(dict(group[0][1]), self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            max_new = kw.pop("max_gen_toks")
            prompts = []
            for at in range(0, len(contexts), self.batch_size):      # lm-eval's batches: same tokenization
                ids, mask = self.tok_batch_encode(contexts[at:at + self.batch_size],
                                                  left_truncate_len=self.max_length - max_new,
                                                  truncation=self.truncation)
                prompts += [row[m.bool()].tolist() for row, m in zip(ids, mask)]
            # lm-eval's test, a stop string in the last len(its tokens) + 2 tokens, with one decode of the
            # widest of those windows for all of them: a wider window sees a stop string no sooner than it is
            # there, and the text kept ends before the first one anyway
            stops = [s for s in until if s]
            look = max((len(self.tokenizer.encode(s, add_special_tokens=False)) + 2 for s in stops), default=1)

            def stop(toks: list[int]) -> bool:
                text = self.tokenizer.decode(toks[-look:])
                return any(s in text for s in stops)

            outs = refilling_greedy(self.model, prompts, self.batch_size, max_new, stop, eos_ids, pad_id,
                                    self.generation_stats)
            for (context, gen_kwargs), toks in zip(group, outs):
                s = postprocess_generated_text(self.tok_decode(toks), until, None)
                res.append(s)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), s)
        return collator.get_original(res)

    # ------------------------------------------------------------------------------ requests as tokens
    def encode(self, instances) -> list:
        """lm-eval's own tokenization of log-likelihood requests (``loglikelihood`` up to where it would score
        them): [((context, continuation), context tokens, continuation tokens)], in the order given."""
        self._encoded = []
        try:
            self.loglikelihood(instances, disable_tqdm=True)
            return self._encoded
        finally:
            self._encoded = None

    @property
    def scores_request_sets(self) -> bool:
        """Whether ``score_request_set`` gives what ``_loglikelihood_tokens`` would (the batched scorer, with
        lm-eval's grouping of requests that share a window)."""
        return self.batched and bool(self.logits_cache)

    def score_request_set(self, rs) -> tuple[np.ndarray, np.ndarray]:
        """(log-likelihood, greedy) of every request of ``rs`` (a ``request_cache.RequestSet``: tokens and their
        scoring order, as ``scoring_order`` gives it), by the batches ``_loglikelihood_tokens`` would run for
        the same requests: same windows, same batch sizes, same forward."""
        ll = np.zeros(rs.n_requests, dtype=np.float64)
        greedy = np.zeros(rs.n_requests, dtype=bool)
        for chunk in self.request_set_batches(rs):
            self._score_rows(rs, chunk, ll, greedy)
        return ll, greedy

    def score_request_shard(self, rs, shard: int, n_shards: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(requests, their log-likelihoods, their greedy flags) of shard ``shard`` of ``n_shards``: the batches
        of ``request_set_batches`` that ``shard_of_batches`` gives it, each run as ``score_request_set`` runs it,
        so every request's values are bit for bit the unsharded pass's (same window, batch and forward)."""
        if not (isinstance(shard, int) and isinstance(n_shards, int) and 0 <= shard < n_shards):
            raise ValueError(f"shard {shard!r} of {n_shards!r}: a shard is 0 <= k < n_shards")
        batches = self.request_set_batches(rs)
        owner = shard_of_batches(rs, batches, n_shards, self.max_length)
        ll = np.zeros(rs.n_requests, dtype=np.float64)
        greedy = np.zeros(rs.n_requests, dtype=bool)
        answered: list[int] = []
        for chunk, k in zip(batches, owner):
            if k == shard:
                answered += self._score_rows(rs, chunk, ll, greedy)
        req = np.sort(np.asarray(answered, dtype=np.int64))
        return req, ll[req], greedy[req]

    def request_set_batches(self, rs) -> list[list[int]]:
        """The scoring windows of ``rs`` (indices into ``rs.row_off``) in the batches ``score_request_set`` runs:
        ``batch_size`` windows each, or at most ``batch_tokens`` padded tokens each (``token_batches`` over the
        windows' lengths)."""
        if not self.scores_request_sets:
            raise RuntimeError("this lm-eval version or configuration scores requests its own way")
        n_rows = len(rs.row_off) - 1
        lengths = [window_length(rs, p, self.max_length) for p in range(n_rows)]
        return _cut(range(n_rows), self._batch_sizes(lengths))

    def _score_rows(self, rs, chunk, ll: np.ndarray, greedy: np.ndarray) -> list[int]:
        """Score one batch of windows into ``ll`` / ``greedy``; the requests it answered."""
        max_length = self.max_length
        keep = max_length + 1
        row_off, members = rs.row_off, rs.members
        windows, hits, answered = [], [], []
        for row, p in enumerate(chunk):
            mine = members[row_off[p]:row_off[p + 1]].tolist()
            ctx, cont = rs.context(mine[0]), rs.continuation(mine[0])
            _check(ctx, cont, max_length)
            windows.append(np.concatenate([ctx, cont])[-keep:][:-1])
            for m in mine:
                hits.append((row, rs.continuation(m)))
            answered += mine
        for m, (value, is_greedy) in zip(answered, self._score_windows(windows, hits)):
            ll[m], greedy[m] = value, is_greedy
        return answered

