"""GET /distlab/progress on a real Jupyter server: the learner's quiz and exercise progress, read from
the file the quiz and the exercises' checks keep (``quiz.progress``), refused to strangers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _jupyter import JupyterLab

from distlab.quiz.loader import bank
from distlab.quiz.progress import ENV_VAR, Progress


@pytest.fixture
def jupyter(tmp_path: Path) -> Iterator[JupyterLab]:
    root = tmp_path / "notebooks"
    root.mkdir()
    with JupyterLab(root, tmp_path / "jupyter") as server:
        yield server


def test_progress_endpoint_summarises_the_quiz_and_exercises_and_refuses_strangers(
    jupyter: JupyterLab, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert jupyter.request("GET", "/distlab/progress", token=None)[0] == 403
    assert jupyter.request("GET", "/distlab/progress", token="not-the-token")[0] == 403
    status, empty = jupyter.request("GET", "/distlab/progress")
    assert status == 200, empty
    assert empty["questions"]["answered"] == empty["questions"]["right"] == 0
    assert empty["exercises"] == [] and empty["topics"] == [] and empty["last_seen"] is None

    # Written as a kernel of the server writes it: the same file, found by the same variable.
    monkeypatch.setenv(ENV_VAR, jupyter.env[ENV_VAR])
    first, second = bank().select(1)[:2]
    progress = Progress()
    progress.record(first.id, False)
    progress.record(first.id, True)  # the last answer is what counts as right
    progress.record(second.id, False)
    progress.record_exercise("ring-allreduce", True)
    checked = progress.record_exercise("ring-allreduce", False)

    status, body = jupyter.request("GET", "/distlab/progress")
    assert status == 200, body
    assert body["path"] == str(progress.path)
    assert body["questions"] == {"answered": 2, "right": 1, "attempts": 3,
                                 "in_bank": len(bank())}
    assert body["topics"] == [{"topic": first.topic, "title": body["topics"][0]["title"],
                               "questions": len(bank().select(1)), "answered": 2, "right": 1}]
    (exercise,) = body["exercises"]
    assert exercise["name"] == "ring-allreduce" and exercise["checks"] == 2
    assert exercise["passed"] is True and exercise["last_passed"] is False  # passed once, failed since
    assert body["exercises_passed"] == body["exercises_attempted"] == 1
    assert body["last_seen"] == pytest.approx(checked.last_seen)
