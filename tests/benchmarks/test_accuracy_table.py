"""benchmarks.accuracy_table on hand-built result sets: known means, standard errors, the assembled shard row, and
one table per model of a two-model set."""
from __future__ import annotations

import gzip
import json
import math

from benchmarks import accuracy_table


def _set(path):
    fit = {"id": "f1", "kind": "fit", "config": {"method": "teal", "sparsity": 0.4, "options": {}}}
    dense_fit = {"id": "f0", "kind": "fit", "config": {"method": "dense", "sparsity": 0.0}}
    evals = [{"id": f"e{i}", "kind": "eval", "config": {"fit_unit": f}} for i, f in enumerate(["f0", "f1"])]
    acc = []
    for unit, vals, ppl, wb in (("e0", (0.6, 0.4), 50.0, 0.0), ("e1", (0.5, 0.3), 55.0, 0.41)):
        for task, v in zip(("piqa", "hellaswag"), vals):
            acc.append({"unit_id": unit, "task": task, "metric": "acc_norm", "value": v, "stderr": 0.03, "n": 100})
            acc.append({"unit_id": unit, "task": task, "metric": "acc", "value": v - 0.1, "stderr": 0.03, "n": 100})
        # a shard's partial row (fewer items) must lose to the assembled one
        acc.append({"unit_id": unit, "task": "hellaswag", "metric": "acc_norm", "value": 0.9, "stderr": 0.1, "n": 25})
        acc.append({"unit_id": unit, "task": "lambada", "metric": "ppl", "value": ppl, "stderr": 0, "n": 8192})
        acc.append({"unit_id": unit, "task": "lambada", "metric": "weight_skipped", "value": wb, "stderr": 0,
                    "n": 8192})
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"format": "ctxsparse-resultset-1"}) + "\n")
        for t, rows in (("work_units", [fit, dense_fit, *evals]), ("accuracy_results", acc)):
            for r in rows:
                f.write(json.dumps({"table": t, "row": r}) + "\n")


def test_table_of_a_hand_built_set(tmp_path, capsys):
    path = tmp_path / "set.jsonl.gz"
    _set(path)
    per = accuracy_table.settings(accuracy_table.read_rows(str(path)), ("piqa", "hellaswag"), "acc_norm")
    assert set(per) == {"?"}                                              # no models table: one model
    per = per["?"]
    assert set(per) == {"dense", "teal s=0.4"}
    assert per["teal s=0.4"]["hellaswag"][:3] == (0.3, 0.03, 100)        # the assembled row, acc_norm
    assert per["teal s=0.4"]["bytes"] == 0.41 and per["dense"]["ppl"] == 50.0
    m, se = accuracy_table.mean_se([(0.5, 0.03), (0.3, 0.03)])
    assert m == 0.4 and math.isclose(se, math.sqrt(2) * 0.03 / 2)
    assert accuracy_table.main([str(path), "--tasks", "piqa,hellaswag"]) == 0
    out = capsys.readouterr().out
    assert "| teal s=0.4 | 41.0 % | 55.00 (+10.0 %) | 50.0 (3.0) | 30.0 (3.0) | 40.00 (2.12) | -10.00 (3.00) |" in out
    assert accuracy_table.main([str(path), "--tasks", "piqa,hellaswag", "--metric", "acc"]) == 0
    assert "| dense | 0.0 % | 50.00 | 50.0 (3.0) | 30.0 (3.0) |" in capsys.readouterr().out


def test_bad_input_is_an_error(tmp_path, capsys):
    assert accuracy_table.main([str(tmp_path / "missing.jsonl")]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"format": "ctxsparse-resultset-1"}) + "\n")
    assert accuracy_table.main([str(empty)]) == 2
    assert "no accuracy rows" in capsys.readouterr().err


def test_a_two_model_set_gives_a_table_per_model(tmp_path, capsys):
    """Both models' dense rows share a setting name: each model's table has its own, never the other's."""
    units = [{"id": f"f{m}", "kind": "fit", "model_id": m, "config": {"method": "dense", "sparsity": 0.0}}
             for m in (1, 2)]
    units += [{"id": f"e{m}", "kind": "eval", "model_id": m, "config": {"fit_unit": f"f{m}"}} for m in (1, 2)]
    acc = [{"unit_id": f"e{m}", "task": "piqa", "metric": "acc", "value": v, "stderr": 0.01, "n": 10}
           for m, v in ((1, 0.6), (2, 0.7))]
    path = tmp_path / "two.jsonl"
    with open(path, "w") as f:
        for t, rows in (("models", [{"id": 1, "name": "small"}, {"id": 2, "name": "large"}]),
                        ("work_units", units), ("accuracy_results", acc)):
            for r in rows:
                f.write(json.dumps({"table": t, "row": r}) + "\n")
    per = accuracy_table.settings(accuracy_table.read_rows(str(path)), ("piqa",), "acc")
    assert {m: per[m]["dense"]["piqa"][0] for m in per} == {"small": 0.6, "large": 0.7}
    assert accuracy_table.main([str(path), "--tasks", "piqa", "--metric", "acc"]) == 0
    out = capsys.readouterr().out
    assert out.index("large") < out.index("70.0 (1.0)") < out.index("small") < out.index("60.0 (1.0)")
