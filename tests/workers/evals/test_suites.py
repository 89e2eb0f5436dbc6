"""Multiple-choice suites: registry, upstream templates on the shipped data, lm-eval scores checked against an
independent log-likelihood computation, determinism, and that the model object given is the one scored."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import suites as suites_cli
from workers.evals import suites
from workers.evals.suites import SUITES, SuiteError, build_task, gold_index, run_suite


def test_unknown_task_is_a_clear_error_listing_the_known_ones():
    with pytest.raises(ValueError) as e:
        run_suite(None, None, ["copa", "piqa_typo"], limit=5)
    msg = str(e.value)
    assert "piqa_typo" in msg
    assert all(name in msg for name in ("piqa", "arc_easy", "copa", "hellaswag"))
    with pytest.raises(SuiteError, match="limit"):
        run_suite(None, None, ["copa"], limit=0)
    with pytest.raises(SystemExit):
        suites_cli.main(["--tasks", "nope", "--limit", "2"])


def test_registry_covers_the_shipped_tasks():
    assert {"piqa", "arc_easy", "copa", "arc_challenge", "hellaswag", "winogrande", "boolq", "openbookqa",
            "sciq"} <= set(SUITES)
    for spec in SUITES.values():
        assert set(spec.metrics) <= {"acc", "acc_norm"}
        assert (suites.data_dir(spec.name) / "state.json").exists()
    # upstream evaluates ARC on test; only validation ships: the rows must say so
    assert not SUITES["arc_easy"].comparable_with_published
    assert SUITES["piqa"].comparable_with_published and SUITES["copa"].comparable_with_published


def test_upstream_templates_render_the_shipped_items():
    """lm-eval's own prompts/choices on the shipped data (pins the template: a change here changes numbers)."""
    piqa = build_task("piqa")
    doc = piqa.eval_docs[0]
    assert piqa.doc_to_text(doc) == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert [c[:40] for c in piqa.doc_to_choice(doc)] == ["Provide the guinea pig with a cage full "] * 2
    assert gold_index(piqa, doc) == 0
    arc = build_task("arc_easy")
    doc = arc.eval_docs[0]
    assert arc.doc_to_text(doc) == "Question: Which technology was developed most recently?\nAnswer:"
    assert arc.doc_to_choice(doc) == ["cellular telephone", "television", "refrigerator", "airplane"]
    assert gold_index(arc, doc) == 0
    copa = build_task("copa")
    docs = copa.eval_docs
    assert copa.doc_to_text(docs[0]) == "The man turned on the faucet therefore"
    assert copa.doc_to_choice(docs[0]) == [" the toilet filled with water.", " water flowed from the spout."]
    # gold index = the raw dataset's label, for every COPA item
    assert [gold_index(copa, d) for d in docs] == list(docs["label"])
    boolq = build_task("boolq")                        # shipped as google/boolq: `answer` replaces `label`
    assert [gold_index(boolq, boolq.eval_docs[i]) for i in range(20)] == \
        [int(a) for a in boolq.eval_docs["answer"][:20]]


def _independent_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """Sum of log p(continuation tokens | context), one unpadded sequence, plain forward pass.

    Token split as lm-eval defines the metric: trailing spaces of the context move to the continuation, the
    whole string is encoded once and the continuation is what follows the context's tokens."""
    n_space = len(context) - len(context.rstrip())
    if n_space:
        context, continuation = context[:-n_space], context[-n_space:] + continuation
    whole = tokenizer(context + continuation).input_ids
    ctx = tokenizer(context).input_ids
    cont = whole[len(ctx):]
    assert cont, "empty continuation"
    ids = torch.tensor([whole])
    with torch.inference_mode():
        logp = F.log_softmax(model(input_ids=ids).logits[0, :-1].double(), dim=-1)
    pos = torch.arange(len(whole) - len(cont) - 1, len(whole) - 1)
    return logp[pos, torch.tensor(cont)].sum().item()


@pytest.fixture(scope="module")
def copa_piqa(smollm2):
    return run_suite(smollm2.model, smollm2.tokenizer, ["copa", "piqa"], limit=20, batch_size=8, keep_items=True)


def test_rows_are_fractions_over_the_first_limit_items(copa_piqa):
    assert [(r.task, r.metric) for r in copa_piqa] == [("copa", "acc"), ("piqa", "acc"), ("piqa", "acc_norm")]
    for r in copa_piqa:
        assert r.n == 20 and 0.0 <= r.value <= 1.0
        assert r.higher_is_better is True                                    # lm-eval's direction for acc
        assert r.value * r.n == pytest.approx(round(r.value * r.n))        # a count of correct items
        assert r.stderr is not None and 0 < r.stderr < 0.2
        assert r.task_version == "1.0" and r.lm_eval_version and r.split == "validation"
        assert [it.doc_id for it in r.items] == list(range(20))
        assert len(r.items_fingerprint) == 64
    assert copa_piqa[0].n_total == 100 and copa_piqa[1].n_total == 1838
    json.dumps([r.row() for r in copa_piqa])                               # rows are plain data


def test_scores_equal_an_independent_loglikelihood_computation(smollm2, copa_piqa):
    """lm-eval's batched, padded scores == a plain forward pass per choice; acc == argmax agreement with gold."""
    for row, k in ((copa_piqa[0], 6), (copa_piqa[1], 3)):
        raw = build_task(row.task).eval_docs
        for it in row.items[:k]:
            assert it.gold == raw[it.doc_id]["label"]                     # the item is the dataset's item
            mine = [_independent_loglikelihood(smollm2.model, smollm2.tokenizer, c, x) for c, x in it.requests]
            assert mine == pytest.approx(list(it.loglikelihoods), abs=2e-3)
            assert int(torch.tensor(mine).argmax()) == int(torch.tensor(it.loglikelihoods).argmax())
            assert it.metrics["acc"] == float(int(torch.tensor(mine).argmax()) == it.gold)
        # the row's value is the mean of its items' correctness
        assert row.value == pytest.approx(sum(
            float(max(range(len(i.loglikelihoods)), key=i.loglikelihoods.__getitem__) == i.gold)
            for i in row.items) / row.n)


@pytest.fixture(scope="module")
def copa10(smollm2):
    return run_suite(smollm2.model, smollm2.tokenizer, ["copa"], limit=10, keep_items=True)[0]


def test_same_call_gives_the_same_numbers(smollm2, copa10):
    again = run_suite(smollm2.model, smollm2.tokenizer, ["copa"], limit=10, keep_items=True)[0]
    assert again == copa10                          # value, stderr, n, fingerprints (items/time not compared)
    assert [i.loglikelihoods for i in again.items] == [i.loglikelihoods for i in copa10.items]


class _ZeroFFN(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


def test_the_model_object_given_is_the_one_scored(smollm2, copa10):
    """A swapped module (as sparse execution does) changes the scores of the same items."""
    layers = smollm2.adapter.decoder_layers(smollm2.model)
    orig = layers[3].mlp
    layers[3].mlp = _ZeroFFN()
    try:
        swapped = run_suite(smollm2.model, smollm2.tokenizer, ["copa"], limit=10, keep_items=True)[0]
    finally:
        layers[3].mlp = orig
    assert swapped.items_fingerprint == copa10.items_fingerprint          # same items, same prompts
    diffs = [abs(a - b) for s, d in zip(swapped.items, copa10.items)
             for a, b in zip(s.loglikelihoods, d.loglikelihoods)]
    assert max(diffs) > 0.1


@pytest.mark.slow
def test_every_registered_task_scores_a_few_items(smollm2):
    rows = run_suite(smollm2.model, smollm2.tokenizer, list(SUITES), limit=3, keep_items=True)
    assert {r.task for r in rows} == set(SUITES)
    for r in rows:
        assert r.n == 3 and 0.0 <= r.value <= 1.0
        assert all(0 <= it.gold < len(it.loglikelihoods) for it in r.items)
        assert all(x < 0 for it in r.items for x in it.loglikelihoods)


@pytest.mark.slow
def test_cli_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert suites_cli.main(["--tasks", "copa", "--limit", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "copa" in text and "acc" in text
    payload = json.loads(out.read_text())
    assert payload["rows"][0]["task"] == "copa" and payload["rows"][0]["n"] == 4
