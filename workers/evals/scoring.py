"""The lm-eval model we score with: lm-eval's ``HFLM`` with two changes to how it runs log-likelihood requests, none
to what they mean.

- *Batches sized from a logits budget* (``budget_batch``): Gemma-3's 262k-entry vocabulary makes a 32-sequence
  forward of long requests ask for tens of GiB; the batch of each stretch of the length-sorted requests is computed
  from its longest request instead of probed by out-of-memory trials (lm-eval's ``auto:N`` schedule).
- *One device round trip per batch* (``ScoringLM._loglikelihood_tokens``). lm-eval's loop scores each request with
  its own small tensor ops and two host syncs (``float(sum)``, ``bool(all)``), and takes the log-softmax of every
  position of the batch. Here the model computes logits only for the positions that predict a continuation token
  (``logits_to_keep``: the batch's rows share their right end, so that is the last stretch of the padded window),
  one gather picks each continuation token's row, log-softmax and argmax run on those rows only, and one copy
  brings the batch's values to the host. Same requests, same order (lm-eval's ``Collator``: longest first, one
  forward per group of requests that share context + continuation[:-1]), same sums; the values equal lm-eval's
  loop to rounding (``tests/workers/evals/test_suites.py`` checks both against a plain forward per request).
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

import functools
import inspect
import time
from typing import Sequence

import numpy as np

BATCHED_FOR = ("0.4.13",)   # lm-eval versions whose HFLM internals (Collator, batch schedule) the batched scorer
                            # was checked against; any other runs lm-eval's own per-request loop
# seconds this process spent in scoring forwards, from the batch's upload to its values' download (the forward, the
# log-softmax of the scored positions, the gather; on a GPU the download waits for the device): what the host waits
# for, as opposed to what it does (``benchmarks.scoring``)
device_clock = {"seconds": 0.0, "forwards": 0}
LOGIT_BYTES = 12        # per (position, vocabulary entry) of a scoring forward: the logits, an fp32 copy and
                        # its log-softmax
BUDGET_SCHEDULE = 4     # the batch is re-sized this many times along the requests (sorted longest first)


def budget_batch(length: int, vocab: int, budget_bytes: int, max_batch: int) -> int:
    """Sequences per scoring forward so that the logits of ``length`` positions over ``vocab`` entries stay within
    ``budget_bytes``: at least 1, at most ``max_batch``. A function of the request lengths only, so a run's
    batches (and numbers) do not depend on what else shares the device."""
    per_seq = max(1, length) * vocab * LOGIT_BYTES
    return max(1, min(max_batch, budget_bytes // per_seq))


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


def _keeps_logits(model) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (the HF causal LMs of transformers ≥ 4.50 do)."""
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@functools.cache
def scoring_lm():
    """The ``ScoringLM`` class (defined on first use: lm-eval is a heavy import)."""
    import lm_eval
    import torch
    import torch.nn.functional as F
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import Collator
    from tqdm import tqdm

    class ScoringLM(HFLM):
        """``HFLM`` over a given model; ``budget_bytes`` (optional) sizes the batches as ``budget_batch`` does."""

        def __init__(self, *args, budget_bytes: int | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.budget_bytes = budget_bytes
            self._generating = False
            self._keep = _keeps_logits(self.model)
            self.batched = self.backend == "causal" and lm_eval.__version__ in BATCHED_FOR
            self._encoded: list | None = None

        # ------------------------------------------------------------------------------ batch sizing
        def generate_until(self, requests, disable_tqdm: bool = False):
            self._generating = True
            try:
                return super().generate_until(requests, disable_tqdm)
            finally:
                self._generating = False

        def _detect_batch_size(self, requests=None, pos: int = 0):
            if self.budget_bytes is None:
                return super()._detect_batch_size(requests, pos)
            if requests:
                _, context_enc, continuation_enc = requests[pos]
                length = len((context_enc + continuation_enc)[-(self.max_length + 1):][:-1])
            elif self._generating:         # generation keeps the logits of one position per sequence and step
                return self.max_batch_size
            else:                          # rolling log-likelihood: windows of up to max_length
                length = self.max_length
            vocab = self.model.get_output_embeddings().weight.shape[0]
            return budget_batch(length, vocab, self.budget_bytes, self.max_batch_size)

        # ------------------------------------------------------------------------------ scoring
        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
            if self._encoded is not None:          # encode(): the requests as lm-eval tokenized them, no scores
                self._encoded.extend(requests)
                return [(0.0, False)] * len(requests)
            if not self.batched:
                return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
            collator = Collator(requests, sort_fn=_sort_key, group_by="contexts" if self.logits_cache else None,
                                group_fn=_group_key)
            batch_fn = (self._batch_scheduler if self.batch_size == "auto" and len(collator) and not override_bs
                        else None)
            if batch_fn is not None:
                self.batch_sizes = {}      # sized afresh for these requests (lm-eval does the same)
            size = self.batch_size if self.batch_size != "auto" else (override_bs or 0)
            res: list[tuple[float, bool]] = []
            pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                        desc="Running loglikelihood requests")
            for chunk in collator.get_batched(n=size, batch_fn=batch_fn):
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
            width = int(lens.max())
            ids = np.zeros((len(windows), width), dtype=np.int64)
            for row, w in enumerate(windows):
                ids[row, :lens[row]] = w
            hit_rows = np.fromiter((row for row, _ in hits), dtype=np.int64, count=len(hits))
            n = np.fromiter((len(c) for _, c in hits), dtype=np.int64, count=len(hits))
            ends = lens[hit_rows]                  # a hit's continuation ends where its row's window ends
            first = int((ends - n).min())
            starts = np.repeat(ends - n - first, n)    # column of each continuation token among the kept logits
            offsets = np.repeat(np.cumsum(n) - n, n)
            cols = starts + np.arange(len(starts)) - offsets
            toks = np.concatenate([np.asarray(c, dtype=np.int64) for _, c in hits])
            index = np.stack([np.repeat(hit_rows, n), cols, toks])
            t0 = time.perf_counter()
            with torch.no_grad():
                ids = torch.from_numpy(ids).to(self.device)
                # no KV cache: a scoring forward is never continued (HF builds one by default, per layer)
                if self._keep:
                    logits = self.model(ids, logits_to_keep=width - first, use_cache=False).logits
                else:
                    logits = self.model(ids, use_cache=False).logits[:, first:]
                index = torch.from_numpy(index).to(self.device)
                picked = F.log_softmax(logits[index[0], index[1]], dim=-1, dtype=self.softmax_dtype)
                token_lp = picked.gather(1, index[2][:, None])[:, 0].float()
                greedy = (picked.argmax(dim=-1) == index[2]).float()
                values = torch.stack([token_lp, greedy]).cpu()
                del logits, picked
            device_clock["seconds"] += time.perf_counter() - t0
            device_clock["forwards"] += 1
            token_lp, greedy = values.tolist()
            out, at = [], 0
            for k in n.tolist():
                out.append((sum(token_lp[at:at + k]), all(greedy[at:at + k])))
                at += k
            return out

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
            ``batch_size`` windows each, or as the logits budget sizes them (a function of the windows' lengths)."""
            if not self.scores_request_sets:
                raise RuntimeError("this lm-eval version or configuration scores requests its own way")
            n_rows = len(rs.row_off) - 1
            view = _Windows(rs)
            batch_fn = None
            if self.batch_size == "auto" and n_rows:
                self.batch_sizes = {}
                batch_fn = lambda pos, _rows: self._batch_scheduler(pos, view)     # noqa: E731
            size = self.batch_size if self.batch_size != "auto" else 0
            return list(Collator.get_chunks(range(n_rows), n=size, fn=batch_fn))

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

    class _Windows:
        """The windows of a request set as ``_detect_batch_size`` reads them: (strings, context, continuation)."""

        def __init__(self, rs):
            self.rs = rs

        def __len__(self):
            return len(self.rs.row_off) - 1

        def __getitem__(self, pos):
            first = int(self.rs.members[self.rs.row_off[pos]])
            return None, self.rs.context(first).tolist(), self.rs.continuation(first).tolist()

    return ScoringLM
