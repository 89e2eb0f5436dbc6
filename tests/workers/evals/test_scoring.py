"""The scoring model's batched log-likelihoods equal lm-eval's own per-request loop (``HFLM``) on the same requests:
different lengths in one batch, requests sharing a context with one-token continuations (lm-eval scores such a
group with one forward), a window cut from the left at ``max_length``, and the path for models whose forward
takes no ``logits_to_keep``."""
from __future__ import annotations

import pytest

from workers.evals.scoring import scoring_lm

MAX_LENGTH = 24


def _requests(tok) -> list:
    texts = [
        ("The capital of France is", " Paris"),
        ("The capital of France is", " Rome"),                 # same context, one-token continuations: one group
        ("The capital of France is", " Berlin"),
        ("Water boils at one hundred", " degrees Celsius at sea level."),
        ("A", " cat sat on the mat and looked out of the window at the rain."),
        (" ".join(["one two three four"] * 8), " five six"),    # longer than MAX_LENGTH: cut from the left
    ]
    out = []
    for ctx, cont in texts:
        whole = tok(ctx + cont).input_ids
        n_ctx = len(tok(ctx).input_ids)
        out.append(((ctx, cont), whole[:n_ctx], whole[n_ctx:]))
    return out


def _scores(cls, model, tok, requests, keep=True, batched=True, **kw):
    lm = cls(pretrained=model, tokenizer=tok, max_length=MAX_LENGTH, **{"batch_size": 4, **kw})
    if not keep:
        lm._keep = False
    if hasattr(lm, "batched"):
        assert lm.batched                                  # the installed lm-eval is one the scorer was checked on
        lm.batched = batched
    return lm._loglikelihood_tokens(requests, disable_tqdm=True), lm


@pytest.fixture(scope="module")
def reference(smollm2):
    from lm_eval.models.huggingface import HFLM

    reqs = _requests(smollm2.tokenizer)
    assert len(reqs[-1][1]) + len(reqs[-1][2]) > MAX_LENGTH + 1
    return reqs, _scores(HFLM, smollm2.model, smollm2.tokenizer, reqs)[0]


@pytest.mark.parametrize("keep,batched", [(True, True), (False, True), (True, False)],
                         ids=["logits_to_keep", "full_logits", "other_lm_eval_version"])
def test_batched_scores_equal_lm_evals_loop(smollm2, reference, keep, batched):
    """(An lm-eval version the batched scorer was not checked on runs lm-eval's own loop: same answers.)"""
    reqs, want = reference
    got = _scores(scoring_lm(), smollm2.model, smollm2.tokenizer, reqs, keep=keep, batched=batched)[0]
    assert len(got) == len(want) == len(reqs)
    for (ll, greedy), (ll_ref, greedy_ref) in zip(got, want):
        assert ll == pytest.approx(ll_ref, abs=1e-4)
        assert greedy is greedy_ref
    assert len({round(ll, 3) for ll, _ in got[:3]}) == 3        # the group's members got their own tokens' scores
    assert all(ll < 0 for ll, _ in got)


def test_budget_sizes_batches_without_changing_scores(smollm2, reference):
    reqs, want = reference
    vocab = smollm2.model.get_output_embeddings().weight.shape[0]
    one_seq = MAX_LENGTH * vocab * 12                          # one full window per forward
    got, lm = _scores(scoring_lm(), smollm2.model, smollm2.tokenizer, reqs, budget_bytes=one_seq,
                      batch_size="auto:4", max_batch_size=4)
    sizes = [lm.batch_sizes[k] for k in sorted(lm.batch_sizes)]
    assert sizes[0] == 1 and sizes == sorted(sizes)            # the longest stretch gets one; shorter ones more
    assert [g for _, g in got] == [g for _, g in want]
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=1e-4)
