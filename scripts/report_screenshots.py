"""Screenshots of `commfuse report` for the docs (docs/images/report-*.png).

Runs the plain-TP Llama example (2 layers) on 2 gloo ranks with dumps, predicted timelines and the
runtime recorder (one warm-up step, two recorded), renders the HTML report with the measured
section and photographs its sections in headless Chromium (Playwright driving /usr/bin/chromium).

    python scripts/report_screenshots.py [--out docs/images] [--keep DIR]

Needs Graphviz (`dot`), Chromium and the playwright package (`.ci/run` installs all three).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "tests")):  # the example jobs live with the tests
    if p not in sys.path:
        sys.path.insert(0, p)

SECTIONS = ("summary", "graphs", "timelines", "validation")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    ap.add_argument("--keep", type=Path, help="also keep the dumps, traces and report.html here")
    ap.add_argument("--example", default="llama_tp")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument(
        "--profile",
        type=Path,
        default=REPO / "benchmarks" / "results" / "cpu-gloo-profile-2026-11-22.json",
        help="cost profile for predicted times (default: the stored calibration of this CPU machine)",
    )
    args = ap.parse_args(argv)

    from playwright.sync_api import sync_playwright

    from _jobs_reports import record_example
    from commfuse.reports.html import write_html
    from commfuse.tools.rank_pool import RankPool

    work = Path(tempfile.mkdtemp(prefix="commfuse-report-"))
    with RankPool(args.ranks, timeout_s=600) as pool:
        pool.run(record_example, args.example, str(work), 2, True, 60, str(args.profile), timeout=600)
    page_path = write_html(
        work / "dumps",
        work / "report.html",
        record_dir=work / "record",
        profile=args.profile,
        title=f"commfuse report: {args.example} on {args.ranks} gloo ranks",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(page_path.as_uri(), wait_until="load")
        for section in SECTIONS:
            page.locator(f"h2#{section}").scroll_into_view_if_needed()
            page.evaluate(f"document.getElementById('{section}').scrollIntoView()")
            path = args.out / f"report-{section}.png"
            page.screenshot(path=str(path))
            print(path)
        browser.close()
    if args.keep:
        shutil.copytree(work, args.keep, dirs_exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
