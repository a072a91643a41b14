"""Coding exercises graded on the live ranks: the learner builds the thing, the grader runs it adversarially.

    %exercise                          # the exercises and the learner's progress
    %exercise ring-allreduce           # the task, the starter code, hints one at a time
    %exercise check ring-allreduce     # graded: distlab.exercises.check("ring-allreduce")

Each exercise is one folder, ``distlab/exercises/<module>/``: ``task.py`` (text, starter, hints),
``solution.py`` (the reference ``%%ddp`` cell) and ``grader.py`` (its cases, graded on the ranks).
The learner's code is what their ``%%ddp`` cells defined on the ranks. It is graded on ranks of the
grader's own (``grading.py``), against torch's own collectives and DDP, at several world sizes, with a
deadline per case; it never runs in the notebook's process. ``python -m distlab.exercises grade
NOTEBOOK.ipynb`` grades a learner's notebook headless and prints JSON.

This module imports nothing at import time (PEP 562): a rank imports ``distlab.exercises.<module>.grader``,
which runs this file first, and must not load the notebook side (``grading.py`` calls the ranks
through ``distlab.notebook``) nor the catalog of every task.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .catalog import EXERCISES, get, names
    from .grading import check, grade_all
    from .model import Exercise
    from .results import CaseResult, ExerciseResult
    from .view import Overview, TaskView, hint, overview, show

__all__ = [
    "EXERCISES",
    "CaseResult",
    "Exercise",
    "ExerciseResult",
    "Overview",
    "TaskView",
    "check",
    "get",
    "grade_all",
    "hint",
    "names",
    "overview",
    "show",
]

# name -> module that defines it; resolved on first use.
_LAZY = {
    "EXERCISES": "catalog",
    "get": "catalog",
    "names": "catalog",
    "check": "grading",
    "grade_all": "grading",
    "Exercise": "model",
    "CaseResult": "results",
    "ExerciseResult": "results",
    "Overview": "view",
    "TaskView": "view",
    "hint": "view",
    "overview": "view",
    "show": "view",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'distlab.exercises' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
