"""What the instructor's view makes of a lab's entry in a learner's panel endpoint: how long it has
been idle, from the lab's state file's ``started`` and ``last_cell`` where it has them."""

from __future__ import annotations

from typing import Any

from distlab.classroom.roster import _lab_view

NOW = 1_800_000_000.0


def _lab(**fields: Any) -> dict[str, Any]:
    ranks = [{"rank": 0, "host": "h", "pid": 11, "health": "ok", "device": "cpu", "engine_id": 0}]
    return {"id": "lab-1-ab", "notebook": "a.ipynb", "world_size": 1, "backend": "gloo", "ranks": ranks, **fields}


def test_idle_counts_from_the_last_cell_else_the_start_and_is_zero_while_a_cell_runs() -> None:
    assert _lab_view(_lab(started=NOW - 600, last_cell=NOW - 60), NOW)["idle_s"] == 60
    assert _lab_view(_lab(started=NOW - 600, last_cell=None), NOW)["idle_s"] == 600
    assert _lab_view(_lab(started=NOW - 600, last_cell=NOW - 60, busy=True), NOW)["idle_s"] == 0


def test_a_state_file_without_the_times_shows_them_unknown_not_an_error() -> None:
    view = _lab_view(_lab(), NOW)
    assert view["started"] is None and view["last_cell"] is None and view["idle_s"] is None
    assert view["ranks"] == [{"rank": 0, "host": "h", "pid": 11, "health": "ok", "device": "cpu"}]
