"""The widget of a cell's tqdm bars: a VBox of rows, each ``rank N desc`` | bar | ``n/total [...]``.

Imported when a rank's first bar appears (``progress.CellProgress``), with ipywidgets. Redraws keep
to a budget as the dashboard's do (``view.py``): at most one redraw per ``min_interval_s``; within
``max_messages_per_s`` over any one-second window, charged what the widgets really sent (each
counts its own messages, as ``meter``'s do); the rows least recently drawn first, so with many
ranks every row still moves, in turn. A row's redraw sends one message per widget that changed
(``hold_sync`` gathers a bar's value, maximum and colour into one).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import ipywidgets as widgets

from ..wire import ProgressBar
from .meter import MessageWindow, Metered, sent
from .progress_text import ProgressConfig, Row, bar_info, bar_label

__all__ = ["ProgressView"]


class _Label(Metered, widgets.Label):
    pass


class _IntBar(Metered, widgets.IntProgress):
    pass


class _FloatBar(Metered, widgets.FloatProgress):
    pass


class _Box(Metered, widgets.VBox):
    pass


def _is_float(bar: ProgressBar) -> bool:
    """A FloatProgress for a total that is not a whole number (tqdm counts bytes, seconds, ... too)."""
    total = bar["total"]
    return isinstance(total, float) and not total.is_integer()


def _bar_state(bar: ProgressBar, as_float: bool) -> tuple[float, float, str]:
    """(max, value, bar_style) of the bar's widget. An unknown total is a full bar, as tqdm.notebook's."""
    total, n = bar["total"], bar["n"]
    if not total:
        return 1, 1, "success" if bar["closed"] else "info"
    top: float = float(total) if as_float else max(1, math.ceil(total))
    value: float = min(top, max(0.0, float(n))) if as_float else min(top, max(0, math.floor(n)))
    style = ("success" if n >= total else "danger") if bar["closed"] else ""
    return top, value, style


class _Row:
    """One bar's row: its label, its bar, its numbers."""

    def __init__(self, rank: int, bar: ProgressBar, now: float) -> None:
        self.as_float = _is_float(bar)
        top, value, style = _bar_state(bar, self.as_float)
        self.name = _Label(value=bar_label(rank, bar), layout=widgets.Layout(min_width="10em"))
        kind = _FloatBar if self.as_float else _IntBar
        self.bar = kind(min=0, max=top, value=value, bar_style=style, layout=widgets.Layout(width="40%"))
        self.info = _Label(value=bar_info(bar))
        self.box = widgets.HBox(children=[self.name, self.bar, self.info])
        self.drawn_at = now

    def fits(self, bar: ProgressBar) -> bool:
        return _is_float(bar) == self.as_float

    def changes(self, rank: int, bar: ProgressBar) -> int:
        """How many of the row's widgets drawing ``bar`` changes: the messages it sends."""
        top, value, style = _bar_state(bar, self.as_float)
        return (
            int(self.name.value != bar_label(rank, bar))
            + int((self.bar.max, self.bar.value, self.bar.bar_style) != (top, value, style))
            + int(self.info.value != bar_info(bar))
        )

    def draw(self, rank: int, bar: ProgressBar, now: float) -> None:
        top, value, style = _bar_state(bar, self.as_float)
        with self.bar.hold_sync():
            if top >= self.bar.value:
                self.bar.max = top
                self.bar.value = value
            else:  # a smaller total (tqdm's reset): the value first, so it is not clipped to the old one
                self.bar.value = value
                self.bar.max = top
            self.bar.bar_style = style
        self.name.value = bar_label(rank, bar)
        self.info.value = bar_info(bar)
        self.drawn_at = now

    def sent(self) -> int:
        return sum(sent(w) for w in (self.name, self.bar, self.info))

    def close(self) -> None:
        for widget in (self.name, self.bar, self.info, self.box):
            for part in (getattr(widget, "layout", None), getattr(widget, "style", None)):
                if part is not None:
                    part.close()
            widget.close()


class ProgressView:
    """The rows of a cell's bars (``box``, the widget displayed), redrawn within the message budget."""

    def __init__(
        self, rows: list[Row], config: ProgressConfig | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.config = config or ProgressConfig()
        self._clock = clock
        now = clock()
        self._rows: dict[tuple[int, int], _Row] = {(rank, index): _Row(rank, bar, now) for rank, index, bar in rows}
        self.box = _Box(children=[row.box for row in self._rows.values()])
        self._closed: list[_Row] = []  # rows gone from the view: what they sent still counts
        self._window = MessageWindow(self.config.max_messages_per_s)
        self._last_refresh = now  # the rows were just made with their values

    @property
    def messages(self) -> int:
        """Widget messages the view has sent so far (widgets' opening messages not counted)."""
        rows = [*self._rows.values(), *self._closed]
        return sent(self.box) + sum(row.sent() for row in rows)

    def update(self, rows: list[Row], force: bool = False) -> bool:
        """Redraw what changed, within the budget (all of it when ``force``); True if all of it was drawn."""
        now = self._clock()
        if not force and now - self._last_refresh < self.config.min_interval_s:
            return False
        self._last_refresh = now
        self._charge(now)
        complete = True
        wanted = {(rank, index): (rank, bar) for rank, index, bar in rows}
        new = [key for key, (_, bar) in wanted.items() if key not in self._rows or not self._rows[key].fits(bar)]
        gone = [key for key in self._rows if key not in wanted]
        if new or gone:
            if force or self._affordable(now, 1):  # the rows themselves open their own widgets
                for key in [*gone, *new]:
                    row = self._rows.pop(key, None)
                    if row is not None:
                        row.close()
                        self._closed.append(row)
                for key in new:
                    rank, bar = wanted[key]
                    self._rows[key] = _Row(rank, bar, now)
                self.box.children = [self._rows[key].box for key in sorted(self._rows)]
                self._charge(self._clock())
            else:
                complete = False
        stale = [
            key
            for key, row in self._rows.items()
            if key in wanted and row.fits(wanted[key][1]) and row.changes(*wanted[key])
        ]
        for key in sorted(stale, key=lambda k: self._rows[k].drawn_at):
            row = self._rows[key]
            if not force and not self._affordable(now, row.changes(*wanted[key])):
                complete = False
                break
            row.draw(*wanted[key], now)
            self._charge(self._clock())
        return complete

    def _affordable(self, now: float, cost: int) -> bool:
        return self._window.affordable(now, cost)

    def _charge(self, now: float) -> None:
        """Charge the window, at ``now``, every message the widgets sent since it was last charged."""
        self._window.charge(now, self.messages)

    def close(self) -> None:
        for row in self._rows.values():
            row.close()
        for part in (self.box.layout, getattr(self.box, "style", None)):
            if part is not None:
                part.close()
        self.box.close()
