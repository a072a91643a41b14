"""A healing cell's quorums, skipped steps and heals in its output, live, then as text.

On a healing cell's ranks each step's quorum and each heal are recorded and published
(``rank.quorums``); in the notebook the lab's ``notebook.healing_record.HealingRecords`` reads them from
the cell's polls into one log, and keeps the last cell's record for ``lab.heals()``. This module only
draws that log: :class:`HealingViews` (an observer of every ``Lab``) watches each cell that streams
its output with a :class:`CellHealing`. The first time a record arrives it displays one widget
(``healing_record.render_html``: steps across, ranks down, marked took part, skipped or healed; the
quorums by runs of steps; the heals with their bytes and seconds), redrawn at most every
``min_interval_s``. At the cell's end the display becomes the record's text and HTML, which the
saved notebook keeps; outside a kernel the text is printed.

ipywidgets is imported only when a record first arrives: a cell that does not heal pays for none.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..notebook.healing_record import HealingLog, HealingRecord, HealingRecords, render_html, render_text
from ..notebook.observers import ObservedLab, Observer
from .cell_view import CellView

__all__ = ["CellHealing", "HealingConfig", "HealingViews"]


@dataclass(frozen=True)
class HealingConfig:
    #: Seconds between redraws, at least (one widget message each).
    min_interval_s: float = 0.5


class CellHealing(CellView):
    """One cell's healing log, drawn: ``on_log`` is told of it on each poll that brought news and at
    its end (``HealingRecords.watch``); ``finish`` ends its display.

    ``live``: draw the widget while the cell runs (default: when this process is a kernel); else the
    record's text is printed at the end.
    """

    what = "healing view"

    def __init__(
        self,
        config: HealingConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        live: bool | None = None,
    ) -> None:
        super().__init__(clock, live)
        self.config = config or HealingConfig()
        self._log: HealingLog | None = None
        self._drawn_at = float("-inf")

    def record(self) -> HealingRecord | None:
        """The cell's record so far; None while no rank has sent one (the cell does not heal)."""
        return self._log.record() if self._log else None

    def on_log(self, log: HealingLog, final: bool) -> None:
        """The cell's log has news (or the cell has ended): draw within the budget; never raises."""
        self._log, self._dirty = log, True
        if final:
            self.finish()
        else:
            self.redraw()

    def _draw(self) -> None:
        now = self._clock()
        if now - self._drawn_at < self.config.min_interval_s:
            return
        if not self._is_live():
            self._dirty = False  # shown once, as text, at the end
            return
        record = self.record()
        if record is None:
            return
        self._drawn_at, self._dirty = now, False
        if self.view is None:
            try:
                import ipywidgets as widgets
            except ImportError:  # no ipywidgets: text at the end only
                self._live = False
                return
            from IPython.display import display

            self.view = widgets.HTML(value=render_html(record))
            self._handle = display(self.view, display_id=True)
        else:
            self.view.value = render_html(record)

    def _final(self) -> dict[str, str] | None:
        record = self.record()
        if record is None:
            return None
        return {"text/plain": render_text(record), "text/html": render_html(record)}


class HealingViews(Observer):
    """A lab's observer: each cell that streams its output shows the healing log ``records`` reads."""

    def __init__(self, records: HealingRecords) -> None:
        self._records = records

    @contextlib.contextmanager
    def cell(self, lab: ObservedLab, stream: bool) -> Iterator[None]:
        if not stream:
            yield
            return
        view = CellHealing()
        self._records.watch(view.on_log)
        try:
            yield
        finally:
            self._records.unwatch(view.on_log)
            view.finish()
