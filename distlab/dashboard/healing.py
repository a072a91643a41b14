"""A healing cell's quorums, skipped steps and heals in its output, live, then as text; ``lab.heals()``.

On a healing cell's ranks each step's quorum and each heal are recorded and published
(``rank.quorums``). :class:`CellHealing` listens to one cell's polls (:class:`HealingViews`, an
observer of every ``Lab``, adds one to each cell): the first time a rank's record arrives, a cell
that streams its output displays one widget (``quorums.render_html``: steps across, ranks down,
marked took part, skipped or healed; the quorums by runs of steps; the heals with their bytes and
seconds), redrawn at most every ``min_interval_s``. At the cell's end the display becomes the
record's text and HTML, which the saved notebook keeps; outside a kernel the text is printed. The
record of the last cell that healed stays for ``lab.heals()``.

ipywidgets is imported only when a record first arrives: a cell that does not heal pays for none.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..notebook.labs import Observer
from .progress import in_kernel
from .quorums import HealingLog, HealingRecord, render_html, render_text

__all__ = ["CellHealing", "HealingConfig", "HealingViews"]


@dataclass(frozen=True)
class HealingConfig:
    #: Seconds between redraws, at least (one widget message each).
    min_interval_s: float = 0.5


class CellHealing:
    """One cell's records: ``on_poll`` is a listener on its polls; ``finish`` ends its display.

    ``live``: draw the widget while the cell runs (default: when this process is a kernel); else the
    record's text is printed at the end. ``show=False``: collect only (a cell that does not stream).
    """

    def __init__(
        self,
        config: HealingConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        live: bool | None = None,
        show: bool = True,
    ) -> None:
        self.config = config or HealingConfig()
        self.log = HealingLog()
        self._clock = clock
        self._live = live
        self._show = show
        self._dirty = False
        self._done = False
        self._drawn_at = float("-inf")
        self.view: Any = None  # ipywidgets.HTML once displayed
        self._handle: Any = None

    def record(self) -> HealingRecord | None:
        """The cell's record so far; None while no rank has sent one (the cell does not heal)."""
        return self.log.record() if self.log else None

    def on_poll(self, pending: dict[int, Any], final: bool) -> None:
        """Lab listener: read each rank's latest record; draw within the budget; never raises."""
        try:
            self._dirty |= self.log.poll(pending)
            if final:
                self.finish()
            elif self._dirty and not self._done and self._show:
                self._draw()
        except Exception as exc:  # noqa: BLE001 - a broken view must not break the cell it shows
            self._fail(exc)

    def _draw(self) -> None:
        now = self._clock()
        if now - self._drawn_at < self.config.min_interval_s:
            return
        if self._live is None:
            self._live = in_kernel()
        if not self._live:
            self._dirty = False  # shown once, as text, at the end
            return
        record = self.log.record()
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

    def finish(self) -> None:
        """The cell has ended: show the record as text and HTML (the widget's display becomes it)."""
        if self._done:
            return
        self._done = True
        try:
            self._finish()
        except Exception as exc:  # noqa: BLE001 - the cell's own result matters more than this view
            self._fail(exc)

    def _finish(self) -> None:
        if not self.log or not self._show:
            return
        record = self.log.record()
        bundle = {"text/plain": render_text(record), "text/html": render_html(record)}
        if self.view is not None:
            if self._handle is not None:
                self._handle.update(bundle, raw=True)
            self.view.close()
            return
        if self._live is None:
            self._live = in_kernel()
        if self._live:
            from IPython.display import display

            display(bundle, raw=True)
        else:
            print(bundle["text/plain"])

    def _fail(self, exc: Exception) -> None:
        self._done = True
        warnings.warn(f"distlab: the healing view failed and was left: {type(exc).__name__}: {exc}", RuntimeWarning, 2)


class HealingViews(Observer):
    """A lab's observer: each cell's healing record, shown in a cell that streams its output; the last
    cell that healed keeps its record (``last``, what ``lab.heals()`` returns)."""

    def __init__(self) -> None:
        self.last: HealingRecord | None = None

    @contextlib.contextmanager
    def cell(self, lab: Any, stream: bool) -> Iterator[None]:
        healing = CellHealing(show=stream)
        lab.add_listener(healing.on_poll)
        try:
            yield
        finally:
            lab.remove_listener(healing.on_poll)
            healing.finish()
            with contextlib.suppress(Exception):  # a broken record must not break the cell's result
                record = healing.record()
                if record is not None:
                    self.last = record
