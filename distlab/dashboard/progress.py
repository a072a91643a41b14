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
import html
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from ..notebook.labs import Observer
from ..wire import PROGRESS_KEY, ProgressBar, ProgressPublish

__all__ = [
    "KEY",
    "CellProgress",
    "ProgressBars",
    "ProgressConfig",
    "Row",
    "bar_info",
    "bar_label",
    "render_html",
    "render_text",
    "rows_of",
    "text_line",
]

#: The key the ranks publish their bars under.
KEY = PROGRESS_KEY

#: (rank, the bar's place among the rank's bars, its state): one row of the widget.
Row = tuple[int, int, ProgressBar]


@dataclass(frozen=True)
class ProgressConfig:
    #: Seconds between redraws, at least: four a second at most, however many ranks and bars.
    min_interval_s: float = 0.25
    #: Widget messages in any one second, at most (a row's redraw is one per widget that changed:
    #: two as a bar moves). Half the dashboard's (``DashboardConfig``), so both together stay modest.
    max_messages_per_s: int = 10


# ------------------------------------------------------------------ text


def format_interval(seconds: float) -> str:
    """tqdm's clock: ``MM:SS``, or ``H:MM:SS`` from an hour on."""
    minutes, secs = divmod(max(0, int(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _si(number: float) -> str:
    """tqdm's ``unit_scale=True``: 1.23k, 45.6M."""
    for prefix in ("", "k", "M", "G", "T", "P", "E", "Z"):
        if abs(number) < 999.5:
            if abs(number) < 99.95:
                return f"{number:1.2f}{prefix}" if abs(number) < 9.995 else f"{number:2.1f}{prefix}"
            return f"{number:3.0f}{prefix}"
        number /= 1000
    return f"{number:3.1f}Y"


def _count(value: float, scale: bool | float) -> str:
    if scale is True:
        return _si(value)
    if scale and scale != 1:
        value = value * float(scale)
    if float(value).is_integer():
        return str(int(value))
    return f"{value:g}"


def _rate(bar: ProgressBar) -> str:
    unit, scale, rate = bar["unit"], bar["unit_scale"], bar["rate"]
    if rate is None:
        return f"?{unit}/s"
    if scale and scale is not True and scale != 1:
        rate *= float(scale)
    if 0 < rate < 1:
        return f"{1 / rate:.2f}s/{unit}"
    return f"{_si(rate) if scale is True else f'{rate:.2f}'}{unit}/s"


def fraction(bar: ProgressBar) -> float | None:
    """How far the bar is, 0 to 1; None when its total is unknown."""
    total = bar["total"]
    if not total:
        return None
    return min(1.0, max(0.0, bar["n"] / total))


def bar_label(rank: int, bar: ProgressBar) -> str:
    """``rank 0 train``: the rank, then the bar's ``desc`` (without tqdm's trailing colon)."""
    desc = bar["desc"].strip().rstrip(":").strip()
    return f"rank {rank} {desc}" if desc else f"rank {rank}"


def bar_info(bar: ProgressBar) -> str:
    """tqdm's ``n/total [elapsed<remaining, rate, postfix]``."""
    n, total, scale = bar["n"], bar["total"], bar["unit_scale"]
    rate, elapsed = bar["rate"], format_interval(bar["elapsed"])
    postfix = f", {bar['postfix']}" if bar["postfix"] else ""
    if total is None:
        return f"{_count(n, scale)} [{elapsed}, {_rate(bar)}{postfix}]"
    remaining = format_interval((total - n) / rate) if rate and rate > 0 and total >= n else "?"
    return f"{_count(n, scale)}/{_count(total, scale)} [{elapsed}<{remaining}, {_rate(bar)}{postfix}]"


def text_line(rank: int, bar: ProgressBar, label_width: int = 0, width: int = 20) -> str:
    """One bar as tqdm's terminal draws it: ``rank 0 train: 100%|████| 200/200 [00:02<00:00, 95.30it/s]``."""
    label = bar_label(rank, bar).ljust(label_width)
    done = fraction(bar)
    if done is None:
        return f"{label}: {bar_info(bar)}"
    filled = math.floor(done * width)
    return f"{label}: {done * 100:3.0f}%|{'█' * filled}{' ' * (width - filled)}| {bar_info(bar)}"


def rows_of(bars: dict[int, list[ProgressBar]]) -> list[Row]:
    """The widget's rows: by rank, then each rank's bars in the order they were made."""
    return [(rank, index, bar) for rank in sorted(bars) for index, bar in enumerate(bars[rank])]


def render_text(rows: list[Row]) -> str:
    """Every bar's line, the labels padded to one width: the saved notebook's view."""
    width = max((len(bar_label(rank, bar)) for rank, _, bar in rows), default=0)
    return "\n".join(text_line(rank, bar, width) for rank, _, bar in rows)


def render_html(rows: list[Row]) -> str:
    """The same as a table, each bar an HTML ``<progress>``."""
    cells = []
    for rank, _, bar in rows:
        done = fraction(bar)
        meter = "" if done is None else f'<progress value="{done:.4f}" max="1" style="width:16em"></progress>'
        percent = "" if done is None else f"{done * 100:.0f}%"
        cells.append(
            f"<tr><td style='text-align:left'>{html.escape(bar_label(rank, bar))}</td>"
            f"<td style='text-align:right'>{percent}</td><td>{meter}</td>"
            f"<td style='text-align:left'><code>{html.escape(bar_info(bar))}</code></td></tr>"
        )
    return f"<table class='distlab-progress'>{''.join(cells)}</table>"


# ------------------------------------------------------------------ a cell's bars


class CellProgress:
    """One cell's bars: ``on_poll`` is a listener on its polls; ``finish`` ends its display.

    ``live``: draw the widget while the cell runs (default: when this process is a kernel, whose
    front end shows widgets); else the bars' text is printed at the end.
    """

    def __init__(
        self,
        config: ProgressConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        live: bool | None = None,
    ) -> None:
        self.config = config or ProgressConfig()
        self._clock = clock
        self._live = live
        self._bars: dict[int, list[ProgressBar]] = {}
        self._seen: dict[int, int] = {}  # rank -> seq of its publish last read
        self._dirty = False
        self._done = False
        self.view: Any = None  # progress_view.ProgressView once displayed
        self._handle: Any = None

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
        elif self._dirty and not self._done:
            try:
                self._draw()
            except Exception as exc:  # noqa: BLE001 - a broken view must not break the cell it shows
                self._fail(exc)

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
        if self._live is None:
            self._live = in_kernel()
        if not self._live:
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

    def finish(self) -> None:
        """The cell has ended: show each bar's last state as text (the widget's display becomes it)."""
        if self._done:
            return
        self._done = True
        try:
            self._finish()
        except Exception as exc:  # noqa: BLE001 - the cell's own result matters more than its bars
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self._done = True
        import warnings

        warnings.warn(
            f"distlab: the progress bars failed and were left: {type(exc).__name__}: {exc}", RuntimeWarning, 2
        )

    def _finish(self) -> None:
        rows = self.rows()
        if not self._seen:
            return  # no rank made a bar
        bundle = {"text/plain": render_text(rows), "text/html": render_html(rows) if rows else ""}
        if self.view is not None:
            if self._handle is not None:
                self._handle.update(bundle, raw=True)
            self.view.close()
        elif rows:
            if self._live is None:
                self._live = in_kernel()
            if self._live:
                from IPython.display import display

                display(bundle, raw=True)
            else:
                print(bundle["text/plain"])


def _payload_of(ar: Any) -> ProgressPublish | None:
    try:
        data = ar.data
    except Exception:  # noqa: BLE001 - a dead engine's result may not answer
        return None
    payload = data.get(KEY) if isinstance(data, dict) else None
    # What a rank published under the progress key: a ProgressPublish (merge checks its keys).
    return cast(ProgressPublish, payload) if isinstance(payload, dict) else None


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (a front end shows its widgets)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


class ProgressBars(Observer):
    """A lab's observer: each cell that streams its output shows its ranks' bars (``CellProgress``)."""

    @contextlib.contextmanager
    def cell(self, lab: Any, stream: bool) -> Iterator[None]:
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
