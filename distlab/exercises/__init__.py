"""Coding exercises graded on the live ranks: the learner builds the thing, the grader runs it adversarially.

    %exercise                          # the exercises and the learner's progress
    %exercise ring-allreduce           # the task, the starter code, hints one at a time
    %exercise check ring-allreduce     # graded: distlab.exercises.check("ring-allreduce")

The learner's code is what their ``%%ddp`` cells defined on the ranks. It is graded on ranks of the
grader's own (``grading.py``), against torch's own collectives and DDP, at several world sizes, with a
deadline per case; it never runs in the notebook's process. ``python -m distlab.exercises grade
NOTEBOOK.ipynb`` grades a learner's notebook headless and prints JSON.
"""

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
