"""The scoring model's batched log-likelihoods equal lm-eval's own per-request loop (``HFLM``) on the same requests:
different lengths in one batch, requests sharing a context with one-token continuations (lm-eval scores such a
group with one forward), a window cut from the left at ``max_length``, batches sized in tokens, the output head run
on slices of the scored positions, and the path for models whose logits are not split into decoder and head."""
from __future__ import annotations

import pytest

from workers.evals import scoring
from workers.evals.scoring import token_batches

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


def _scores(cls, model, tok, requests, split=True, batched=True, **kw):
    lm = cls(pretrained=model, tokenizer=tok, max_length=MAX_LENGTH, **{"batch_size": 4, **kw})
    if hasattr(lm, "_split"):
        assert lm._split is not None                       # SmolLM2's logits are its head over its decoder
        if not split:
            lm._split = None
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


@pytest.mark.parametrize("split,batched", [(True, True), (False, True), (True, False)],
                         ids=["decoder_then_head", "full_logits", "other_lm_eval_version"])
def test_batched_scores_equal_lm_evals_loop(smollm2, reference, split, batched):
    """(An lm-eval version the batched scorer was not checked on runs lm-eval's own loop: same answers.)"""
    from workers.evals.scoring_lm import ScoringLM

    reqs, want = reference
    got = _scores(ScoringLM, smollm2.model, smollm2.tokenizer, reqs, split=split, batched=batched)[0]
    assert len(got) == len(want) == len(reqs)
    for (ll, greedy), (ll_ref, greedy_ref) in zip(got, want):
        assert ll == pytest.approx(ll_ref, abs=1e-4)
        assert greedy is greedy_ref
    assert len({round(ll, 3) for ll, _ in got[:3]}) == 3        # the group's members got their own tokens' scores
    assert all(ll < 0 for ll, _ in got)


def test_token_batches_known_answers():
    assert token_batches([10, 9, 8, 5, 5, 5, 1], 30) == [3, 4]       # 3 x 10 = 30; then 4 x 5 = 20 (a 5th: 35)
    assert token_batches([50, 20, 20], 30) == [1, 1, 1]               # longer than the budget: a batch of its own
    assert token_batches([4, 4, 4, 4, 4], 8) == [2, 2, 1]
    assert token_batches([3, 7], 12) == [1, 1]                        # the longest, not the first, bounds a batch
    assert token_batches([], 8) == []
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="batch_tokens"):
            token_batches([1], bad)


def test_token_batches_and_head_slices_change_no_score(smollm2, reference, monkeypatch):
    """Batches of at most 40 padded tokens (one to three windows each) and an output head run on slices of two
    positions give lm-eval's answers."""
    from workers.evals.scoring_lm import ScoringLM

    reqs, want = reference
    vocab = smollm2.model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(scoring, "HEAD_BYTES", 2 * vocab * scoring.LOGIT_BYTES)
    assert scoring.head_slice(vocab) == 2
    seen = []
    real = ScoringLM._score_windows
    monkeypatch.setattr(ScoringLM, "_score_windows", lambda self, w, h: seen.append(w) or real(self, w, h))
    got, lm = _scores(ScoringLM, smollm2.model, smollm2.tokenizer, reqs, batch_tokens=40)
    assert all(len(w) * max(map(len, w)) <= 40 or len(w) == 1 for w in seen)
    assert len(seen) >= 3 and max(len(w) for w in seen) >= 2         # some batches hold several windows
    assert [g for _, g in got] == [g for _, g in want]
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "opt", "gpt2"])
def test_decoder_then_head_gives_the_models_logits(family):
    """``_split_head`` takes a model's decoder and output head only where they give its own logits: every family
    here, Gemma's final soft cap included (set to 0.25: the tiny model's logits are about 0.2)."""
    import torch

    from tests.workers.tiny_model_support import tiny_model

    model = tiny_model(family)
    if family == "gemma3":
        model.config.final_logit_softcapping = 0.25
    split = scoring._split_head(model)
    assert split is not None
    decoder, head, cap = split
    assert cap == (0.25 if family == "gemma3" else None)
    ids = torch.tensor([[5, 17, 99, 3, 64, 2, 8, 120, 33, 7]])
    with torch.no_grad():
        want = model(ids).logits[0]
        got = scoring._capped(head(decoder(input_ids=ids).last_hidden_state[0]), cap)
        plain = head(decoder(input_ids=ids).last_hidden_state[0])
    torch.testing.assert_close(got, want)
    if family == "gemma3":
        assert (plain - want).abs().max() > 1e-2                   # the cap changes these logits


def test_a_model_whose_head_is_not_its_logits_is_scored_whole():
    """A config that names a soft cap its model does not apply (Llama ignores it): the check sees other logits and
    the scorer runs the whole forward."""
    from tests.workers.tiny_model_support import tiny_model

    model = tiny_model("llama")
    model.config.final_logit_softcapping = 0.5
    assert scoring._split_head(model) is None
