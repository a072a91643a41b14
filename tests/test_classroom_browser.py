"""Three learners of one class run the start-here notebook at once, each in Chromium, through the hub.

Each logs in at the hub's own login page, gets their server (their user, their network, their
limits) with the class's notebooks in their home, opens the start-here notebook and runs it cell
by cell, the three side by side: every cell is started in all three pages before any is waited
for. Each learner sees their own ranks' output, and their side panel lists their lab alone.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _browser import chromium_or_skip, launch_options, press_run, wait_for_idle_kernel, write_settings
from _hub import USER_PASSWORD, Hub
from _jupyter import wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "00-start-here.ipynb"
ARTIFACTS = REPO / "test-artifacts" / "classroom"
LEARNERS = ["dl-amy", "dl-ben", "dl-cyd"]
CELL_DEADLINE_MS = 300_000  # three learners' ranks share the machine's cores


def _clean_copy(folder: Path) -> list[str]:
    """The start-here notebook without outputs, as a class hands it out; its code cells' sources."""
    nb = json.loads(NOTEBOOK.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    folder.mkdir(parents=True)
    (folder / NOTEBOOK.name).write_text(json.dumps(nb, indent=1))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def _settings(home: str, uid: int, gid: int) -> None:
    """Every cell in the DOM (no virtual scrolling), no news pop-ups: the learner's own JupyterLab settings."""
    write_settings(Path(home, ".jupyter", "lab", "user-settings"))
    for folder, dirs, files in os.walk(Path(home, ".jupyter")):
        for name in [".", *dirs, *files]:
            os.chown(os.path.join(folder, name), uid, gid)


class Learner:
    """One learner's page, driven as a person drives it."""

    def __init__(self, name: str, page: Any) -> None:
        self.name, self.page, self.runs = name, page, 0

    def cell(self, i: int) -> Any:
        return self.page.locator(".jp-NotebookPanel .jp-CodeCell").nth(i)

    def start(self, i: int) -> None:
        """Select code cell ``i`` and press Shift+Enter; return once it is queued or running."""
        prompt = self.cell(i).locator(".jp-InputArea .jp-InputPrompt").first
        try:
            press_run(self.page, prompt)
        except AssertionError as e:  # a dialog JupyterLab shows the learner: whose, and at which cell
            raise AssertionError(f"{self.name}'s page at cell {i}: {e}") from e
        self.runs += 1

    def wait(self, i: int) -> Any:
        prompt = self.cell(i).locator(".jp-InputArea .jp-InputPrompt").first
        prompt.filter(has_text=f"[{self.runs}]").wait_for(timeout=CELL_DEADLINE_MS)
        return self.cell(i).locator(".jp-OutputArea")


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[tuple[Hub, list[str]]]:
    chromium_or_skip()
    sources = _clean_copy(tmp_path / "notebooks")
    with Hub(tmp_path, LEARNERS, [], limits="ranks=4,labs=2", notebooks=tmp_path / "notebooks") as running:
        for name in LEARNERS:
            user = running.users[name]
            _settings(user.pw_dir, user.pw_uid, user.pw_gid)
        try:
            yield running, sources
        finally:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            (ARTIFACTS / "hub.log").write_text(running.log())


def _log_in(page: Any, hub: Hub, name: str) -> None:
    page.goto(f"{hub.url}/hub/login")
    page.locator("#username_input").fill(name)
    page.locator("#password_input").fill(USER_PASSWORD)
    page.locator("#login_submit").click()
    page.wait_for_url(re.compile(rf"/user/{name}/lab"), timeout=180_000, wait_until="commit")


@pytest.mark.timeout(900)  # the suite's 300 s is one cell's deadline here; three hubs' servers and ranks share 2 cores
def test_three_learners_run_the_start_here_notebook_at_once_each_on_their_own_ranks(
    hub: tuple[Hub, list[str]],
) -> None:
    from playwright.sync_api import sync_playwright

    running, sources = hub
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(**launch_options())
        learners = []
        try:
            for name in LEARNERS:
                context = browser.new_context(viewport={"width": 1400, "height": 950})
                page = context.new_page()
                page.set_default_timeout(60_000)
                learners.append(Learner(name, page))
                _log_in(page, running, name)
                page.goto(f"{running.url}/user/{name}/lab/tree/notebooks/{NOTEBOOK.name}")
            for learner in learners:
                learner.page.locator(".jp-NotebookPanel .jp-CodeCell").first.wait_for(timeout=120_000)
                wait_for_idle_kernel(learner.page, 180_000)

            outputs: dict[str, dict[int, Any]] = {name: {} for name in LEARNERS}
            for i in range(len(sources) - 1):  # the last cell stops the lab
                for learner in learners:
                    learner.start(i)
                for learner in learners:
                    outputs[learner.name][i] = learner.wait(i)

            hello = next(i for i, s in enumerate(sources) if "hello from rank" in s)
            tokens = {name: running.user_token(name) for name in LEARNERS}
            for learner in learners:
                text = outputs[learner.name][hello].inner_text()
                assert re.search(r"\[rank 0\] hello from rank 0 of 2", text), (learner.name, text)
                assert re.search(r"\[rank 1\] hello from rank 1 of 2", text), (learner.name, text)
                # Their side panel: their lab alone, from their notebook, on ranks that are theirs.
                learner.page.locator(".jp-SideBar .lm-TabBar-tab[data-id='distlab-panel']").click()
                labs = learner.page.locator("#distlab-panel .distlab-lab")
                labs.first.wait_for()
                assert labs.count() == 1
                assert labs.first.locator(".distlab-notebook").inner_text() == f"notebooks/{NOTEBOOK.name}"
                learner.page.screenshot(path=str(ARTIFACTS / f"{learner.name}.png"))
                status, said = running.request("GET", f"/user/{learner.name}/distlab/labs", token=tokens[learner.name])
                assert status == 200 and len(said["labs"]) == 1, said
                uid = running.users[learner.name].pw_uid
                for row in said["labs"][0]["ranks"]:
                    owner = int(Path(f"/proc/{row['pid']}/status").read_text().split("Uid:")[1].split()[0])
                    assert owner == uid, (learner.name, row)

            # The last cell stops each lab; every learner's ranks are gone.
            pids = {name: [r["pid"] for r in running.request("GET", f"/user/{name}/distlab/labs",
                                                               token=tokens[name])[1]["labs"][0]["ranks"]]
                    for name in LEARNERS}
            for learner in learners:
                learner.start(len(sources) - 1)
            for learner in learners:
                assert "lab stopped" in learner.wait(len(sources) - 1).inner_text()
            wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for ps in pids.values() for p in ps), 60,
                     "the learners' ranks to exit")
        finally:
            for learner in learners:
                learner.page.screenshot(path=str(ARTIFACTS / f"{learner.name}-last.png"))
                learner.page.context.close()
            browser.close()
