"""Time from running a cell that shows the dashboard to its figures drawn in a real page.

A JupyterLab server and headless Chromium (as the browser tests start them); a notebook whose
second cell displays ``Dashboard(TelemetryStore(2))`` (no ranks: what is timed is the page). The
clock starts as the cell is run and stops when every plotly figure has drawn its title. Baseline:
plotly's own front-end module in every figure (``ipycompat_plotly.SHARE = False``), runs
interleaved, a fresh page and kernel each; medians. Also printed: the text the figures' opening
messages carried (their ``_esm``, and the bundle's widget).

    python benchmarks/bench_dashboard_page.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _browser import launch_options, write_settings  # the tests' own helpers
from _jupyter import JupyterLab, wait_for

KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}
CELL = """import distlab.ipycompat_plotly as shared
shared.SHARE = {share}
from distlab.dashboard.store import TelemetryStore
from distlab.dashboard.view import Dashboard
board = Dashboard(TelemetryStore(2))
sent = sum(len(f.get_state().get("_esm", "")) for f in board.figures.values())
sent += len(shared._bundle.bundle) if shared._bundle is not None else 0
print("SENT", sent)
board"""
TITLED = "document.querySelectorAll('.js-plotly-plot .gtitle').length"


def one_run(share: bool) -> tuple[float, int]:
    from playwright.sync_api import sync_playwright

    tmp = Path(tempfile.mkdtemp(prefix="bench-dashboard-page-"))
    root = tmp / "notebooks"
    root.mkdir()
    cells = [nbformat.v4.new_code_cell("pass"), nbformat.v4.new_code_cell(CELL.format(share=share))]
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": KERNEL}), root / "d.ipynb")
    jupyter = JupyterLab(root, tmp / "jupyter")
    write_settings(Path(jupyter.env["JUPYTERLAB_SETTINGS_DIR"]))
    with jupyter, sync_playwright() as pw:
        browser = pw.chromium.launch(**launch_options())
        try:
            page = browser.new_context(viewport={"width": 1500, "height": 1000}).new_page()
            page.set_default_timeout(300_000)
            page.goto(f"{jupyter.url}/lab/tree/d.ipynb?token={jupyter.token}")
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(timeout=90_000)
            wait_for(lambda: jupyter.kernel_idle("d.ipynb"), 90, "the kernel to be ready")
            page.locator(".jp-CodeCell").nth(1).click()
            t0 = time.monotonic()
            page.keyboard.press("Shift+Enter")
            output = page.locator(".jp-CodeCell").nth(1).locator(".jp-OutputArea")
            output.get_by_text(re.compile(r"^SENT \d+")).wait_for()
            expected = page.locator(".jp-CodeCell").nth(1).locator(".js-plotly-plot")
            wait_for(lambda: expected.count() >= 6, 300, "the figures' plots to be made")
            page.wait_for_function(f"() => {TITLED} >= {expected.count()}", timeout=300_000)
            seconds = time.monotonic() - t0
            sent = int(output.inner_text().split("SENT")[1].split()[0])
            return seconds, sent
        finally:
            browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[bool, list[float]] = {False: [], True: []}
    sent: dict[bool, int] = {}
    for _ in range(args.repeats):
        for share in (False, True):
            seconds, sent[share] = one_run(share)
            times[share].append(seconds)
    print("| figures' front end | cell run -> every figure drawn (median s) | runs | module text sent (MB) |")
    print("|---|---|---|---|")
    for share in (False, True):
        what = "plotly's bundle imported once per page (shared)" if share else "plotly's bundle in every figure (before)"
        runs = ", ".join(f"{t:.2f}" for t in times[share])
        print(f"| {what} | {statistics.median(times[share]):.2f} | {runs} | {sent[share] / 1e6:.2f} |")


if __name__ == "__main__":
    main()
