"""What the exercise tests share: the learner's lab, one exercise's checks of a cell's code, and the
contract each exercise's own test file keeps.

Every exercise is graded by the same two tests, in ``test_exercises_graded.py``, parametrized over
the catalog: its reference solution passes in every world it is graded in, and each mistake learners
make fails with feedback naming it. What is particular to an exercise is in its own file,
``test_exercise_<module>.py``, under these names (the two tests read them)::

    harness = Harness("ring-allreduce")   # its reference solution, changed, checked
    lab = learners_lab()                  # the shared learner's lab, as a fixture, for its own tests

    MISTAKES = {"reduce-scatter-a-step-short": (harness.changed("n - 1", "n - 2", 1), "not fully reduced")}

and, where it needs them, ``reference_measures(result)`` (asserts what the reference's passing result
must also have measured), ``MISTAKES_GRADED_AT = (3,)`` (the worlds its mistakes are graded in, when
fewer than the exercise's) and ``leftovers()`` (what a check must not leave behind: a list, empty).

A check runs the code as the learner's ``%%ddp`` cell on the lab, then grades it as ``%exercise check``
does (on the grader's own labs), with a fixed seed so that a failure can be drawn again, and without
recording it in the learner's progress.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from importlib import import_module
from types import ModuleType
from typing import Any

import pytest
from conftest import whole

from distlab import exercises
from distlab.exercises import catalog
from distlab.exercises.model import Exercise
from distlab.exercises.results import ExerciseResult
from distlab.front.lab import Lab

__all__ = ["ALL", "Harness", "each_exercise", "exercise_tests", "learners_lab"]

#: Every exercise of the catalog, in course order.
ALL: list[Exercise] = list(catalog.EXERCISES.values())
#: A test's parametrization over the catalog, each case named after its exercise.
each_exercise = pytest.mark.parametrize("exercise", ALL, ids=[e.name for e in ALL])


def learners_lab() -> Callable[..., Any]:
    """A fixture, ``lab``: the learner's 2-rank lab all exercise tests share (conftest's ``_learners_lab``).

    One for the whole run, not one per file: the grader's labs it keeps, one per world size, are
    started by the first check at that size and serve every exercise's checks after it. A test that
    left it with a dead rank gives the next one a whole world again.
    """

    @pytest.fixture
    def lab(_learners_lab: Lab) -> Lab:
        return whole(_learners_lab)

    return lab


def exercise_tests(exercise: Exercise) -> ModuleType:
    """The exercise's own test file, ``test_exercise_<module>.py``: an exercise without one fails its tests."""
    return import_module(f"test_exercise_{exercise.module}")


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

    def warm(self, lab: Lab) -> None:
        """Check the reference once, as a learner's earlier checks would have, before a test that stops a case
        at a short deadline: stopped while its ranks still import what a first case needs (torch's, past
        5 s on a loaded machine), a case leaves a module half imported there, and later cases fail on it."""
        result = self.check(lab, self.solution)
        assert result.passed, result.feedback

    def graded_only_at(self, monkeypatch: pytest.MonkeyPatch, *sizes: int) -> None:
        """Grade the exercise in worlds of ``sizes`` alone for this test (fewer restarts of the grader's lab)."""
        monkeypatch.setitem(catalog.EXERCISES, self.name, replace(catalog.EXERCISES[self.name], world_sizes=sizes))

    @staticmethod
    def grader_lab(lab: Lab, size: int) -> Lab:
        """The lab ``lab`` grades exercises on, at ``size`` ranks (as the last check left it, at that size)."""
        from distlab.exercises.grading import grading_lab

        return grading_lab(lab, size)
