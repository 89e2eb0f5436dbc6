"""Greedy generation in refilled batches (``workers.evals.generation``): every sequence's tokens are its own greedy
continuation, whatever it shared its batch with, and ``ScoringLM.generate_until`` keeps lm-eval's texts."""
from __future__ import annotations

import pytest
import torch

from workers.evals.generation import refilling_greedy

PROMPTS = [[5, 17, 99, 3], [64, 2, 8, 120, 33, 7, 41, 12, 9], [11], [90, 91, 92, 93, 94, 95], [3, 3, 3, 3, 3, 3, 3],
           [77, 18]]


def _alone(model, prompt, max_new, stop, eos):
    """Greedy continuation of one prompt, each step a whole forward over the sequence so far (no cache, no
    padding, no batch)."""
    seq, out = list(prompt), []
    with torch.no_grad():
        while len(out) < max_new:
            t = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(t)
            out.append(t)
            if t in eos or stop(out):
                break
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "opt", "gpt2"])
def test_each_row_is_its_own_greedy_continuation(family):
    """Six prompts through two rows (refilled four times, the rows still going carried over with their cache), a
    stop rule, an end-of-text token and a cap: each continuation equals the prompt's own greedy one. Gemma-3's tiny
    model has a 16-token sliding window, which the longer sequences pass: stacked beside a new prompt's shorter
    window, and cut when the rows that held the batch's longest columns leave."""
    from tests.workers.tiny_model_support import tiny_model

    model = tiny_model(family)
    free = [_alone(model, p, 30, lambda t: False, set()) for p in PROMPTS]
    # end-of-text: a token the continuations produce; the stop rule a function of the continuation so far (as a
    # stop string is): some sequences stop early, some run to the cap
    rules = [((free[0][5],), 61), ((free[1][8], free[4][2]), 89)]
    lengths, kept = [], 0
    for max_new in (30, 0):
        for eos, mod in rules:
            def stop(toks, m=mod):
                return len(toks) > 1 and sum(toks) % m == 0

            stats: dict = {}
            got = refilling_greedy(model, PROMPTS, rows=2, max_new=max_new, stop=stop, eos_ids=eos, pad_id=0,
                                   stats=stats)
            want = [_alone(model, p, max_new, stop, set(eos)) for p in PROMPTS]
            assert got == want
            if max_new:
                lengths += [len(o) for o in want]
                assert stats["rounds"] >= 3                     # rows were refilled
                assert stats["useful_row_steps"] == sum(map(len, want)) <= stats["row_steps"]
                kept += stats["kept_rounds"]
                again: dict = {}                            # every round prefilling all its rows, as before
                assert refilling_greedy(model, PROMPTS, rows=2, max_new=max_new, stop=stop, eos_ids=eos, pad_id=0,
                                        stats=again, keep_cache=False) == want
                assert again["kept_rounds"] == 0 and again["prefill_tokens"] >= stats["prefill_tokens"]
    assert max(lengths) > 16 and min(lengths) < 16          # some ran past Gemma-3's window, some stopped early
    assert kept > 0         # rounds that kept the cache of the rows still going (prefilling only the new rows)


def test_bad_arguments():
    from tests.workers.tiny_model_support import tiny_model

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="rows"):
        refilling_greedy(model, PROMPTS, rows=0, max_new=4, stop=lambda t: False, eos_ids=(), pad_id=0)
    with pytest.raises(ValueError, match="max_new"):
        refilling_greedy(model, PROMPTS, rows=2, max_new=-1, stop=lambda t: False, eos_ids=(), pad_id=0)
    with pytest.raises(ValueError, match="no tokens"):
        refilling_greedy(model, [[1], []], rows=2, max_new=4, stop=lambda t: False, eos_ids=(), pad_id=0)


def test_generate_until_keeps_lm_evals_texts(smollm2):
    """SmolLM2, five prompts, two rows: the refilled loop's texts equal lm-eval's own loop's (same stop strings,
    same cap, same truncation of the text at the first stop)."""
    from lm_eval.api.instance import Instance

    from workers.evals.scoring_lm import ScoringLM

    prompts = ["Question: What is 2 + 3?\nAnswer:", "The capital of France is", "Once upon a time, there",
               "def add(a, b):\n   ", "Q: Name a colour.\nA:"]
    kwargs = {"until": ["\n\n", "Question:"], "max_gen_toks": 12, "do_sample": False}
    reqs = [Instance(request_type="generate_until", doc={}, arguments=(p, dict(kwargs)), idx=0) for p in prompts]
    texts = {}
    for loop in ("rounds", "lm_eval"):
        lm = ScoringLM(pretrained=smollm2.model, tokenizer=smollm2.tokenizer, batch_size=2, generation=loop)
        texts[loop] = lm.generate_until(reqs, disable_tqdm=True)
        if loop == "rounds":
            assert lm.generation_stats["rounds"] >= 2
    assert texts["rounds"] == texts["lm_eval"]
    lm = ScoringLM(pretrained=smollm2.model, tokenizer=smollm2.tokenizer, batch_size=2)
    other = {**kwargs, "max_gen_toks": 4, "repetition_penalty": 1.3}     # a kwarg the refilled loop does not do
    lm.generate_until([Instance(request_type="generate_until", doc={}, arguments=(prompts[0], other), idx=0)],
                      disable_tqdm=True)
    assert lm.generation_stats == {}                                  # lm-eval's loop ran it
    assert len({t for t in texts["rounds"]}) == len(prompts) and all("\n\n" not in t for t in texts["rounds"])
    with pytest.raises(ValueError, match="generation"):
        ScoringLM(pretrained=smollm2.model, tokenizer=smollm2.tokenizer, batch_size=2, generation="beam")


class _SmallDevice(torch.nn.Module):
    """A model whose forwards of more than ``limit`` rows run out of memory (``prefill``: prefills too, else only
    the decode steps), as on a device shared with other processes."""

    def __init__(self, model, limit: int, prefill: bool):
        super().__init__()
        self.model, self.limit, self.prefill, self.refused = model, limit, prefill, 0

    def forward(self, input_ids, past_key_values=None, **kw):
        if input_ids.shape[0] > self.limit and (self.prefill or past_key_values is not None):
            self.refused += 1
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return self.model(input_ids=input_ids, past_key_values=past_key_values, **kw)


@pytest.mark.parametrize("prefill", [True, False], ids=["at_prefill", "mid_round"])
def test_out_of_memory_halves_the_rows_and_keeps_every_token(prefill):
    from tests.workers.tiny_model_support import tiny_model

    model = tiny_model("llama")
    stop = lambda toks: len(toks) > 1 and sum(toks) % 61 == 0     # noqa: E731
    want = [_alone(model, p, 20, stop, {0}) for p in PROMPTS]
    small = _SmallDevice(model, 2, prefill)
    stats: dict = {}
    got = refilling_greedy(small, PROMPTS, rows=8, max_new=20, stop=stop, eos_ids=(0,), pad_id=0, stats=stats)
    assert got == want
    assert stats["backoffs"] == 2 and small.refused == 2             # 8 rows (6 prompts), 4: too many; 2 fit
    with pytest.raises(torch.OutOfMemoryError):
        refilling_greedy(_SmallDevice(model, 0, True), PROMPTS, rows=4, max_new=5, stop=stop, eos_ids=(0,), pad_id=0)
