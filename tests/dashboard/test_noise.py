"""The noise rule of the accuracy comparison (setting beside dense), on hand-built store rows."""
from __future__ import annotations

import math
from datetime import datetime, timezone

import pytest

from dashboard import data
from db.schemas import AccuracyRecord


def _row(unit: str, method: str, task: str, metric: str, value: float, stderr: float | None, n: int = 500,
         suite: str = "mc") -> AccuracyRecord:
    return AccuracyRecord(unit_id=unit, model_id=1, model_name="m", method=method, sparsity=0.5, rank=None,
                          attn_sparsity=None, suite=suite, task=task, metric=metric, higher_is_better=True,
                          value=value, stderr=stderr, n=n, git_rev="x", package_versions={},
                          created_at=datetime(2025, 1, 1, tzinfo=timezone.utc))


def _binomial_se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / (n - 1))


def test_beyond_noise_rule():
    # 0.10 apart with se 0.02 each: 2*sqrt(2)*0.02 = 0.0566 < 0.10 -> beyond noise
    assert data.beyond_noise(0.60, 0.02, 0.50, 0.02) is True
    # 0.05 apart: < 0.0566 -> within noise
    assert data.beyond_noise(0.55, 0.02, 0.50, 0.02) is False
    # noise 2*sqrt(2)*se = 0.06 here: just under it is within, just over is beyond, either sign
    se = 0.03 / math.sqrt(2)
    assert data.beyond_noise(0.50, se, 0.5599, se, k=2.0) is False
    assert data.beyond_noise(0.50, se, 0.5601, se, k=2.0) is True
    assert data.beyond_noise(0.5601, se, 0.50, se, k=2.0) is True
    assert data.beyond_noise(0.6, None, 0.5, 0.01) is None          # no stderr: undecided, never "yes"


def test_compare_accuracy_pairs_rows_with_dense():
    # PIQA-sized: 1838 items at 0.64 vs 0.60 -> se ~0.0112 / 0.0114: noise 2*0.016 = 0.032 < 0.04: beyond
    # COPA-sized: 100 items at 0.64 vs 0.60 -> se ~0.048 / 0.049: noise 0.137 > 0.04: within
    sparse = [_row("e1", "svd", "piqa", "acc", 0.64, _binomial_se(0.64, 1838), 1838),
              _row("e2", "svd", "copa", "acc", 0.64, _binomial_se(0.64, 100), 100),
              _row("e3", "svd", "lambada-heldout", "ppl", 40.0, None, 2048, suite="perplexity"),
              _row("e3", "svd", "lambada-heldout", "mlp_sparsity", 0.5, None, 2048, suite="perplexity"),
              _row("e4", "svd", "sciq", "acc", 0.7, 0.02)]
    dense = [_row("d1", "dense", "piqa", "acc", 0.60, _binomial_se(0.60, 1838), 1838),
             _row("d2", "dense", "copa", "acc", 0.60, _binomial_se(0.60, 100), 100),
             _row("d3", "dense", "lambada-heldout", "ppl", 37.4, None, 2048, suite="perplexity")]
    got = {r["metric"]: r for r in data.compare_accuracy(sparse, dense)}
    assert set(got) == {"mc/piqa/acc", "mc/copa/acc", "perplexity/lambada-heldout/ppl", "mc/sciq/acc"}
    assert got["mc/piqa/acc"]["beyond_noise"] is True and got["mc/piqa/acc"]["diff"] == pytest.approx(0.04)
    assert got["mc/copa/acc"]["beyond_noise"] is False
    assert got["perplexity/lambada-heldout/ppl"]["beyond_noise"] is None       # no stderr on ppl rows
    assert got["mc/sciq/acc"]["dense"] is None and got["mc/sciq/acc"]["beyond_noise"] is None   # dense lacks it
    assert got["mc/copa/acc"]["stderr"] == pytest.approx(_binomial_se(0.64, 100))
