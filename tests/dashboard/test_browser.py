"""The dashboard in a real browser: Debian's chromium driven by Playwright loads the Pareto page of a running
``streamlit run dashboard/app.py``, selects the model, and the chart and the front table render with no error.
The screenshot is kept under ``tests/artifacts/`` (``make test-browser``)."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.dashboard.conftest import APP

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
pytestmark = pytest.mark.browser


def _ensure_chromium() -> str:
    if not Path(CHROMIUM).exists() and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], check=False, capture_output=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=900)
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (make test-browser does it)")
    return CHROMIUM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, proc: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            pytest.fail(f"streamlit exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"streamlit not healthy after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def dashboard_server(sweep_dbs, tmp_path):
    port = _free_port()
    log = tmp_path / "streamlit.log"
    env = {**os.environ, "CTXSPARSE_DB_URL": sweep_dbs.full}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", APP, "--server.address", "127.0.0.1", "--server.port",
             str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false"],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=Path(APP).parents[1])
    try:
        _wait_healthy(port, proc, log)
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_pareto_page_in_chromium(dashboard_server):
    from playwright.sync_api import expect, sync_playwright

    base, log = dashboard_server
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / ".gitignore").write_text("*\n")
    shot = ARTIFACTS / "dashboard_pareto.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_ensure_chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1700})
            page.goto(f"{base}/pareto", wait_until="domcontentloaded")
            expect(page.get_by_role("heading", name="Pareto front")).to_be_visible(timeout=60_000)

            # select the model in the "Model" selectbox
            model_box = page.get_by_role("combobox", name="Model")
            model_box.click()
            page.get_by_role("option", name=re.compile(r"smollm2-135m")).click()
            expect(model_box).to_have_value(re.compile(r"smollm2-135m"))

            chart = page.get_by_test_id("stVegaLiteChart")
            expect(chart).to_have_count(1, timeout=60_000)
            expect(chart.locator("canvas, svg").first).to_be_visible(timeout=60_000)
            expect(page.get_by_role("heading", name="Front", exact=True)).to_be_visible()
            tables = page.get_by_test_id("stDataFrame")
            expect(tables).to_have_count(2, timeout=60_000)          # the front, all settings
            expect(tables.first).to_be_visible()
            page.get_by_role("heading", name="Pareto front").click()   # focus off the selectbox
            page.wait_for_timeout(1500)                             # let the grid and the chart paint
            page.screenshot(path=str(shot), full_page=True)

            assert page.get_by_test_id("stException").count() == 0
            body = page.inner_text("body")
            for bad in ("Traceback", "Error:", "Exception"):
                assert bad not in body, f"{bad!r} on the page:\n{body[:3000]}"
            assert "no latency rows" not in body
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    assert "Traceback" not in log.read_text()
