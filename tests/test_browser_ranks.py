"""What a rank shows, a person sees: in JupyterLab, in headless Chromium, cells whose ranks display
HTML and a matplotlib figure, run a tqdm loop, drive a widget they made, train under the live
dashboard and fail; then `%dist debug`; then the saved notebook, reopened and converted with no
lab running, still shows the displays, the bars as text and the dashboard's picture.
Screenshots go to test-artifacts/browser/.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from _browser import browser_page, jupyterlab, press_run, shot
from _jupyter import JupyterLab, wait_for

pytestmark = pytest.mark.cluster

NAME = "ranks-show.ipynb"
SEEN = "dashboard-seen"  # made in the notebooks' folder once the live plot is seen: the training cell may end
CELL_DEADLINE_MS = 180_000
WIDGET = "application/vnd.jupyter.widget-view+json"

CELLS = [
    """%load_ext distlab
%dist start -n 2
""",
    # rich displays
    """%%ddp
from IPython.display import HTML, display
import matplotlib.pyplot as plt
display(HTML(f"<p class='from-rank'>html from rank {rank}</p>"))
if rank == 0:
    plt.plot([0, 1, 4, 9])
    plt.show()
""",
    # progress bars
    """%%ddp
import time
from tqdm.auto import tqdm
for _ in tqdm(range(60), desc='train'):
    time.sleep(0.05)
""",
    # a widget made on a rank, moved by the rank
    """%%ddp -r 0
import time
import ipywidgets as w
slider = w.IntSlider(value=0, max=10, description='from rank 0')
display(slider)
for v in range(1, 11):
    slider.value = v
    time.sleep(0.3)
""",
    # training under the live dashboard: 200 steps, and on until the test has seen the plot in the
    # page (it makes SEEN_FILE; at most 4 minutes), so a loaded machine cannot end the cell first.
    # Both ranks agree each step on whether to go on (an all-reduce of the flag), as DDP needs.
    """%%ddp
import os, time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(torch.nn.Linear(16, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
deadline = time.monotonic() + 240
with distlab.watch(model):
    step, go_on = 0, True
    while go_on:
        opt.zero_grad()
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        opt.step()
        distlab.log(loss=loss)
        time.sleep(0.05)
        step += 1
        waiting = step < 200 or not (os.path.exists(SEEN_FILE) or time.monotonic() > deadline)
        flag = torch.tensor([float(waiting)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        go_on = bool(flag.item())
""",
    # a failure on rank 1, inside a function
    """%%ddp
def scale(batch):
    weights = torch.ones(3, 4) * (rank + 1)
    if rank == 1:
        raise ValueError('bad batch on rank 1')
    return batch @ weights
scale(torch.ones(2, 3))
""",
    "%dist debug",
    "%dist stop",
]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[JupyterLab]:
    root = tmp_path / "notebooks"
    root.mkdir()
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(c.replace("SEEN_FILE", repr(str(root / SEEN)))) for c in CELLS],
        metadata={"kernelspec": kernel},
    )
    nbformat.write(notebook, root / NAME)
    with jupyterlab(tmp_path, "jupyter-ranks.log") as jupyter:
        yield jupyter


page = browser_page("ranks-last.png")


class Cells:
    """The open notebook's code cells, started and awaited as a person runs them."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.runs = 0

    def cell(self, i: int) -> Any:
        return self.page.locator(".jp-NotebookPanel .jp-CodeCell").nth(i)

    def start(self, i: int) -> Any:
        """Select cell ``i`` and press Shift+Enter; its output area, while it runs."""
        prompt = self.cell(i).locator(".jp-InputArea .jp-InputPrompt").first
        press_run(self.page, prompt)
        self.runs += 1
        return self.cell(i).locator(".jp-OutputArea")

    def finish(self, i: int) -> Any:
        self.cell(i).locator(".jp-InputArea .jp-InputPrompt").first.filter(has_text=f"[{self.runs}]").wait_for(
            timeout=CELL_DEADLINE_MS
        )
        return self.cell(i).locator(".jp-OutputArea")

    def run(self, i: int) -> Any:
        self.start(i)
        return self.finish(i)


def test_what_ranks_display_shows_live_and_stays_in_the_saved_notebook(server: JupyterLab, page: Any) -> None:
    jupyter = server
    page.goto(f"{jupyter.url}/lab/tree/{NAME}?token={jupyter.token}")
    page.locator(".jp-NotebookPanel .jp-CodeCell").first.wait_for()
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(timeout=90_000)
    wait_for(lambda: jupyter.kernel_idle(NAME), 90, "the notebook's kernel to be ready")
    cells = Cells(page)
    assert "2 ranks ready" in cells.run(0).inner_text()

    shown = cells.run(1)
    # Each rank's displays as they arrive: rank 1's can come a poll before rank 0's (ranks are in order
    # within a poll only, as test_rank_display says).
    assert sorted(shown.locator("p.from-rank").all_inner_texts()) == ["html from rank 0", "html from rank 1"]
    figure = shown.locator("img").first
    assert figure.evaluate("img => img.complete && img.naturalWidth") > 100  # matplotlib's figure
    assert re.search(r"\[rank 0\]", shown.inner_text())

    # tqdm on both ranks: a bar per rank while it runs, text when it ends.
    bars = cells.start(2)
    bars.locator(".progress-bar, .widget-progress").first.wait_for(timeout=60_000)
    ended = cells.finish(2).inner_text()
    assert re.search(r"rank 0.*60/60", ended) and re.search(r"rank 1.*60/60", ended), ended

    # The slider rank 0 made shows in the page and follows the rank's changes.
    slider = cells.run(3).locator(".widget-slider")
    slider.wait_for()
    slider.locator(".widget-readout").filter(has_text=re.compile(r"^\s*10\s*$")).wait_for(timeout=30_000)
    shot(page, "ranks-1-displays")

    # The live dashboard (plotly in the page, data plotted) while the cell trains; its picture after.
    training = cells.start(4)
    plots = training.locator(".js-plotly-plot")
    plots.first.wait_for(timeout=120_000)
    # A line drawn in a plot: what a person sees of the loss (plotly draws a trace as an SVG path).
    lines = "[...area.querySelectorAll('.js-plotly-plot .scatterlayer path.js-line')]"
    try:
        page.wait_for_function(
            f"area => {lines}.some(path => (path.getAttribute('d') || '').length > 20)",
            arg=training.element_handle(),
            timeout=120_000,
        )
    except Exception as e:  # playwright's TimeoutError: say what the page had instead
        drawn = training.evaluate(
            "area => [...area.querySelectorAll('.js-plotly-plot')].map(plot => "
            "[(plot.querySelector('.gtitle') || {}).textContent, "
            "[...plot.querySelectorAll('.scatterlayer path.js-line')].map(p => (p.getAttribute('d') || '').length)])"
        )
        raise AssertionError(f"no line drawn in the live dashboard: (title, path lengths) {drawn}; "
                             f"page errors {page.js_errors}, console errors {page.console_errors}") from e  # type: ignore[attr-defined]
    shot(page, "ranks-2-dashboard-live")
    (server.root / SEEN).touch()
    training = cells.finish(4)
    picture = training.locator(".jp-RenderedImage img")
    picture.wait_for()
    assert picture.evaluate("img => img.complete && img.naturalWidth") == 880  # the dashboard's picture

    failed = cells.run(5).inner_text()
    assert "bad batch on rank 1" in failed, failed
    debug = cells.run(6).inner_text()
    assert "rank 1" in debug and "scale" in debug and "weights" in debug, debug
    assert re.search(r"\(3, 4\).*float32|float32.*\(3, 4\)", debug), debug
    shot(page, "ranks-3-debug")
    assert "lab stopped" in cells.run(7).inner_text()

    # Saved, the notebook keeps what was shown, with no widget needed for the bars or the dashboard.
    page.keyboard.press("Control+s")
    path = jupyter.root / NAME

    def saved() -> Any:
        try:
            nb = json.loads(path.read_text())
        except json.JSONDecodeError:  # read while the server was writing it (empty or cut): poll again
            return None
        return nb if nb["cells"][7].get("outputs") else None

    nb = wait_for(saved, 30, "the notebook to be saved with its outputs")
    outputs = [c["outputs"] for c in nb["cells"]]
    assert not any(WIDGET in o.get("data", {}) for o in outputs[2] + outputs[4]), outputs[2] + outputs[4]
    assert any("image/png" in o.get("data", {}) for o in outputs[4])

    html = subprocess.run(
        [sys.executable, "-m", "nbconvert", "--to", "html", "--stdout", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "html from rank 1" in html and "60/60" in html
    assert html.count("data:image/png;base64") >= 2  # the rank's figure and the dashboard's picture

    # Reopened (the lab long stopped; the page reloaded from the saved file), the picture renders.
    page.reload()
    reopened = Cells(page).cell(4).locator(".jp-OutputArea")
    picture = reopened.locator(".jp-RenderedImage img")
    picture.wait_for(timeout=60_000)
    assert picture.evaluate("img => img.complete && img.naturalWidth") == 880  # the dashboard's picture
    assert "Error displaying widget" not in reopened.inner_text()
    shot(page, "ranks-4-reopened")
    assert page.js_errors == []  # type: ignore[attr-defined]
