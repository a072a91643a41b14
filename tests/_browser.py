"""Debian's chromium, driven by Playwright (whose own browser download is not used), and what the browser
tests share: their page, JupyterLab's settings for them, where their screenshots go."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["ARTIFACTS", "CHROMIUM", "answer_dialog", "browser_page", "chromium_or_skip", "jupyterlab", "launch_options",
           "press_run", "shot", "wait_for_idle_kernel", "write_settings"]

CHROMIUM = os.environ.get("DISTLAB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
#: The browser tests' screenshots and servers' logs.
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "browser"


def launch_options() -> dict[str, Any]:
    return {
        "executable_path": CHROMIUM,
        "headless": True,
        "args": ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
    }


def chromium_or_skip() -> None:
    """Skip (with the fix) where chromium is missing; `make system-deps` installs it."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no chromium at {CHROMIUM}: run `make system-deps` (Debian: apt-get install chromium)")


def answer_dialog(page: Any) -> None:
    """Deal with a JupyterLab dialog over the page as a person would, or say what it asks.

    "Select Kernel" is what JupyterLab asks when a cell is run in a notebook that has no kernel (its
    start was slow or failed on a loaded machine): a person accepts the notebook's own kernel, the
    dialog's default. Any other dialog fails the test with its text."""
    dialog = page.locator(".jp-Dialog")
    if not dialog.count():
        return
    text = dialog.first.inner_text()
    if "Select Kernel" not in text:
        raise AssertionError(f"a dialog covers the notebook: {text!r}")
    dialog.first.locator(".jp-mod-accept").click()
    dialog.first.wait_for(state="detached", timeout=30_000)


def wait_for_idle_kernel(page: Any, timeout_ms: int) -> None:
    """Wait until the open notebook's kernel is idle, as a person would: accepting "Select Kernel", and
    reloading the page once JupyterLab says a stylesheet failed to load (seen when three learners'
    servers start at once on 2 cores: the page is left unstyled, its kernel indicator never shown)."""
    import time

    deadline = time.monotonic() + timeout_ms / 1000
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first
    while True:
        dialog = page.locator(".jp-Dialog")
        if dialog.count() and "Error Loading Theme" in dialog.first.inner_text():
            dialog.first.locator(".jp-mod-accept").click()
            page.reload()
        else:
            answer_dialog(page)
        left_ms = (deadline - time.monotonic()) * 1000
        if left_ms <= 0:
            idle.wait_for(timeout=1)  # raises playwright's TimeoutError, naming what was awaited
        try:
            idle.wait_for(timeout=min(10_000, left_ms))
            return
        except Exception:  # noqa: BLE001, S112 - playwright's TimeoutError: look for a dialog again
            continue


def press_run(page: Any, prompt: Any) -> None:
    """Click a code cell's prompt and press Shift+Enter until the cell shows it started (``[*]`` or
    its number): a key press can land before the notebook is listening."""
    import re

    for _ in range(3):
        answer_dialog(page)
        try:
            prompt.click(timeout=20_000)
        except Exception:  # noqa: BLE001 - playwright's TimeoutError: a dialog came up over the cell
            answer_dialog(page)
            prompt.click()
        try:  # the locator's press has a deadline (the page's keyboard.press has none: CI saw one hang)
            prompt.press("Shift+Enter", timeout=30_000)
            prompt.filter(has_text=re.compile(r"\[(\*|\d+)\]")).wait_for(timeout=10_000)
            return
        except Exception:  # noqa: BLE001, S112 - playwright's TimeoutError: the key or the cell's start
            continue


def shot(page: Any, name: str) -> None:
    """A screenshot of ``page`` as ARTIFACTS / ``name``.png."""
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def write_settings(settings_dir: Path) -> None:
    """JupyterLab's settings for a test: every cell in the DOM (no virtual scrolling), and no news or
    update pop-ups over the page."""
    for plugin, values in {
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        path = settings_dir / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@contextlib.contextmanager
def jupyterlab(tmp_path: Path, log_name: str) -> Iterator[Any]:
    """A JupyterLab server (``_jupyter.JupyterLab``) for a browser test, serving ``tmp_path/notebooks``
    (made empty: the test writes its notebooks there first) with the browser tests' settings; its log
    is kept under ARTIFACTS as ``log_name`` however the test ends. Skips where Chromium is missing."""
    from _jupyter import JupyterLab

    chromium_or_skip()
    root = tmp_path / "notebooks"
    root.mkdir(exist_ok=True)
    jupyter = JupyterLab(root, tmp_path / "jupyter")
    write_settings(Path(jupyter.env["JUPYTERLAB_SETTINGS_DIR"]))
    try:
        with jupyter:
            yield jupyter
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / log_name).write_text(jupyter.log())


def browser_page(last_shot: str) -> Callable[..., Any]:
    """A fixture, ``page``: a Chromium page (1500 x 1000, 60 s per action) opened once the test module's
    ``server`` fixture is up. It keeps the page's uncaught errors in ``page.js_errors`` and its console's
    errors in ``page.console_errors``; its last state is saved as ARTIFACTS / ``last_shot``, pass or fail."""

    @pytest.fixture
    def page(server: object) -> Iterator[Any]:
        from playwright.sync_api import sync_playwright

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(**launch_options())
            context = browser.new_context(viewport={"width": 1500, "height": 1000})
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.js_errors, page.console_errors = [], []
            page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text))
            page.on("pageerror", lambda e: page.js_errors.append(f"uncaught: {e}"))
            try:
                yield page
            finally:
                page.screenshot(path=str(ARTIFACTS / last_shot))
                context.close()
                browser.close()

    return page
