"""The dashboard's last state as a still picture, for the saved notebook.

A live dashboard is a set of widgets: in a notebook reopened with no kernel they are gone
(JupyterLab shows "model not found", nbconvert nothing). When a watched cell ends, its dashboard
output becomes this: a PNG (safe in untrusted notebooks, and shown wherever only images render)
of the loss, step time against exposed communication, all-reduce bus bandwidth against the fitted
ring model, and memory per rank against theory, with the dashboard's text summary under them.
matplotlib draws it, off-screen (Agg), imported only when a cell that watched something ends.
"""

from __future__ import annotations

import base64
import io
import textwrap
from collections.abc import Sequence
from typing import Any

from ..records import StepRecord
from . import analysis
from .store import TelemetryStore

__all__ = ["StaticDashboard", "compact_png", "render_png"]

#: The live dashboard's colours for ranks (plotly's qualitative palette), so the two read alike.
_RANK_COLORS = (
    "#636EFA",
    "#EF553B",
    "#00CC96",
    "#AB63FA",
    "#FFA15A",
    "#19D3F3",
    "#FF6692",
    "#B6E880",
    "#FF97FF",
    "#FECB52",
)
_DPI = 80
#: Characters of the summary per line in the picture (8-point monospace across its 880 pixels).
_TEXT_WIDTH = 150


def _color(rank: int) -> str:
    return _RANK_COLORS[rank % len(_RANK_COLORS)]


def render_png(store: TelemetryStore, summary: str = "", plot_steps: int = 500) -> bytes:
    """The store's telemetry drawn as one PNG: four panels, each saying what it shows, and under
    them ``summary`` (the dashboard's text), so that the picture alone says everything."""
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend

    records = store.records()
    last = records[-1]["step"] if records else 0
    records = [rec for rec in records if rec["step"] > last - plot_steps]
    ranks = sorted({rec["rank"] for rec in records})
    lines = [wrapped for line in summary.splitlines() for wrapped in textwrap.wrap(line, _TEXT_WIDTH) or [""]]
    text_in = 0.17 * len(lines) + 0.2 if lines else 0.0
    fig = Figure(figsize=(11, 6.4 + text_in), dpi=_DPI, layout="constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=[3.2, 3.2, max(text_in, 0.01)])
    loss, times = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    link, memory = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    _draw_loss(loss, records, ranks)
    _draw_times(times, records, ranks)
    _draw_link(link, analysis.link_model(records, store.world_size))
    _draw_memory(memory, analysis.memory_by_rank(records, store.meta()))
    text = fig.add_subplot(grid[2, :])
    text.set_axis_off()
    if lines:
        text.text(0, 1, "\n".join(lines), family="monospace", fontsize=8, va="top", ha="left", transform=text.transAxes)
    fig.suptitle(f"distlab dashboard, last state: {len(ranks)} ranks, step {last}", fontsize=12)
    return compact_png(fig)


def compact_png(fig: Any) -> bytes:
    """A matplotlib figure as a PNG of 256 colours: a saved notebook carries the picture in every
    re-run's diff, and 256 colours (Pillow, matplotlib's own dependency) take it from about 60 KB to
    about 23 KB, lines and text looking the same."""
    drawn = io.BytesIO()
    fig.savefig(drawn, format="png")
    from PIL import Image

    out = io.BytesIO()
    Image.open(drawn).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(
        out, format="PNG", optimize=True
    )
    return out.getvalue()


def _series(records: Sequence[StepRecord], rank: int, key: str) -> tuple[list[int], list[float]]:
    mine = [rec for rec in records if rec["rank"] == rank and rec.get(key) is not None]
    steps = [rec["step"] for rec in mine]
    return steps, [float(rec[key]) for rec in mine]  # type: ignore[literal-required]  # key named at run time


def _draw_loss(ax: Any, records: Sequence[StepRecord], ranks: Sequence[int]) -> None:
    ax.set_title("loss per rank", fontsize=10)
    drawn = False
    for r in ranks:
        steps, values = _series(records, r, "loss")
        if steps:
            ax.plot(steps, values, color=_color(r), label=f"rank {r}", linewidth=1.2)
            drawn = True
    if drawn:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no loss logged (distlab.log(loss=...))", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step", fontsize=9)


def _draw_times(ax: Any, records: Sequence[StepRecord], ranks: Sequence[int]) -> None:
    ax.set_title("step time (solid) and exposed communication (dashed), ms", fontsize=10)
    for r in ranks:
        steps, total = _series(records, r, "step_time_s")
        _, comm = _series(records, r, "comm_s")
        ax.plot(steps, [t * 1e3 for t in total], color=_color(r), linewidth=1.0, label=f"rank {r}")
        ax.plot(steps, [c * 1e3 for c in comm], color=_color(r), linewidth=1.0, linestyle="--")
    if ranks:
        ax.legend(fontsize=8)
    ax.set_xlabel("step", fontsize=9)


def _draw_link(ax: Any, link: analysis.LinkModel) -> None:
    ax.set_title(textwrap.fill(link.message, 70), fontsize=9)
    unit, scale = link.unit
    if link.points:
        ax.scatter([s for s, _ in link.points], [b / scale for _, b in link.points], s=8, label="measured")
    if link.line:
        ax.plot([s for s, _ in link.line], [b / scale for _, b in link.line], color="black", label="ring model")
    if link.points:
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    ax.set_xlabel("all-reduce size, bytes", fontsize=9)
    ax.set_ylabel(f"bus bandwidth, {unit}", fontsize=9)


def _draw_memory(ax: Any, rows: Sequence[analysis.RankMemory]) -> None:
    ax.set_title("memory per rank at its last step, MB", fontsize=10)
    if not rows:
        ax.text(0.5, 0.5, "memory not recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    parts = (("parameters", "parameters_bytes"), ("gradients", "gradients_bytes"), ("optimizer", "optimizer_bytes"))
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for label, attr in parts:
        values = [getattr(row, attr) / 1e6 for row in rows]
        ax.bar(x, values, bottom=bottom, label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.scatter(x, [row.peak_bytes / 1e6 for row in rows], marker="_", s=400, color="black", label="peak of the step")
    theory = [(i, row.theory.total_bytes / 1e6) for i, row in zip(x, rows, strict=True) if row.theory is not None]
    if theory:
        ax.scatter(
            [i for i, _ in theory], [v for _, v in theory], marker="x", color="crimson", label="theory: model state"
        )
    ax.set_xticks(x, [f"rank {row.rank}" for row in rows])
    ax.legend(fontsize=8)


class StaticDashboard:
    """The picture (with the text summary drawn under the plots) and the summary as text: what a
    watched cell leaves in the notebook. One copy of the picture: JupyterLab, nbconvert's HTML and
    viewers that render only images show the PNG; text-only readers (nbval, a terminal) the text."""

    def __init__(self, png: bytes, summary: str) -> None:
        self.png = png
        self.summary = summary

    @classmethod
    def of(cls, store: TelemetryStore, summary: str) -> StaticDashboard:
        return cls(render_png(store, summary), summary)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        return {"image/png": base64.b64encode(self.png).decode("ascii"), "text/plain": self.summary}

    def __repr__(self) -> str:
        return self.summary
