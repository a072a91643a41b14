"""``python -m jupyterlab.browser_check``, its browser step driven by Python Playwright and Debian's
chromium instead of ``npx playwright install`` (which downloads a browser). Same app, same checks:
JupyterLab starts with every extension, no error in the page's #browserTest record, none logged by
the server. Exit status 0 when it passes."""

from __future__ import annotations

import json

from _browser import launch_options
from jupyterlab import browser_check
from playwright.async_api import async_playwright


async def run_browser(url: str) -> None:
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(**launch_options())
        try:
            page = await browser.new_page()
            await page.goto(url, timeout=60_000)
            await page.wait_for_selector("#jupyter-config-data", state="attached", timeout=60_000)
            record = await page.wait_for_selector("#browserTest", state="attached", timeout=100_000)
            await page.wait_for_selector(".completed", state="attached", timeout=100_000)
            errors = json.loads(await record.text_content() or "[]")
            # distlab's side panel is part of the app that started (hidden until opened).
            await page.wait_for_selector("#distlab-panel", state="attached", timeout=30_000)
        finally:
            await browser.close()
    if errors:
        raise RuntimeError(f"JupyterLab reported errors in the browser: {errors}")
    print("browser check: JupyterLab started in chromium with distlab's panel and no errors", flush=True)


browser_check.run_browser = run_browser  # looked up when the app starts its test


class BrowserCheck(browser_check.BrowserApp):
    name = __name__  # as when run with -m: the app is this module's server extension


def _jupyter_server_extension_points() -> list[dict[str, object]]:
    return [{"module": __name__, "app": BrowserCheck}]


if __name__ == "__main__":
    BrowserCheck.launch_instance()
