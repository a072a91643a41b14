"""plotly's front end travels to the page once per kernel, not once per figure (``ipycompat_plotly``).

Read where the widgets' comms publish their opening messages, without a kernel (as
``test_dashboard_budget`` reads theirs). That the page draws the figures from the shared bundle is
seen in the browser tests (``test_browser_ranks``: a line drawn in the live dashboard).
"""

from __future__ import annotations

import comm
import plotly
import pytest

from distlab import ipycompat_plotly
from distlab.dashboard.store import TelemetryStore
from distlab.dashboard.view import Dashboard


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The state of every widget opened from now on, in order; no bundle widget made before."""
    states: list[dict] = []

    def publish_msg(self: comm.DummyComm, msg_type: str, data: dict | None = None, **_: object) -> None:
        if msg_type == "comm_open" and data is not None:
            states.append(data["state"])

    monkeypatch.setattr(comm, "create_comm", lambda **args: comm.DummyComm(**args))
    monkeypatch.setattr(comm.DummyComm, "publish_msg", publish_msg)
    monkeypatch.setattr(ipycompat_plotly, "_bundle", None)
    return states


def _sizes(states: list[dict]) -> tuple[list[int], list[int]]:
    """(bundle text lengths, figure module lengths) of the widgets opened."""
    bundles = [len(s["bundle"]) for s in states if "bundle" in s]
    figures = [len(s["_esm"]) for s in states if s.get("_model_name") == "AnyModel" and "bundle" not in s]
    return bundles, figures


def test_two_dashboards_send_plotlys_bundle_once_and_each_figure_a_small_module(opened):
    bundle = ipycompat_plotly.bundle_text()
    assert bundle is not None and len(bundle) > 1_000_000  # plotly.js: what each figure carried before
    Dashboard(TelemetryStore(2))
    Dashboard(TelemetryStore(4))
    bundles, figures = _sizes(opened)
    assert bundles == [len(bundle)], "one bundle, opened before any figure"
    anywidgets = [s for s in opened if s.get("_model_name") == "AnyModel"]
    assert "bundle" in anywidgets[0]
    assert len(figures) >= 12 and set(figures) == {len(ipycompat_plotly.FIGURE_ESM)}
    assert sum(figures) < len(bundle) / 100


def test_a_closed_bundle_widget_is_made_again_for_the_next_figure(opened):
    Dashboard(TelemetryStore(2))
    first = ipycompat_plotly.plotly_bundle()
    first.close()  # as Widget.close_all() does
    Dashboard(TelemetryStore(2))
    assert ipycompat_plotly.plotly_bundle() is not first
    assert len(_sizes(opened)[0]) == 2


@pytest.mark.parametrize("why", ["baseline", "release"])
def test_figures_keep_plotlys_own_module_when_sharing_is_off_or_the_release_is_not_known(opened, monkeypatch, why):
    if why == "baseline":
        monkeypatch.setattr(ipycompat_plotly, "SHARE", False)
    else:
        monkeypatch.setattr(plotly, "__version__", "8.0.0")
    Dashboard(TelemetryStore(2))
    bundles, figures = _sizes(opened)
    assert bundles == [] and ipycompat_plotly.plotly_bundle() is None
    assert figures and all(size > 1_000_000 for size in figures), figures  # plotly's own, whole
