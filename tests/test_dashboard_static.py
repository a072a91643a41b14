"""The dashboard's still picture: drawn from the telemetry it is given, with nothing that needs a kernel."""

from __future__ import annotations

import base64
import io
import struct

from test_dashboard_budget import _publish

from distlab.dashboard.static import StaticDashboard, render_png
from distlab.dashboard.store import TelemetryStore


def _store(steps: int) -> TelemetryStore:
    store = TelemetryStore(world_size=2)
    for step in range(steps):
        for rank in (0, 1):
            payload = _publish(rank, step)
            payload["records"][0]["loss"] *= 1 + rank  # two curves, each seen
            store.merge(payload)
    return store


def _pixels(png: bytes) -> object:
    from matplotlib.image import imread

    return imread(io.BytesIO(png), format="png")


def test_the_picture_draws_what_the_store_holds():
    empty, full = render_png(TelemetryStore(world_size=2)), render_png(_store(30))
    assert empty.startswith(b"\x89PNG") and full.startswith(b"\x89PNG")
    # The loss curves, the step times and the bandwidth points are drawn: pixels of rank 0's and
    # rank 1's colours appear in the picture of the telemetry, and not in the empty one.
    for png, expected in ((full, True), (empty, False)):
        image = _pixels(png)
        for color in ((0x63, 0x6E, 0xFA), (0xEF, 0x55, 0x3B)):
            rgb = [c / 255 for c in color]
            found = (abs(image[:, :, :3] - rgb).max(axis=2) < 0.02).sum()  # type: ignore[index]
            assert bool(found > 50) is expected, (color, found)


def test_the_output_holds_the_picture_and_the_summary_and_no_widget():
    summary = "distlab dashboard: 2 ranks, steps 0-4\n  rank 0: loss 1"
    board = StaticDashboard.of(_store(5), summary)
    bundle = board._repr_mimebundle_()
    assert set(bundle) == {"image/png", "text/plain"}
    assert base64.b64decode(bundle["image/png"]) == board.png
    assert bundle["text/plain"] == repr(board) == summary
    # The summary is drawn under the plots: the picture grows by its lines.
    heights = [struct.unpack(">II", render_png(_store(5), text)[16:24])[1] for text in ("", summary, summary * 3)]
    assert heights[0] < heights[1] < heights[2], heights
