"""The side panel's Step and Continue on a world paused at a collective, in headless Chromium.

A real JupyterLab server and kernel: the kernel starts a lab, arms a breakpoint and runs a cell, which
pauses every rank before its first collective. The panel shows where the ranks wait; its Step button
runs them to the next collective (the panel follows), Continue runs the cell to its end (the paused
line goes). The kernel then reads what the ranks computed. Screenshots go to test-artifacts/browser/.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _browser import browser_page, jupyterlab, shot
from _jupyter import JupyterLab, execute

pytestmark = pytest.mark.cluster

CELL = "t = torch.ones(2)\\ndist.all_reduce(t)\\ndist.barrier()\\nt.sum().item()"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[JupyterLab]:
    with jupyterlab(tmp_path, "jupyter-pause.log") as jupyter:
        yield jupyter


page = browser_page("pause-last.png")


def test_the_panels_step_and_continue_drive_a_world_paused_at_a_collective(server: JupyterLab, page: Any) -> None:
    session = server.new_session("paused.ipynb")
    client = server.kernel_client(session["kernel"]["id"])
    try:
        execute(client, f"import distlab\nlab = distlab.start(ranks=2)\nlab.pause(at=1)\nr = lab.run('{CELL}')")
        assert execute(client, "print(lab.paused.index, lab.paused.op)") == "1 all_reduce\n"
        page.goto(f"{server.url}/lab?token={server.token}")
        page.locator(".jp-SideBar .lm-TabBar-tab[data-id='distlab-panel']").click()
        lab = page.locator("#distlab-panel .distlab-lab[data-world-size='2']")
        paused = lab.locator(".distlab-paused")
        paused.wait_for(timeout=30_000)
        assert paused.inner_text() == "paused before collective 1: all_reduce on default_pg, line 2"
        shot(page, "pause-1-paused")

        lab.locator("button.distlab-step").click()
        page.wait_for_function(
            "() => (document.querySelector('#distlab-panel .distlab-paused') || {}).textContent"
            " === 'paused before collective 2: barrier on default_pg, line 3'", timeout=60_000)
        assert lab.locator(".distlab-message").inner_text() == "paused before collective 2 (barrier)"
        assert execute(client, "print(lab.paused.index, lab.paused.op)") == "2 barrier\n"

        lab.locator("button.distlab-continue").click()
        paused.wait_for(state="detached", timeout=60_000)
        lab.locator(".distlab-message", has_text="the cell ran to its end").wait_for(timeout=30_000)
        assert lab.locator("button.distlab-step").count() == 0  # nothing paused: no Step
        shot(page, "pause-2-continued")
        assert execute(client, "print(lab.paused, {k: v.tolist() for k, v in lab.pull('t').items()})") == \
            "None {0: [2.0, 2.0], 1: [2.0, 2.0]}\n"
        assert page.js_errors == [], page.js_errors
    finally:
        execute(client, "'lab' in globals() and lab.stop()")
        client.stop_channels()
