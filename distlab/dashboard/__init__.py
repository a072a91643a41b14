"""Notebook side of distlab's telemetry: the merged records and the live dashboard.

    lab.telemetry.records()     # one dict per rank per step, from distlab.watch(model) on the ranks
    lab.dashboard()             # ipywidgets + plotly, updated live while cells train

Fed only by data (``AsyncResult.data`` through ``lab.add_listener``); never imports what runs on
the ranks. Widgets and plotly load when a dashboard is first made, not on import.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .store import KEY, TelemetryStore

__all__ = ["KEY", "Dashboard", "DashboardConfig", "TelemetryStore", "autoshow", "dashboard_for"]

if TYPE_CHECKING:
    from .autoshow import autoshow
    from .view import Dashboard, DashboardConfig, dashboard_for

_LAZY = {"Dashboard": "view", "DashboardConfig": "view", "dashboard_for": "view", "autoshow": "autoshow"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'distlab.dashboard' has no attribute {name!r}")
