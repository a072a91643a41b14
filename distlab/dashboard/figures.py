"""The dashboard's plotly figures: each made once with its traces, then redrawn in one ``batch_update``.

A ``make_*`` function builds a ``FigureWidget`` with every trace it will ever need (adding traces
later costs widget messages); the matching ``draw_*`` sets their data from analysis results. Each
figure counts the widget messages it sends (``meter``): the dashboard's budget spends those.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative

from ..ipycompat_plotly import SharedBundleFigure
from ..records import StepRecord
from .analysis import Divergence, LinkModel, RankMemory, Straggler, TraceRow, timed_steps
from .meter import Metered, MeteredHTML

__all__ = [
    "draw_divergence",
    "draw_heatmap",
    "draw_link",
    "draw_loss",
    "draw_memory",
    "draw_timeline",
    "draw_trace",
    "make_divergence",
    "make_heatmap",
    "make_link",
    "make_loss",
    "make_memory",
    "make_timeline",
    "make_trace",
]

_HEIGHT = 300
_MARGIN = {"l": 50, "r": 20, "t": 40, "b": 40}
_STRAGGLER = "crimson"
_OP_COLORS = {"all_gather": "#1f77b4", "reduce_scatter": "#ff7f0e", "all_reduce": "#2ca02c",
              "all_to_all": "#9467bd", "broadcast": "#8c564b", "send": "#e377c2", "recv": "#7f7f7f"}
TRACE_COLUMNS = ("step", "epoch", "rank", "action", "local state", "global state")


class MeteredFigure(Metered, SharedBundleFigure, go.FigureWidget):
    """A plotly FigureWidget that counts the widget messages it sends, and whose page imports
    plotly's front end once for all figures (``ipycompat_plotly``), not once each."""


def warm() -> None:
    """Make, and drop, a plain figure (no widget, nothing sent) of every trace type the dashboard
    draws: plotly builds its validators on first use (about 0.4 s), and the first dashboard should
    not wait for that."""
    go.Figure(data=[go.Scatter(), go.Bar(), go.Heatmap(), go.Table()], layout=go.Layout(template="plotly_white"))


def _color(rank: int) -> str:
    palette: list[str] = qualitative.Plotly  # plotly ships no type hints: its colours are CSS strings
    return palette[rank % len(palette)]


def _figure(title: str, traces: list[Any], **layout: Any) -> MeteredFigure:
    settings: dict[str, Any] = {"title": {"text": title, "font": {"size": 13}}, "height": _HEIGHT,
                                "margin": _MARGIN, "template": "plotly_white"}
    settings.update(layout)
    # Layout given to the constructor travels in the widget's opening message; set afterwards, each
    # change would be a message of its own (measured: about 23 for the dashboard's six figures).
    return MeteredFigure(data=traces, layout=go.Layout(**settings))


# ---------------------------------------------------------------------------------- loss


def make_loss(world_size: int) -> MeteredFigure:
    traces = [go.Scatter(x=[], y=[], mode="lines", name=f"rank {r}", line={"color": _color(r)})
              for r in range(world_size)]
    return _figure("loss per rank", traces, xaxis_title="step", yaxis_title="loss")


def draw_loss(fig: MeteredFigure, records: Sequence[StepRecord], world_size: int) -> None:
    series: dict[int, tuple[list[int], list[float]]] = {r: ([], []) for r in range(world_size)}
    for rec in records:
        loss = rec.get("loss")
        if loss is not None and rec["rank"] in series:
            series[rec["rank"]][0].append(rec["step"])
            series[rec["rank"]][1].append(loss)
    with fig.batch_update():
        for r, (xs, ys) in series.items():
            fig.data[r].x, fig.data[r].y = _numbers(xs), _numbers(ys)


# ---------------------------------------------------------------------------------- timeline


def make_timeline(world_size: int) -> MeteredFigure:
    bars = go.Bar(x=[], y=[], base=[], orientation="h", name="all-reduce", opacity=0.75,
                  marker={"color": [], "colorscale": "Viridis", "line": {"color": [], "width": []}},
                  hovertemplate="%{hovertext}<extra></extra>", hovertext=[])
    late = go.Scatter(x=[], y=[], mode="markers", name="straggler (others waited for it)",
                      marker={"symbol": "x", "size": 10, "color": _STRAGGLER})
    # FSDP2's gathers and reductions, tensor parallelism's all-reduces, collectives written by hand.
    others = go.Bar(x=[], y=[], base=[], orientation="h", name="other collectives", opacity=0.75,
                    marker={"color": []}, hovertemplate="%{hovertext}<extra></extra>", hovertext=[])
    return _figure("collectives per rank: all-reduce buckets and others", [bars, late, others], barmode="overlay",
                   xaxis_title="seconds", showlegend=True, legend={"orientation": "h", "y": -0.25},
                   yaxis={"categoryorder": "array", "categoryarray": [f"rank {r}" for r in range(world_size)]})


def draw_timeline(fig: MeteredFigure, records: Sequence[StepRecord], late: Sequence[Straggler], steps: int = 5) -> None:
    """The buckets of the last ``steps`` steps, on each rank's wall clock (ranks on one host share it)."""
    shown = timed_steps(records, steps)
    recs = [rec for rec in records if rec["step"] in set(shown)]
    origin = min((rec["t"] for rec in recs), default=0.0)
    flagged = {(s.step, s.bucket, s.rank) for s in late}
    xs, ys, bases, colors, lines, widths, hover = [], [], [], [], [], [], []
    late_x, late_y = [], []
    for rec in recs:
        for b in rec["allreduce"]:
            start = rec["t"] - origin + b["start_s"]
            is_late = (rec["step"], b["bucket"], rec["rank"]) in flagged
            xs.append(b["seconds"])
            ys.append(f"rank {rec['rank']}")
            bases.append(start)
            colors.append(b["bucket"])
            lines.append(_STRAGGLER if is_late else "rgba(0,0,0,0)")
            widths.append(2 if is_late else 0)
            hover.append(f"step {rec['step']}, bucket {b['bucket']}: {b['bytes'] / 1e6:.2f} MB "
                         f"in {b['seconds'] * 1e3:.2f} ms on rank {rec['rank']}")
            if is_late:
                late_x.append(start + b["seconds"])
                late_y.append(f"rank {rec['rank']}")
    ox, oy, obase, ocolor, ohover = [], [], [], [], []
    for rec in recs:
        for c in rec.get("collectives") or []:
            ox.append(c["seconds"])
            oy.append(f"rank {rec['rank']}")
            obase.append(rec["t"] - origin + c["start_s"])
            ocolor.append(_OP_COLORS.get(c["op"], "gray"))
            of = f" of {c['layer']}" if c.get("layer") else ""
            ohover.append(f"step {rec['step']}, {c['op'].replace('_', '-')}{of} over {c['ranks']} ranks: "
                          f"{c['bytes'] / 1e6:.2f} MB in {c['seconds'] * 1e3:.2f} ms on rank {rec['rank']}")
    with fig.batch_update():
        bars, marks, others = fig.data
        bars.x, bars.y, bars.base, bars.hovertext = xs, ys, bases, hover
        bars.marker.color, bars.marker.line.color, bars.marker.line.width = colors, lines, widths
        marks.x, marks.y = late_x, late_y
        others.x, others.y, others.base, others.hovertext, others.marker.color = ox, oy, obase, ohover, ocolor
        kinds = ", ".join(sorted({c["op"].replace("_", "-") for rec in recs for c in rec.get("collectives") or []}))
        fig.layout.title.text = (f"collectives, steps {shown[0]}-{shown[-1]}: " + (f"{kinds}; " if kinds else "")
                                 + f"{len(late_x)} late arrivals" if shown else "collectives: none timed yet")


# ---------------------------------------------------------------------------------- memory

def make_memory() -> MeteredHTML:
    # A table, not a figure: a plotly figure costs 3 widget messages to make and the dashboard's
    # budget is 20 a second; a table costs one per change, and its numbers are what a learner compares.
    return MeteredHTML(value="<b>memory per rank</b>: not recorded yet", layout={"padding": "8px"})


def draw_memory(widget: MeteredHTML, rows: Sequence[RankMemory], message: str) -> None:
    """Per rank: parameters, gradients, optimizer state, model state and the step's peak (MB), against theory."""
    if not rows:
        return  # nothing recorded: nothing to send
    head = ("rank", "step", "parameters", "gradients", "optimizer state", "model state", "peak of the step",
            "theory: model state", "error")
    body = []
    for row in rows:
        cells = [str(row.rank), str(row.step)] + [f"{v / 1e6:.3f}" for v in (
            row.parameters_bytes, row.gradients_bytes, row.optimizer_bytes, row.resident_bytes, row.peak_bytes)]
        cells.append(f"{row.theory.total_bytes / 1e6:.3f}" if row.theory is not None else "no model")
        cells.append(f"{row.error:+.1%}" if row.error is not None else "")
        body.append("<tr>" + "".join(f"<td style='padding:2px 8px;text-align:right'>{c}</td>" for c in cells) + "</tr>")
    widget.value = (
        f"<div style='font-size:13px'><b>memory per rank (MB)</b><br>{html.escape(message)}"
        "<table><tr>" + "".join(f"<th style='padding:2px 8px'>{h}</th>" for h in head) + "</tr>"
        + "".join(body) + "</table></div>"
    )


# ---------------------------------------------------------------------------------- heatmap


def make_heatmap() -> MeteredFigure:
    heat = go.Heatmap(z=[], x=[], y=[], colorscale="Blues", colorbar={"title": {"text": "grad norm"}},
                      hovertemplate="%{y}, %{x}: %{z:.4g}<extra></extra>")
    return _figure("gradient norm by layer and rank", [heat], yaxis={"autorange": "reversed"})


def draw_heatmap(
    fig: MeteredFigure, records: Sequence[StepRecord], layers: Sequence[str], ranks: Sequence[int]
) -> None:
    """The latest step at which every rank has per-layer gradient norms."""
    by_step: dict[int, dict[int, dict[str, float]]] = {}
    for rec in records:
        if rec.get("grad_norm"):
            by_step.setdefault(rec["step"], {})[rec["rank"]] = rec["grad_norm"]
    full = [s for s, got in by_step.items() if all(r in got for r in ranks)]
    with fig.batch_update():
        if not full or not ranks:
            fig.data[0].z, fig.data[0].x, fig.data[0].y = [], [], []
            return
        step = max(full)
        names = list(layers) or sorted({n for g in by_step[step].values() for n in g})
        fig.data[0].z = [[by_step[step][r].get(name) for r in ranks] for name in names]
        fig.data[0].x = [f"rank {r}" for r in ranks]
        fig.data[0].y = names
        fig.layout.title.text = f"gradient norm by layer and rank, step {step}"


# ---------------------------------------------------------------------------------- divergence


def make_divergence(world_size: int) -> MeteredFigure:
    traces: list[Any] = [go.Scatter(x=[], y=[], mode="lines+markers", name=f"rank {r}", line={"color": _color(r)})
                         for r in range(world_size)]
    traces.append(go.Scatter(x=[], y=[], mode="markers", name="checksums differ",
                             marker={"symbol": "x", "size": 9, "color": _STRAGGLER}))
    return _figure("replica divergence", traces, xaxis_title="step",
                   yaxis_title="|W_rank| / |W_rank0| - 1", legend={"orientation": "h", "y": -0.25})


def draw_divergence(fig: MeteredFigure, verdict: Divergence, world_size: int) -> None:
    with fig.batch_update():
        for r in range(world_size):
            points = verdict.spread.get(r, [])
            fig.data[r].x = _numbers([s for s, _ in points])
            fig.data[r].y = _numbers([v for _, v in points])
        fig.data[world_size].x = _numbers(verdict.mismatch_steps)
        fig.data[world_size].y = np.zeros(len(verdict.mismatch_steps))
        short = verdict.message if len(verdict.message) <= 90 else verdict.message.split(":")[0]
        fig.layout.title.text = short
        fig.layout.title.font.color = _STRAGGLER if verdict.diverged else None


# ---------------------------------------------------------------------------------- busbw


def make_link() -> MeteredFigure:
    measured = go.Scatter(x=[], y=[], mode="markers", name="measured", marker={"size": 6, "opacity": 0.6})
    model = go.Scatter(x=[], y=[], mode="lines", name="ring model (fitted)", line={"color": "black"})
    return _figure("busbw vs ring model", [measured, model], xaxis={"type": "log", "title": {"text": "bucket bytes"}},
                   yaxis_title="busbw (GB/s)", legend={"orientation": "h", "y": -0.25})


def draw_link(fig: MeteredFigure, link: LinkModel) -> None:
    with fig.batch_update():
        fig.data[0].x = _numbers([s for s, _ in link.points])
        unit, scale = link.unit
        fig.data[0].y = _numbers([b / scale for _, b in link.points])
        fig.data[1].x = _numbers([s for s, _ in link.line])
        fig.data[1].y = _numbers([b / scale for _, b in link.line])
        fig.layout.title.text = link.message
        fig.layout.yaxis.title.text = f"busbw ({unit})"


# ---------------------------------------------------------------------------------- trace


def make_trace() -> MeteredFigure:
    table = go.Table(header={"values": list(TRACE_COLUMNS), "align": "left"},
                     cells={"values": [[] for _ in TRACE_COLUMNS], "align": "left"},
                     columnwidth=[0.6, 0.6, 0.6, 3, 3, 3])
    return _figure("the training round, step by step", [table], height=380)


def draw_trace(fig: MeteredFigure, rows: Sequence[TraceRow]) -> None:
    columns = [[r.step for r in rows], [r.epoch for r in rows], [r.rank for r in rows],
               [r.action for r in rows], [r.local for r in rows], [r.world for r in rows]]
    with fig.batch_update():
        fig.data[0].cells.values = columns


def _numbers(values: Sequence[float | None]) -> np.ndarray:
    """A float array for a trace: plotly checks and compares a list element by element in Python
    (about 10 ms a redraw of 1000 points), an array in one numpy call."""
    return np.asarray(values, dtype=np.float64)
