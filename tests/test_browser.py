"""What a person sees: the start-here notebook run cell by cell in JupyterLab, in headless Chromium.

A real JupyterLab server (free port, token), Debian's chromium driven by Playwright, the notebook's
cells run with Shift+Enter as a person runs them. Checked on the page: output labelled by rank, the
dashboard's last state (its picture), a quiz answered with the mouse and keyboard, the Distributed side panel
and status bar showing the lab's 2 ranks, the panel's Restart and Stop buttons, and the panel emptied by
``%dist stop``; no JavaScript error in the console. Screenshots go to test-artifacts/browser/.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from _browser import browser_page, jupyterlab, press_run, shot
from _jupyter import JupyterLab, wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "00-start-here.ipynb"
CELL_DEADLINE_MS = 180_000
# A wrong option leaves Check enabled, so each option is given this long to close the question; the
# verdict then has longer (a kernel answering widget messages slowly on a loaded CI machine, not a bug).
ANSWER_MS = 8_000
VERDICT_MS = 60_000


def _clean_copy(src: Path, dst: Path) -> list[str]:
    """Copy the notebook without outputs (what a person opens fresh); the code cells' sources."""
    nb = json.loads(src.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    dst.write_text(json.dumps(nb, indent=1))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[JupyterLab, list[str]]]:
    root = tmp_path / "notebooks"
    root.mkdir()
    sources = _clean_copy(NOTEBOOK, root / NOTEBOOK.name)
    with jupyterlab(tmp_path, "jupyter.log") as jupyter:
        yield jupyter, sources


page = browser_page("last.png")


class Notebook:
    """The open notebook, driven as a person drives it."""

    def __init__(self, page: Any, sources: list[str]) -> None:
        self.page = page
        self.sources = sources
        self.runs = 0  # a fresh kernel numbers executions 1, 2, ...

    def index(self, needle: str) -> int:
        """The code cell whose source contains ``needle``."""
        found = [i for i, s in enumerate(self.sources) if needle in s]
        assert found, f"no code cell of {NOTEBOOK.name} contains {needle!r}"
        return found[0]

    def cell(self, i: int) -> Any:
        return self.page.locator(".jp-NotebookPanel .jp-CodeCell").nth(i)

    def run(self, i: int) -> Any:
        """Select code cell ``i``, press Shift+Enter, wait for its execution number; its output area."""
        cell = self.cell(i)
        prompt = cell.locator(".jp-InputArea .jp-InputPrompt").first
        press_run(self.page, prompt)
        self.runs += 1
        prompt.filter(has_text=f"[{self.runs}]").wait_for(timeout=CELL_DEADLINE_MS)
        return cell.locator(".jp-OutputArea")

    def run_all_but_last(self) -> dict[int, Any]:
        return {i: self.run(i) for i in range(len(self.sources) - 1)}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _answer_quiz(quiz: Any) -> list[str]:
    """Answer every question with the mouse, as a person does; the verdict of each, as shown."""
    from playwright.sync_api import expect

    header = quiz.locator(".widget-html-content").first
    # (a button's accessible name starts with its icon's glyph: find buttons by their text)
    check = quiz.locator("button", has_text=re.compile(r"^\s*Check\s*$"))
    verdicts = []
    for _ in range(20):  # a bounded walk: at most 20 questions
        if "done" in header.inner_text():
            return verdicts
        # The header changes before the new question's controls replace the old, disabled ones (each
        # is its own widget, rendered when its message arrives): read the question once it is open.
        expect(quiz.locator("input:enabled, select:enabled").first).to_be_visible(timeout=VERDICT_MS)
        radios = quiz.locator(".widget-radio-box input[type=radio]:enabled")
        if radios.count():
            # Choose the options in turn and press Check until the page says it is right: a right
            # answer closes the question (Check greys out), a wrong one leaves it open.
            for k in range(radios.count()):
                radios.nth(k).check()
                check.click()
                try:
                    expect(check).to_be_disabled(timeout=ANSWER_MS)
                    break
                except AssertionError:
                    continue
            verdict = quiz.locator(".widget-html-content", has_text=re.compile(r"^\s*[✔✘]"))
        else:
            quiz.locator("button", has_text="Show answer").click()
            verdict = quiz.locator(".widget-html-content", has_text="The answer:")
        try:
            verdicts.append(verdict.first.inner_text(timeout=VERDICT_MS).strip())
        except Exception as error:  # playwright's TimeoutError: say what the page showed
            raise AssertionError(f"no verdict on the page; the quiz read:\n{quiz.inner_text()}") from error
        before = header.inner_text()
        quiz.locator("button", has_text=re.compile(r"^\s*(Next|Finish)\s*$")).click()
        expect(header).not_to_have_text(before, timeout=VERDICT_MS)
    raise AssertionError("the quiz did not finish within 20 questions")


def _panel_ranks(page: Any) -> list[dict[str, str]]:
    rows = page.locator("#distlab-panel .distlab-rank")
    return [
        dict(zip(("rank", "host", "pid", "device", "health"), rows.nth(i).locator("td").all_inner_texts()))
        for i in range(rows.count())
    ]


def _kernel_that_keeps_a_lab_and_dies(jupyter: JupyterLab) -> str:
    """A process of this server's user starts a kept lab and is killed; the lab's id."""
    out = jupyter.runtime_dir / "kept-kernel.out"
    code = ("import os, distlab\nfrom distlab.notebook import labs\nlab = distlab.start(ranks=2, keep=True)\n"
            "print('ID', labs.id_of(lab), flush=True)\nos.kill(os.getpid(), 9)")
    with open(out, "w") as f:  # not a pipe: the kept lab's processes would hold it open
        subprocess.run([sys.executable, "-c", code], env=jupyter.env, stdout=f, stderr=subprocess.STDOUT,
                       timeout=120, check=False)
    said = re.search(r"^ID (\S+)$", out.read_text(), re.MULTILINE)
    assert said is not None, out.read_text()[-2000:]
    return said.group(1)


def test_start_here_notebook_runs_in_chromium_and_the_side_panel_follows_its_lab(
    server: tuple[JupyterLab, list[str]], page: Any
) -> None:
    jupyter, sources = server
    page.goto(f"{jupyter.url}/lab/tree/{NOTEBOOK.name}?token={jupyter.token}")
    page.locator(".jp-NotebookPanel .jp-CodeCell").first.wait_for()
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(timeout=90_000)
    wait_for(lambda: jupyter.kernel_idle(NOTEBOOK.name), 90, "the notebook's kernel to be ready")
    nb = Notebook(page, sources)

    outputs = nb.run_all_but_last()

    # Output labelled by rank, streamed from both ranks.
    hello = outputs[nb.index("hello from rank")].inner_text()
    assert re.search(r"\[rank 0\] hello from rank 0 of 2", hello), hello
    assert re.search(r"\[rank 1\] hello from rank 1 of 2", hello), hello
    status = outputs[nb.index("%dist status")].inner_text()
    assert re.search(r"^rank\s+engine_id\s+host\s+addr\s+pid\s+device\s+backend\s+health", status, re.MULTILINE), status
    assert len(re.findall(r"\bgloo\s+ok\b", status)) == 2, status

    # Under the training cell, once it ended, the dashboard's last state: its picture (with its
    # summary), loaded (the live dashboard, plotly in the page, is tests/test_browser_ranks.py's).
    training = outputs[nb.index("distlab.watch(")]
    picture = training.locator(".jp-RenderedImage img")
    picture.wait_for()
    assert picture.evaluate("img => img.complete && img.naturalWidth") == 880  # the dashboard's picture
    assert "Error displaying widget" not in training.inner_text()
    training.scroll_into_view_if_needed()
    shot(page, "1-dashboard")

    # A failed rank is named in the error a person reads.
    failure = outputs[nb.index("corrupt shard")].inner_text()
    assert "rank 1" in failure and "ValueError: rank 1 read a corrupt shard" in failure, failure

    # The quiz, answered through the page.
    quiz = outputs[nb.index("%quiz")]
    verdicts = _answer_quiz(quiz)
    assert verdicts and all(v.startswith(("✔", "✘", "The answer:")) for v in verdicts), verdicts
    assert any(v.startswith("✔") for v in verdicts), verdicts  # a right answer, graded in Python
    assert re.search(r"\d+ of \d+ right at the first try", quiz.inner_text())
    quiz.scroll_into_view_if_needed()
    shot(page, "2-quiz")

    # The Distributed side panel and the status bar show this notebook's lab.
    page.locator(".jp-SideBar .lm-TabBar-tab[data-id='distlab-panel']").click()
    lab = page.locator("#distlab-panel .distlab-lab[data-world-size='2']")
    lab.wait_for()
    assert lab.locator(".distlab-notebook").inner_text() == NOTEBOOK.name
    assert "2 ranks · gloo" in lab.locator(".distlab-summary").inner_text()
    assert re.search(r"steps/s · all-reduce \d+\.\d+ ms/step", lab.locator(".distlab-training").inner_text())
    ranks = _panel_ranks(page)
    assert [(r["rank"], r["device"], r["health"]) for r in ranks] == [("0", "cpu", "ok"), ("1", "cpu", "ok")]
    status_item = page.locator(".distlab-status")
    assert status_item.inner_text() == "distlab: 2 ranks · ok"
    shot(page, "3-side-panel")

    # The panel's Stacks button: every rank's live frames, read by the server (between cells: idle).
    lab.locator("button.distlab-stacks-button").click()
    lab.locator(".distlab-stacks", has_text="ranks 0-1 (MainThread): idle, no cell running").wait_for(timeout=30_000)

    # Restart from the panel: fresh rank processes, shown in the panel.
    old_pids = {r["pid"] for r in ranks}
    lab.locator("button.distlab-restart").click()
    lab.locator(".distlab-message", has_text="fresh ranks ready").wait_for(timeout=120_000)
    page.wait_for_function(
        "old => { const rows = [...document.querySelectorAll('#distlab-panel .distlab-rank')];"
        " return rows.length === 2 && rows.every(r => !old.includes(r.children[2].textContent)); }",
        arg=sorted(old_pids),
        timeout=30_000,
    )
    assert [r["health"] for r in _panel_ranks(page)] == ["ok", "ok"]

    # The last cell stops the lab: the panel and the status bar let it go.
    stopped = nb.run(len(sources) - 1).inner_text()
    assert "lab stopped" in stopped, stopped
    page.locator("#distlab-panel .distlab-empty").wait_for(timeout=30_000)
    page.locator(".distlab-status").wait_for(state="hidden", timeout=10_000)
    shot(page, "4-stopped")

    # Start again (the first cell) and stop from the panel's Stop button this time.
    nb.run(0)
    lab.wait_for()
    pids = [int(r["pid"]) for r in _panel_ranks(page)]
    lab.locator("button.distlab-stop").click()
    page.locator("#distlab-panel .distlab-empty").wait_for(timeout=60_000)
    assert jupyter.labs() == []
    wait_for(lambda: not any(_alive(p) for p in pids), 15, "the stopped ranks to exit")

    # A lab kept past its kernel (one killed outside this server) waits in the panel for a notebook
    # to attach it; attached and stopped elsewhere, it leaves the panel.
    kept_id = _kernel_that_keeps_a_lab_and_dies(jupyter)
    waiting = page.locator(f"#distlab-panel .distlab-kept-lab[data-lab-id='{kept_id}']")
    waiting.wait_for(timeout=30_000)
    assert re.search(rf"2 ranks · gloo · ends in (59|60) min unless attached: %dist attach {kept_id}",
                     waiting.inner_text()), waiting.inner_text()
    shot(page, "5-kept")
    stop = subprocess.run([sys.executable, "-c", f"import distlab\ndistlab.attach({kept_id!r}).stop()"],
                          env=jupyter.env, capture_output=True, text=True, timeout=120, check=False)
    assert stop.returncode == 0, stop.stderr[-2000:]
    page.locator("#distlab-panel .distlab-empty").wait_for(timeout=30_000)

    assert page.js_errors == [] and page.console_errors == []
