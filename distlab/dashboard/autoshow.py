"""Show the dashboard in a ``%%ddp`` cell's output as soon as its ranks publish telemetry.

Only the store is imported here: a ``%%ddp`` cell that watches nothing pays for no widget or
plotting import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["autoshow", "prewarm"]

#: Whether a lab started in a kernel imports the dashboard's modules in the background (``prewarm``);
#: ``benchmarks/bench_first_dashboard.py`` turns it off for its baseline.
PREWARM = True
_prewarmed = False


def prewarm() -> None:
    """In a Jupyter kernel, import the dashboard's modules (ipywidgets, plotly, and through plotly
    nbformat and jsonschema, whose URI grammar alone takes about 1.7 s to build) and warm plotly's
    validators on a daemon thread, once: the first watched cell then shows its dashboard without
    waiting for them, and the ranks' output does not pause while they load. Elsewhere (a script)
    nothing is shown, so nothing is loaded.
    """
    global _prewarmed
    if _prewarmed or not PREWARM:
        return
    from IPython import get_ipython

    if getattr(get_ipython(), "kernel", None) is None:
        return
    _prewarmed = True
    import importlib
    import threading

    def load() -> None:
        with contextlib.suppress(Exception):  # what fails here fails again, visibly, when used
            importlib.import_module("distlab.dashboard.view")
            importlib.import_module("distlab.dashboard.figures").warm()

    threading.Thread(target=load, name="distlab-dashboard-import", daemon=True).start()


@contextlib.contextmanager
def autoshow(lab: Any) -> Iterator[None]:
    """While the block runs, display ``lab.dashboard()`` the first time new telemetry arrives; when
    it ends, redraw it, then turn the output into its still picture and text summary
    (``static.StaticDashboard``), so the saved notebook shows the final state with no kernel.
    ``lab.dashboard()`` in a later cell shows the live widgets again."""
    store = lab.telemetry
    start = store.version
    shown: list[Any] = []  # [dashboard, display handle] once displayed

    def on_change(final: bool) -> None:
        if shown or store.version == start or not len(store):
            return
        from IPython.display import display

        board = lab.dashboard()
        board.refresh()  # within the message budget, like every live redraw; the rest follows
        shown.extend([board, display(board, display_id=True)])

    store.subscribe(on_change)
    try:
        yield
    finally:
        store.unsubscribe(on_change)
        if shown:
            board, handle = shown
            board.refresh(force=True)
            if handle is not None:
                from .static import StaticDashboard

                handle.update(StaticDashboard.of(store, board.summary()))
