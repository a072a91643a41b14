"""The ranks' tqdm bars in a cell's output: one widget with a row per bar, live, then text.

On a lab's ranks tqdm draws nothing: each bar reports its state (``rank.progress``), and each rank
publishes all of its bars under ``wire.PROGRESS_KEY``. :class:`CellProgress` listens to one cell's
polls (:class:`ProgressBars`, an observer of every ``Lab``, adds one to each cell that streams its
output, the ``%%ddp`` magic's and ``lab.run``'s): the first time a rank's ``AsyncResult.data`` holds
bars, it displays one widget, a row per bar (``rank N desc`` | the bar |
``n/total [elapsed<remaining, rate]``; ``progress_view``),
and redraws the rows that changed within a message budget. At the cell's end the display becomes
text (and HTML) of each bar's last state, which is what the saved notebook keeps. Outside a kernel
(a script driving a lab) that text is printed at the end.

ipywidgets is imported only when a bar first appears: a cell without tqdm pays for none.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from ..notebook.observers import ObservedLab, Observer
from ..wire import PROGRESS_KEY, ProgressBar, ProgressPublish
from .cell_view import CellView, in_kernel
from .progress_text import (
    ProgressConfig,
    Row,
    bar_info,
    bar_label,
    format_interval,
    fraction,
    render_html,
    render_text,
    rows_of,
    text_line,
)

if TYPE_CHECKING:
    from ..ipycompat import IppAsyncResult

__all__ = [
    "KEY",
    "CellProgress",
    "ProgressBars",
    "ProgressConfig",
    "Row",
    "bar_info",
    "bar_label",
    "format_interval",
    "fraction",
    "in_kernel",
    "render_html",
    "render_text",
    "rows_of",
    "text_line",
]

#: The key the ranks publish their bars under.
KEY = PROGRESS_KEY


# ------------------------------------------------------------------ a cell's bars


class CellProgress(CellView):
    """One cell's bars: ``on_poll`` is a listener on its polls; ``finish`` ends its display.

    ``live``: draw the widget while the cell runs (default: when this process is a kernel, whose
    front end shows widgets); else the bars' text is printed at the end.
    """

    what = "progress bars"

    def __init__(
        self,
        config: ProgressConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        live: bool | None = None,
    ) -> None:
        super().__init__(clock, live)
        self.config = config or ProgressConfig()
        self._bars: dict[int, list[ProgressBar]] = {}
        self._seen: dict[int, int] = {}  # rank -> seq of its publish last read

    def rows(self) -> list[Row]:
        return rows_of(self._bars)

    def on_poll(self, pending: dict[int, Any], final: bool) -> None:
        """Lab listener: read each rank's latest bars; draw them within the budget; never raises."""
        for rank, ar in pending.items():
            payload = _payload_of(ar)
            if payload is not None and self.merge(rank, payload):
                self._dirty = True
        if final:
            self.finish()
        else:
            self.redraw()

    def merge(self, rank: int, payload: ProgressPublish) -> bool:
        """Take a rank's publish; True if it is one not read before."""
        try:
            seq, bars = int(payload["seq"]), list(payload["bars"])
        except (KeyError, TypeError, ValueError):
            return False
        if self._seen.get(rank, -1) >= seq:
            return False
        self._seen[rank] = seq
        self._bars[rank] = bars
        return True

    def _draw(self) -> None:
        rows = self.rows()
        if not rows and self.view is None:
            self._dirty = False
            return
        if not self._is_live():
            self._dirty = False  # drawn once, as text, at the end
            return
        if self.view is None:
            try:
                from .progress_view import ProgressView
            except ImportError:  # no ipywidgets: text at the end only
                self._live = False
                return
            from IPython.display import display

            self.view = ProgressView(rows, self.config, self._clock)
            self._handle = display(self.view.box, display_id=True)
            self._dirty = False
        else:
            self._dirty = not self.view.update(rows)

    def _final(self) -> dict[str, str] | None:
        rows = self.rows()
        if not self._seen or (self.view is None and not rows):
            return None  # no rank made a bar
        return {"text/plain": render_text(rows), "text/html": render_html(rows) if rows else ""}


def _payload_of(ar: IppAsyncResult) -> ProgressPublish | None:
    try:
        data = ar.data
    except Exception:  # noqa: BLE001 - a dead engine's result may not answer
        return None
    payload = data.get(KEY) if isinstance(data, dict) else None
    # What a rank published under the progress key: a ProgressPublish (merge checks its keys).
    return cast(ProgressPublish, payload) if isinstance(payload, dict) else None


class ProgressBars(Observer):
    """A lab's observer: each cell that streams its output shows its ranks' bars (``CellProgress``)."""

    @contextlib.contextmanager
    def cell(self, lab: ObservedLab, stream: bool) -> Iterator[None]:
        if not stream:
            yield
            return
        progress = CellProgress()
        lab.add_listener(progress.on_poll)
        try:
            yield
        finally:
            lab.remove_listener(progress.on_poll)
            progress.finish()  # the bars' last state, as text
