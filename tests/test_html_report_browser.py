"""`commfuse report` opened in a real headless browser (Chromium from Debian's packages, driven by
Playwright's Python package; no browser download).

The page must load from disk without console errors, show every section, list collectives,
display every embedded picture, and show planted markup (``<script>`` in a refusal, a group
name and a trace event) as text without running it. Skipped locally when Chromium or
Playwright is missing; under CI (``CI`` set) their absence is a failure, because `.ci/run`
installs both.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from commfuse.reports.html import write_html

from test_reports import HOSTILE, compile_dumped, plant_hostile_names

CHROMIUM = "/usr/bin/chromium"


def _browser_or_skip():
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
        missing.append("the playwright Python package (pip install -e '.[test]')")
    if not Path(CHROMIUM).exists():
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    if missing:
        reason = "browser test needs " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(reason + "; .ci/run installs them", pytrace=False)
        pytest.skip(reason)
    return sync_playwright


@pytest.fixture(scope="module")
def page_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("browser")
    compile_dumped(d / "dumps")
    hostile = d / "hostile"
    shutil.copytree(d / "dumps", hostile)
    plant_hostile_names(hostile)
    return write_html(hostile, d / "report.html", title=f"report {HOSTILE}")


@pytest.mark.slow(reason="starts headless Chromium")
def test_report_page_in_chromium(page_path):
    sync_playwright = _browser_or_skip()
    console, dialogs, failed = [], [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.on("requestfailed", lambda r: failed.append(r.url))
            page.goto(page_path.as_uri(), wait_until="load")
            headings = page.locator("h2").all_inner_texts()
            rows = page.locator("table.collectives tr.collective")
            row_text = rows.first.inner_text()
            n_rows = rows.count()
            images = page.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth])")
            scripts = page.evaluate("document.querySelectorAll('script').length")
            body = page.inner_text("body")
            title = page.title()
            timelines = page.locator("svg.timeline").count()
        finally:
            browser.close()
    assert console == [], console
    assert dialogs == [] and failed == []
    assert headings == ["Summary", "Communication volume", "Collectives", "Pass decisions", "Graphs", "Timelines"]
    assert n_rows > 0 and ("all_gather" in row_text or "reduce_scatter" in row_text), row_text
    assert images and all(ok and w > 0 for ok, w in images), images  # every graph picture decoded
    assert timelines == 2
    # planted markup is shown as text, never run
    assert scripts == 0
    assert HOSTILE in body and HOSTILE in title
