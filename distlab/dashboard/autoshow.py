"""Show the dashboard in a ``%%ddp`` cell's output as soon as its ranks publish telemetry.

Only the store is imported here: a ``%%ddp`` cell that watches nothing pays for no widget or
plotting import (but for the background import a lab started in a kernel makes, ``prewarm``).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from ..notebook.observers import Listener, ObservedLab, Observer
from .cell_view import in_kernel

if TYPE_CHECKING:
    from .store import TelemetryStore
    from .view import Dashboard

__all__ = ["Prewarm", "WatchedLab", "autoshow", "prewarm"]


class WatchedLab(Protocol):
    """What ``autoshow`` reads of a lab (the ``Lab`` a person uses has it): its telemetry store, its
    dashboard, its poll listeners. Named here so that the views import no lab, which imports them."""

    @property
    def telemetry(self) -> TelemetryStore: ...
    def dashboard(self) -> Dashboard: ...
    def add_listener(self, listener: Listener) -> None: ...
    def remove_listener(self, listener: Listener) -> None: ...

#: Whether a lab started in a kernel imports the dashboard's modules in the background (``prewarm``);
#: ``benchmarks/bench_first_dashboard.py`` turns it off for its baseline.
PREWARM = True
_started = threading.Event()  # the background import was started
_loaded = threading.Event()  # ... and has finished (well or not)


def prewarm() -> None:
    """In a Jupyter kernel, import the dashboard's modules (ipywidgets, plotly, and through plotly
    nbformat and jsonschema, whose URI grammar alone takes about 1.7 s to build) and warm plotly's
    validators on a daemon thread, once: the first watched cell then shows its dashboard without
    waiting for them, and the ranks' output does not pause while they load. Elsewhere (a script)
    nothing is shown, so nothing is loaded.
    """
    if _started.is_set() or not PREWARM or not in_kernel():
        return
    _started.set()

    def load() -> None:
        try:
            with contextlib.suppress(Exception):  # what fails here fails again, visibly, when used
                importlib.import_module("distlab.dashboard.view")
                importlib.import_module("distlab.dashboard.figures").warm()
        finally:
            _loaded.set()

    threading.Thread(target=load, name="distlab-dashboard-import", daemon=True).start()


class Prewarm(Observer):
    """A lab's observer: once its ranks are up, import the dashboard's modules in the background
    (``prewarm``); not before, since the import would compete with the ranks' start for the cores."""

    def started(self, lab: ObservedLab) -> None:
        prewarm()


def _ready() -> bool:
    """Whether the live dashboard can be made now without the cell's output waiting for imports.

    In a kernel, until the background import has finished, the answer is no (and the import is
    started if it was not): the cell goes on streaming, and a later poll shows the dashboard.
    """
    if not PREWARM or not in_kernel():
        return True  # the baseline, or nowhere to show it live: import when needed
    prewarm()
    return _loaded.is_set()


@contextlib.contextmanager
def autoshow(lab: WatchedLab) -> Iterator[None]:
    """While the block runs, display ``lab.dashboard()`` at the first poll after new telemetry
    arrived at which its modules are loaded; when it ends, redraw it, then turn the output into its
    still picture and text summary (``static.StaticDashboard``), so the saved notebook shows the
    final state with no kernel. A cell that ended before the live dashboard could show leaves the
    picture alone. ``lab.dashboard()`` in a later cell shows the live widgets again."""
    store = lab.telemetry
    start = store.version
    shown: list[Any] = []  # [dashboard, display handle] once displayed

    def has_news() -> bool:
        return store.version != start and len(store) > 0

    def on_poll(pending: Any, final: bool) -> None:
        if shown or final or not has_news() or not _ready():
            return
        from IPython.display import display

        board = lab.dashboard()
        board.refresh()  # within the message budget, like every live redraw; the rest follows
        shown.extend([board, display(board, display_id=True)])

    lab.add_listener(on_poll)
    try:
        yield
    finally:
        lab.remove_listener(on_poll)
        from IPython.display import display

        from . import analysis
        from .static import StaticDashboard

        if shown:
            board, handle = shown
            board.refresh(force=True)
            if handle is not None:
                handle.update(StaticDashboard.of(store, board.summary()))
        elif has_news():
            summary = "\n".join(analysis.summary(store.records(), store.meta(), store.world_size))
            display(StaticDashboard.of(store, summary))
