"""``python -m dashboard.screenshots`` without a browser (the default suite; the drawn pages are the browser test's):
a published result set loaded into a new store names its models, and a missing result set or a missing Chromium is
one error line and exit status 2, before anything is loaded or started."""
from pathlib import Path

from dashboard.screenshots import _load, main

ROWS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200-smollm2.jsonl"


def test_a_result_set_loads_into_a_new_store_with_its_models(tmp_path):
    assert _load(ROWS, f"sqlite:///{tmp_path / 'rows.db'}") == ["smollm2-135m"]


def test_a_missing_result_set_or_chromium_is_refused(tmp_path, capsys):
    assert main([str(tmp_path / "none.jsonl"), str(tmp_path / "x")]) == 2
    assert f"error: no result set at {tmp_path / 'none.jsonl'}" in capsys.readouterr().err
    assert main([str(ROWS), str(tmp_path / "x"), "--chromium", str(tmp_path / "no-chromium")]) == 2
    assert "error: no Chromium at" in capsys.readouterr().err
    assert not list(tmp_path.glob("x*"))
