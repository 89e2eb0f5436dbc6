"""The dashboard's Pareto page of every model of a result set, as PNG files, drawn by a real browser:

    python -m dashboard.screenshots ROWS.jsonl OUT_PREFIX [--device cuda] [--chromium PATH]

The rows (a ``python -m db export`` file) are loaded into a new SQLite store in a temporary folder, ``streamlit run
dashboard/app.py`` serves it, and Chromium (through Playwright) opens the Pareto page, picks each model and the
device type, waits for the chart and the tables, and writes ``OUT_PREFIX-<model>-<device>.png``. A page that shows
an error, or a model without latency rows on that device, is an error (exit status 1), after the other models.
``serve`` and ``pareto_shot`` are what the browser test (tests/dashboard/test_browser.py) drives too.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

APP = Path(__file__).resolve().parent / "app.py"
CHROMIUM = "/usr/bin/chromium"
PAGE_ERRORS = ("Traceback", "Error:", "Exception")


class PageError(RuntimeError):
    """The page did not render what it should (an error on it, no chart, no latency rows)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(db_url: str, log: Path, timeout: float = 90.0):
    """``streamlit run dashboard/app.py`` on a free local port over the store ``db_url``, its output in ``log``;
    yields the base URL once the server answers its health check (RuntimeError, with the log's tail, if it exits or
    does not answer within ``timeout`` s); stopped on leaving."""
    port = _free_port()
    env = {**os.environ, "CTXSPARSE_DB_URL": db_url}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", str(APP), "--server.address", "127.0.0.1", "--server.port",
             str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false"],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=APP.parents[1])
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if time.time() - t0 > timeout:
                raise RuntimeError(f"streamlit not healthy after {timeout:.0f} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def pareto_shot(page, base: str, model: str, device: str | None, path: Path) -> str:
    """On a Playwright ``page``: the Pareto page of ``model`` (its name in the picker) on ``device`` (None: the
    page's default), the chart and the tables rendered, a full-page screenshot at ``path``; returns the page's
    text. PageError if the model has no latency rows there (no front) or the page shows an error; a Playwright
    AssertionError if the chart or the tables do not render."""
    from playwright.sync_api import expect

    page.goto(f"{base}/pareto", wait_until="domcontentloaded")
    expect(page.get_by_role("heading", name="Pareto front")).to_be_visible(timeout=60_000)
    box = page.get_by_role("combobox", name="Model")
    box.click()
    label = re.compile(rf"^{re.escape(model)} \(")                    # the picker's "name (fingerprint)"
    page.get_by_role("option", name=label).first.click()
    expect(box).to_have_value(label)
    if device is not None:
        dev = page.get_by_role("combobox", name="Device type")
        dev.click()
        page.get_by_role("option", name=re.compile(rf"^{re.escape(device)}\b")).first.click()
        expect(dev).to_have_value(re.compile(rf"^{re.escape(device)}\b"))
        # the page drawn for that device: its front's caption, or the note that it has no latency rows
        drawn = re.compile(rf"p50 ms per token on {re.escape(device)} ·|no latency rows for this device type")
        expect(page.get_by_text(drawn).first).to_be_visible(timeout=60_000)
    chart = page.get_by_test_id("stVegaLiteChart")
    expect(chart).to_have_count(1, timeout=60_000)
    expect(chart.locator("canvas, svg").first).to_be_visible(timeout=60_000)
    if "no latency rows" in page.inner_text("body"):
        raise PageError(f"{model} has no latency rows on {device or 'the default device type'}: no front to draw")
    expect(page.get_by_role("heading", name="All settings")).to_be_visible(timeout=60_000)
    expect(page.get_by_test_id("stDataFrame").nth(1)).to_be_visible(timeout=60_000)  # the front, (baselines,) all
    page.get_by_role("heading", name="Pareto front").click()                         # focus off the selectboxes
    page.wait_for_timeout(1500)                                                      # the grid and chart paint
    page.screenshot(path=str(path), full_page=True)
    body = page.inner_text("body")
    if page.get_by_test_id("stException").count() or any(bad in body for bad in PAGE_ERRORS):
        raise PageError(f"{model}: the page shows an error:\n{body[:3000]}")
    return body


def _load(rows: Path, db_url: str) -> list[str]:
    """The result set into a new store; the names of its models, in the order they were stored."""
    from db.store import Store

    store = Store(db_url)
    store.migrate()
    store.load_result_set(rows)
    names = [m.name for m in sorted(store.models(), key=lambda m: m.id)]
    store.close()
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dashboard.screenshots", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", type=Path, help="a result set (python -m db export)")
    ap.add_argument("out_prefix", help="PNG files OUT_PREFIX-<model>-<device>.png")
    ap.add_argument("--device", default="cuda", help="the device type whose latency the fronts are drawn on")
    ap.add_argument("--chromium", default=os.environ.get("CHROMIUM", CHROMIUM))
    a = ap.parse_args(argv)
    if not a.rows.is_file():
        print(f"error: no result set at {a.rows}", file=sys.stderr)
        return 2
    if not Path(a.chromium).exists():
        print(f"error: no Chromium at {a.chromium} (apt-get install chromium, or --chromium PATH)", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    failed = 0
    with tempfile.TemporaryDirectory(prefix="ctxsparse-shots-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'rows.db'}"
        models = _load(a.rows, url)
        with serve(url, Path(tmp) / "streamlit.log") as base, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=a.chromium, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 1700})
                for name in models:
                    path = Path(f"{a.out_prefix}-{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}-{a.device}.png")
                    try:
                        pareto_shot(page, base, name, a.device, path)
                        print(f"{name}: {path} ({path.stat().st_size} bytes)")
                    except (PageError, AssertionError) as e:
                        failed += 1
                        print(f"error: {e}", file=sys.stderr)
            finally:
                browser.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
