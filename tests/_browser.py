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
