"""The harness the exercise tests share: a learner's lab per module, and one exercise's checks of a cell's code.

Each ``test_exercise_<module>.py`` says::

    harness = Harness("ring-allreduce")
    lab = learners_lab()           # the module's learner lab, a fixture

    def test_...(lab):
        result = harness.check(lab, harness.changed("n - 1", "n - 2"))

A check runs the code as the learner's ``%%ddp`` cell on the lab, then grades it as ``%exercise check``
does (on the grader's own lab), with a fixed seed so that a failure can be drawn again, and without
recording it in the learner's progress.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

import distlab
from distlab import exercises
from distlab.exercises import catalog
from distlab.exercises.results import ExerciseResult
from distlab.notebook.lab import Lab

__all__ = ["Harness", "learners_lab"]


def learners_lab() -> Callable[..., Any]:
    """A fixture, ``lab``: a learner's 2-rank lab kept for the module's tests, stopped after the last."""

    @pytest.fixture(scope="module")
    def lab() -> Iterator[Lab]:
        with distlab.start(ranks=2) as lab:
            yield lab

    return lab


class Harness:
    """One exercise's tests: its reference solution, the reference with a mistake put in, checks."""

    def __init__(self, name: str, seed: int = 7) -> None:
        self.name = name
        self.seed = seed

    @property
    def solution(self) -> str:
        return exercises.get(self.name).solution()

    def changed(self, old: str, new: str, count: int = -1) -> str:
        """The reference solution with ``old`` made ``new``: ``old`` must be there, or the test tests nothing."""
        assert old in self.solution, f"{old!r} is not in {self.name}'s reference solution"
        return self.solution.replace(old, new, count)

    def check(self, lab: Lab, code: str, **kwargs: Any) -> ExerciseResult:
        """``code`` run as the learner's cell on ``lab``, then graded (``kwargs`` go to ``exercises.check``)."""
        lab.run(code, stream=False)
        kwargs.setdefault("seed", self.seed)
        return exercises.check(self.name, lab, record=False, **kwargs)

    def graded_only_at(self, monkeypatch: pytest.MonkeyPatch, *sizes: int) -> None:
        """Grade the exercise in worlds of ``sizes`` alone for this test (fewer restarts of the grader's lab)."""
        monkeypatch.setitem(catalog.EXERCISES, self.name, replace(catalog.EXERCISES[self.name], world_sizes=sizes))

    @staticmethod
    def grader_lab(lab: Lab, size: int) -> Lab:
        """The lab ``lab`` grades exercises on, at ``size`` ranks (as the last check left it, at that size)."""
        from distlab.exercises.grading import grading_lab

        return grading_lab(lab, size)
