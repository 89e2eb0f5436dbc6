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
"""
from __future__ import annotations

import functools
import inspect

BATCHED_FOR = ("0.4.13",)   # lm-eval versions whose HFLM internals (Collator, batch schedule) the batched scorer
                            # was checked against; any other runs lm-eval's own per-request loop
LOGIT_BYTES = 12        # per (position, vocabulary entry) of a scoring forward: the logits, an fp32 copy and
                        # its log-softmax
BUDGET_SCHEDULE = 4     # the batch is re-sized this many times along the requests (sorted longest first)


def budget_batch(length: int, vocab: int, budget_bytes: int, max_batch: int) -> int:
    """Sequences per scoring forward so that the logits of ``length`` positions over ``vocab`` entries stay within
    ``budget_bytes``: at least 1, at most ``max_batch``. A function of the request lengths only, so a run's
    batches (and numbers) do not depend on what else shares the device."""
    per_seq = max(1, length) * vocab * LOGIT_BYTES
    return max(1, min(max_batch, budget_bytes // per_seq))


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
            if not self.batched:
                return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
            collator = Collator(
                requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
                group_by="contexts" if self.logits_cache else None, group_fn=lambda r: r[-2] + r[-1][:-1])
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
            windows, hits = [], []                 # hits: (row, request strings, continuation tokens)
            for row, (req_str, ctx, cont) in enumerate(chunk):
                if not ctx or not cont or len(cont) > self.max_length:
                    raise ValueError(f"cannot score a request of {len(ctx)} context and {len(cont)} continuation "
                                     f"tokens (at most {self.max_length})")
                windows.append((ctx + cont)[-(self.max_length + 1):][:-1])
                placeholder = torch.empty(1, len(cont), 0)
                for hit_str, hit_cont, _ in collator.get_cache(req_str=req_str, cxt_toks=ctx, cont_toks=cont,
                                                               logits=placeholder):
                    hits.append((row, hit_str, list(hit_cont)))
            width = max(len(w) for w in windows)
            ids = torch.zeros(len(windows), width, dtype=torch.long)
            for row, w in enumerate(windows):
                ids[row, :len(w)] = torch.tensor(w, dtype=torch.long)
            # a continuation of c tokens is predicted by the last c positions of its (unpadded) window
            first = min(len(windows[row]) - len(cont) for row, _, cont in hits)
            rows, cols, toks = [], [], []
            for row, _, cont in hits:
                end = len(windows[row])
                rows += [row] * len(cont)
                cols += range(end - len(cont) - first, end - first)
                toks += cont
            with torch.no_grad():
                ids = ids.to(self.device)
                # no KV cache: a scoring forward is never continued (HF builds one by default, per layer)
                if self._keep:
                    logits = self.model(ids, logits_to_keep=width - first, use_cache=False).logits
                else:
                    logits = self.model(ids, use_cache=False).logits[:, first:]
                index = torch.tensor([rows, cols, toks], dtype=torch.long).to(self.device)
                picked = F.log_softmax(logits[index[0], index[1]], dim=-1, dtype=self.softmax_dtype)
                token_lp = picked.gather(1, index[2][:, None])[:, 0].float()
                greedy = (picked.argmax(dim=-1) == index[2]).float()
                values = torch.stack([token_lp, greedy]).cpu()
            token_lp, greedy = values.tolist()
            out, at = [], 0
            for _, hit_str, cont in hits:
                n = len(cont)
                answer = (sum(token_lp[at:at + n]), all(greedy[at:at + n]))
                at += n
                if hit_str is not None:       # rolling log-likelihood windows carry no request string
                    self.cache_hook.add_partial("loglikelihood", hit_str, answer)
                out.append(answer)
            return out

    return ScoringLM
