"""The live dashboard: an ipywidgets layout of plotly FigureWidgets fed by a TelemetryStore.

Redraws are throttled so a fast training loop cannot flood the front end: at most one refresh
per ``min_interval_s``, only figures whose data changed, each in one ``batch_update``, within a
budget of ``max_messages_per_s`` over any one-second window. The budget spends the messages the
widgets really sent (``meter``: making the figures, each draw); a draw goes ahead when what that
figure's draws have sent at most still fits. Figures left over wait for the next refresh, oldest
first. When a cell ends (``final``), every figure is drawn once more, whatever the budget, so the
last state is complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any

import ipywidgets as widgets

from ..records import StepRecord
from . import analysis, figures, meter
from .store import TelemetryStore

__all__ = ["Dashboard", "DashboardConfig", "dashboard_for"]


@dataclass(frozen=True)
class DashboardConfig:
    #: Seconds between refreshes, at least (each rank publishes once a second by default).
    min_interval_s: float = 0.5
    #: Widget messages in any one second, at most, while a cell runs (the final redraw excepted).
    max_messages_per_s: int = 20
    #: Steps the loss and divergence plots show (the latest).
    plot_steps: int = 500
    #: Steps the all-reduce timeline shows.
    timeline_steps: int = 5
    #: Steps the trace table shows.
    trace_steps: int = 2


class _Snapshot:
    """What one refresh reads from the store, each part computed only if a figure needs it."""

    def __init__(self, store: TelemetryStore, config: DashboardConfig) -> None:
        self.world_size = store.world_size
        self.meta = store.meta()
        records = store.records()
        last = records[-1]["step"] if records else 0
        self.records = [rec for rec in records if rec["step"] > last - config.plot_steps]
        self.ranks = sorted({rec["rank"] for rec in self.records})
        self.config = config

    @cached_property
    def layers(self) -> list[str]:
        first = self.meta.get(self.ranks[0]) if self.ranks else None
        return list((first.get("layers") if first else None) or [])

    @cached_property
    def divergence(self) -> analysis.Divergence:
        return analysis.divergence(self.records, self.meta)

    @cached_property
    def timeline(self) -> list[StepRecord]:
        """The records of the steps the all-reduce timeline shows."""
        shown = set(analysis.timed_steps(self.records, self.config.timeline_steps))
        return [rec for rec in self.records if rec["step"] in shown]

    @cached_property
    def stragglers(self) -> list[analysis.Straggler]:
        # Only the timeline marks them, and only for the steps it shows: a straggler is found from
        # one step's records alone, so the rest need not be read (a quarter of a refresh's time).
        return analysis.stragglers(self.timeline)

    @cached_property
    def link(self) -> analysis.LinkModel:
        return analysis.link_model(self.records, self.world_size)

    @cached_property
    def trace(self) -> list[analysis.TraceRow]:
        return analysis.trace_rows(self.records, self.ranks, self.config.trace_steps)

    def status(self) -> str:
        if not self.records:
            return "waiting for telemetry: call distlab.watch(model) on the ranks"
        last = self.records[-1]["step"]
        return f"{len(self.ranks)} ranks, step {last}. {self.divergence.message}"


#: Seconds without a redraw after which one figure is drawn whatever the window holds (``_redraw``):
#: longer than the budget ever holds one back (a full redraw fits in about a second and a half).
_STARVED_S = 2.0


class Dashboard(widgets.VBox):
    """Loss, collectives timeline, gradient-norm heatmap, replica divergence, busbw vs the ring model,
    memory per rank vs theory, and the step-by-step trace, live while a cell trains. Made by ``lab.dashboard()``."""

    def __init__(
        self,
        store: TelemetryStore,
        config: DashboardConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.config = config or DashboardConfig()
        self._clock = clock
        n = store.world_size
        self.figures: dict[str, Any] = {
            "loss": figures.make_loss(n),
            "timeline": figures.make_timeline(n),
            "heatmap": figures.make_heatmap(),
            "divergence": figures.make_divergence(n),
            "link": figures.make_link(),
            "memory": figures.make_memory(),
            "trace": figures.make_trace(),
        }
        self.status = meter.MeteredLabel(value="waiting for telemetry: call distlab.watch(model) on the ranks")
        grid = widgets.GridBox(
            children=[
                self.figures[name] for name in ("loss", "divergence", "timeline", "heatmap", "link", "memory", "trace")
            ],
            layout=widgets.Layout(grid_template_columns="repeat(2, minmax(0, 1fr))", width="100%"),
        )
        super().__init__(children=[self.status, grid])
        self._drawn = dict.fromkeys(self.figures, -1)  # store version each figure shows
        self._order = list(self.figures)  # least recently drawn first
        self._metered: dict[str, Any] = {**self.figures, "status": self.status}
        self._window = meter.MessageWindow(self.config.max_messages_per_s)
        self._cost: dict[str, int] = {}  # the most one update of each widget has sent
        # Making the figures sent messages too: the first redraws wait for them to leave the window.
        self._charge(self._clock())
        self._last_refresh = float("-inf")
        #: Widget messages each forced redraw (the cell's end: every figure, whatever the budget) sent.
        self.forced_messages: list[int] = []
        self._drawn_at = self._clock()  # when a figure was last drawn (made, at first)
        store.subscribe(self._on_store)

    @property
    def messages(self) -> int:
        """Widget messages this dashboard's figures and status line have sent so far, making them included."""
        return sum(meter.sent(w) for w in self._metered.values())

    def _on_store(self, final: bool) -> None:
        self.refresh(force=final)

    def refresh(self, force: bool = False) -> list[str]:
        """Redraw what changed, within the rate limits (all of it when ``force``); the names drawn."""
        now = self._clock()
        if not force and now - self._last_refresh < self.config.min_interval_s:
            return []
        self._last_refresh = now
        version = self.store.version
        stale = [name for name in self._order if self._drawn[name] != version]
        if not stale:
            return []
        snap = _Snapshot(self.store, self.config)
        self._charge(now)  # anything the widgets sent between refreshes (plotly answering the front end)
        before = self.messages
        drawn = self._redraw(stale, version, snap, now, force)
        if force:
            self.forced_messages.append(self.messages - before)
        return drawn

    def _redraw(self, stale: list[str], version: int, snap: _Snapshot, now: float, force: bool) -> list[str]:
        drawn: list[str] = []
        # Messages the front end asks for (plotly's answers to each resize of a live page) can keep
        # the window from ever emptying, and a first redraw waits for an empty one (its cost is not
        # known yet): after _STARVED_S without a redraw, the least recently drawn figure goes anyway.
        starved = now - self._drawn_at >= _STARVED_S
        for name in stale:
            if not force and not self._affordable(now, self._expected(name)) and not (starved and not drawn):
                break
            self._update(name, partial(self._draw, name, snap))
            self._drawn_at = now
            self._drawn[name] = version
            self._order.remove(name)
            self._order.append(name)
            drawn.append(name)
        text = snap.status()
        if text != self.status.value and (force or self._affordable(now, self._expected("status"))):
            self._update("status", partial(setattr, self.status, "value", text))
        return drawn

    def _update(self, name: str, change: Callable[[], None]) -> None:
        """Make a change to widget ``name`` and charge the window what it really sent, when it sent it."""
        before = meter.sent(self._metered[name])
        change()
        self._cost[name] = max(self._cost.get(name, 0), meter.sent(self._metered[name]) - before)
        # Not the refresh's start: reading the store and drawing take a while (tens of ms), and a
        # message charged earlier than it went out would leave the window that much too soon.
        self._charge(self._clock())

    def _expected(self, name: str) -> int:
        """What updating ``name`` will send: the most its updates have sent so far; for one never updated,
        the most any widget's update has sent; before any update, the whole budget (an empty window)."""
        if name in self._cost:
            return self._cost[name]
        return max(self._cost.values(), default=self.config.max_messages_per_s)

    def _draw(self, name: str, snap: _Snapshot) -> None:
        fig = self.figures[name]
        if name == "loss":
            figures.draw_loss(fig, snap.records, snap.world_size)
        elif name == "timeline":
            figures.draw_timeline(fig, snap.timeline, snap.stragglers, snap.config.timeline_steps)
        elif name == "heatmap":
            figures.draw_heatmap(fig, snap.records, snap.layers, snap.ranks)
        elif name == "divergence":
            figures.draw_divergence(fig, snap.divergence, snap.world_size)
        elif name == "link":
            figures.draw_link(fig, snap.link)
        elif name == "memory":
            rows = analysis.memory_by_rank(snap.records, snap.meta)
            figures.draw_memory(fig, rows, analysis.memory_message(rows, snap.meta))
        elif name == "trace":
            figures.draw_trace(fig, snap.trace)

    def _affordable(self, now: float, cost: int) -> bool:
        return self._window.affordable(now, cost)

    def _charge(self, now: float) -> None:
        """Charge the window, at ``now``, every message the widgets sent since it was last charged."""
        self._window.charge(now, self.messages)

    def summary(self) -> str:
        """The dashboard's state in plain text: what a saved or exported notebook keeps."""
        return "\n".join(analysis.summary(self.store.records(), self.store.meta(), self.store.world_size))

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        # The widget view for live front ends; the full summary, not ipywidgets' 110-character
        # repr, as text/plain for saved notebooks, nbconvert and nbval.
        bundle = super()._repr_mimebundle_(**kwargs)
        if isinstance(bundle, dict):
            bundle["text/plain"] = self.summary()
        return bundle

    def close(self) -> None:
        self.store.unsubscribe(self._on_store)
        if self.store.view is self:
            self.store.view = None
        for fig in self.figures.values():
            fig.close()
        super().close()


def dashboard_for(store: TelemetryStore, config: DashboardConfig | None = None) -> Dashboard:
    """The store's dashboard, made on first use (one per lab: every display shows the same widgets)."""
    existing = store.view
    if isinstance(existing, Dashboard) and config is None:
        return existing
    board = Dashboard(store, config)
    store.view = board
    return board
