"""The dashboard in a real browser: Debian's chromium driven by Playwright loads the Pareto page of a running
``streamlit run dashboard/app.py``, selects the model, and the chart and the front table render with no error
(``dashboard.screenshots``, which also writes a result set's pages as PNG files). The screenshot is kept under
``tests/artifacts/`` (``make test-browser``)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dashboard.screenshots import CHROMIUM

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
pytestmark = pytest.mark.browser


def _ensure_chromium() -> str:
    if not Path(CHROMIUM).exists() and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], check=False, capture_output=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=900)
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (make test-browser does it)")
    return CHROMIUM


@pytest.fixture
def dashboard_server(sweep_dbs, tmp_path):
    from dashboard.screenshots import serve

    log = tmp_path / "streamlit.log"
    with serve(sweep_dbs.full, log) as base:
        yield base, log


def test_pareto_page_in_chromium(dashboard_server):
    from playwright.sync_api import sync_playwright

    from dashboard.screenshots import pareto_shot

    base, log = dashboard_server
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / ".gitignore").write_text("*\n")
    shot = ARTIFACTS / "dashboard_pareto.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_ensure_chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1700})
            pareto_shot(page, base, "smollm2-135m", None, shot)     # raises on an error or no latency rows
            assert page.get_by_role("heading", name="Front", exact=True).is_visible()
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    assert "Traceback" not in log.read_text()


def test_screenshots_of_a_result_set(sweep_dbs, tmp_path, capsys):
    """``python -m dashboard.screenshots``: a result set exported from the sweep's store, loaded into a new one, and
    each model's Pareto page written as a PNG; a missing file and a device without latency rows are errors."""
    from db.__main__ import main as db_main
    from dashboard.screenshots import main

    rows = tmp_path / "rows.jsonl"
    assert db_main(["export", "tiny-test", str(rows), sweep_dbs.full]) == 0     # the newest: it has latency
    chromium = _ensure_chromium()
    assert main([str(rows), str(tmp_path / "shot"), "--device", "cpu", "--chromium", chromium]) == 0
    shots = sorted(tmp_path.glob("shot-*.png"))
    assert [p.name for p in shots] == ["shot-smollm2-135m-cpu.png"] and shots[0].stat().st_size > 10_000
    assert "smollm2-135m: " in capsys.readouterr().out
    assert main([str(rows), str(tmp_path / "none"), "--device", "cuda", "--chromium", chromium]) == 1
    assert "smollm2-135m has no latency rows on cuda: no front to draw" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.jsonl"), str(tmp_path / "x"), "--chromium", chromium]) == 2
