"""The ranks' tqdm bars as text and HTML, as tqdm's terminal draws them (pure): what a cell's bars
show at its end, and the labels of the live widget's rows (``progress_view``)."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

from ..wire import ProgressBar

__all__ = [
    "ProgressConfig",
    "Row",
    "bar_info",
    "bar_label",
    "format_interval",
    "fraction",
    "render_html",
    "render_text",
    "rows_of",
    "text_line",
]

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
