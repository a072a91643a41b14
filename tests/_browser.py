"""Debian's chromium, driven by Playwright (whose own browser download is not used)."""

from __future__ import annotations

import os
import shutil
from typing import Any

__all__ = ["CHROMIUM", "chromium_or_skip", "launch_options"]

CHROMIUM = os.environ.get("DISTLAB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def launch_options() -> dict[str, Any]:
    return {
        "executable_path": CHROMIUM,
        "headless": True,
        "args": ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
    }


def chromium_or_skip() -> None:
    """Skip (with the fix) where chromium is missing; `make system-deps` installs it."""
    import pytest

    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no chromium at {CHROMIUM}: run `make system-deps` (Debian: apt-get install chromium)")


def press_run(page: Any, prompt: Any) -> None:
    """Click a code cell's prompt and press Shift+Enter until the cell shows it started (``[*]`` or
    its number): a key press can land before the notebook is listening."""
    import re

    for _ in range(3):
        prompt.click()
        page.keyboard.press("Shift+Enter")
        try:
            prompt.filter(has_text=re.compile(r"\[(\*|\d+)\]")).wait_for(timeout=10_000)
            return
        except Exception:  # noqa: BLE001, S112 - playwright's TimeoutError: the cell did not start
            continue
